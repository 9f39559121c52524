"""Recent probe results per target, keeping failures longer (blackbox's ResultHistory).

A bounded ring of the last N results; when a failure (verdict `error`) falls out of the ring it
moves to a smaller preserved list, so the reason a target broke at 3 a.m. is still visible after
a hundred healthy probes. Entries are plain JSON-ready dicts with every known secret scrubbed
from their text, so /api/targets can serve them as they are.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from hicache_canary.models import ProbeRecord, Verdict
from hicache_canary.shown import shown_text

MAX_EVIDENCE = 1000  # the client's messages are 300 characters; ours are a sentence or two


def _num(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(float(v), digits)


def eviction_confirmed(rec: ProbeRecord) -> bool:
    """Whether R left the device pool, as the verdict judged it.

    The pressure step's own flag says what SGLang's counters suggested while filler was sent; the
    rehost can prove them wrong (R still hit on device: `not_evicted`), and then what we show must
    be the verdict, not the guess.
    """
    return rec.pressure.eviction_confirmed and rec.verdict != Verdict.NOT_EVICTED


def record_to_dict(rec: ProbeRecord, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The probe table a person (or /api/targets) needs; no prompts, no request ids."""
    secrets = list(secrets)
    steps = []
    for s in rec.steps:
        steps.append(
            {
                "phase": s.phase.value,
                "latency_seconds": _num(s.latency_s),
                "prompt_tokens": s.prompt_tokens,
                "requests": s.requests,
                "cached_tokens": s.cached_tokens,
                "cached": None
                if s.cached is None
                else {"device": s.cached.device, "host": s.cached.host, "storage": s.cached.storage},
                "host_used_tokens_after": _num(s.after.host_used_tokens, 0) if s.after else None,
            }
        )
    server = rec.server
    return {
        "target": rec.target,
        "started_at": _num(rec.started_at, 3),
        "finished_at": _num(rec.finished_at, 3),
        "verdict": rec.verdict.value if rec.verdict else None,
        "cause": rec.cause.value,
        "reason": rec.reason.value if rec.reason else None,
        "evidence": shown_text(rec.evidence or "", secrets, MAX_EVIDENCE),
        "context_tokens": rec.context_tokens,
        "api": rec.api,
        "rehost_cold_ratio": _num(rec.rehost_cold_ratio),
        "host_fraction": _num(rec.host_fraction),
        "tokens": {"canary": rec.tokens_canary, "pressure": rec.tokens_pressure, "passive": rec.pressure.passive_tokens},
        "pressure": {
            "planned_tokens": rec.pressure.planned_tokens,
            "synthetic_tokens": rec.pressure.synthetic_tokens,
            "passive_tokens": rec.pressure.passive_tokens,
            "chunks": rec.pressure.chunks,
            "eviction_confirmed": eviction_confirmed(rec),
            "counters_suggested_eviction": rec.pressure.eviction_confirmed,
            "limited_by": rec.pressure.limited_by,
        },
        "server": None
        if server is None
        else {
            "version": server.version,
            "write_policy": server.write_policy,
            "hicache": server.enable_hierarchical_cache,
            "hybrid": server.hybrid_model,
            "speculative_algorithm": server.speculative_algorithm,
            "max_total_num_tokens": server.max_total_num_tokens,
        },
        "steps": steps,
    }


class ResultHistory:
    """Last `limit` results plus up to `limit // 2` older failures. Thread-safe."""

    def __init__(self, limit: int = 100, failure_limit: int | None = None):
        self.limit = limit
        self.failure_limit = failure_limit if failure_limit is not None else max(1, limit // 2)
        self._recent: deque[dict[str, Any]] = deque()
        self._failures: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._recent.append(entry)
            while len(self._recent) > self.limit:
                old = self._recent.popleft()
                if old.get("verdict") == Verdict.ERROR.value:
                    self._failures.append(old)
                    while len(self._failures) > self.failure_limit:
                        self._failures.popleft()

    def entries(self) -> list[dict[str, Any]]:
        """Oldest first: preserved failures, then the recent ring."""
        with self._lock:
            return [*self._failures, *self._recent]

    def recent(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._recent)
