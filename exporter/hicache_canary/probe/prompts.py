"""What a probe sends: fresh random prompts, and whether the server is too busy to send them.

R and the filler are fresh runs of random token ids (1000..30000: no special tokens, and no stale hit
from an earlier probe); an OpenAI-only server gets a text of random plain words instead, whose
tokens per word are measured on R's first send.
"""

from __future__ import annotations

import random

from hicache_canary.models import CounterSnapshot, ProbeSettings

TOKEN_ID_RANGE = (1000, 30000)
# Plain words (one BPE token each in common tokenizers) for OpenAI-only servers.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death experience effect "
    "class control care field development role effort rate heart drug show leader light voice wife police "
    "mind price report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official matter center"
).split()


class Prompts:
    """Random prompts from one probe's rng."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.tokens_per_word = 1.0
        self.calibrated = False  # tokens_per_word measured on R's first send

    def ids(self, n: int) -> list[int]:
        lo, hi = TOKEN_ID_RANGE
        return [self.rng.randint(lo, hi) for _ in range(n)]

    def words(self, tokens: int) -> str:
        n = max(1, int(tokens / self.tokens_per_word))
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def calibrate(self, text: str, prompt_tokens: int) -> None:
        """Once: the server counted `prompt_tokens` for `text` (R's words)."""
        if not self.calibrated and prompt_tokens > 0:
            self.tokens_per_word = prompt_tokens / len(text.split())
            self.calibrated = True


def busy_reason(settings: ProbeSettings, snap: CounterSnapshot | None) -> str:
    """Why the server is too busy to probe now ("" when it is not, or when metrics do not say)."""
    if snap is None:
        return ""
    q, r = snap.num_queue_reqs, snap.num_running_reqs
    if q is not None and q > settings.busy_queue_threshold:
        return f"server busy: {q:.0f} queued requests (threshold {settings.busy_queue_threshold}); no tokens sent"
    if r is not None and settings.busy_running_threshold is not None and r > settings.busy_running_threshold:
        return f"server busy: {r:.0f} running requests (threshold {settings.busy_running_threshold}); no tokens sent"
    return ""
