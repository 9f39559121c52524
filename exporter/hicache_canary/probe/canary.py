"""One reuse canary against one SGLang server: preflight, cold, pressure, rehost, again.

R is a fresh run of random token ids (ids 1000..30000, so no special tokens and no stale hit from
an earlier probe), sent with `max_new_tokens: 1` through `/generate` (`input_ids`: exact lengths,
no tokenizer needed) or, when only the OpenAI API is reachable, as a text of random words through
`/v1/completions`. SGLang's counters are snapshotted around every step. Pressure is sized and
stopped by pressure.py; the verdict comes from verdict.decide (pure).

The probe never raises for target trouble: every SGLangError becomes `verdict=error` with the
client's bounded reason and a one-line evidence. Requests are sent one at a time from the calling
task, so on cancellation the request in flight is abandoned by httpx closing its connection (SGLang
aborts a request whose client disconnected) and nothing of ours is left running; the
CancelledError is re-raised. `/flush_cache` is never called: it would wipe the host tier too.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache_canary.models import (
    CachedTokens,
    CounterSnapshot,
    ErrorReason,
    GenerateResult,
    Phase,
    ProbeRecord,
    ProbeSettings,
    ServerFacts,
    StepRecord,
    Verdict,
)
from hicache_canary.probe.prompts import Prompts, busy_reason
from hicache_canary.probe.pressure import (
    BUSY,
    CAP,
    MIN_CONTEXT_TOKENS,
    RADIX_GRAIN_TOKENS,
    Move,
    Progress,
    clamp_context,
    eviction_confirmed,
    next_move,
    plan_pressure,
    prime_tail,
    r_sends,
    server_rate,
    turnover,
)
from hicache_canary.probe.continuity import broken_continuity
from hicache_canary.probe.dp_rotation import PROCESS_ROTATION, DpRankRotation, pinned_rank
from hicache_canary.probe.sglang_client import SGLangClient, SGLangError
from hicache_canary.probe.sglang_metrics import looks_like_router
from hicache_canary.probe.verdict import decide

log = logging.getLogger("hicache_canary.probe.canary")

WARMUP_TOKENS = RADIX_GRAIN_TOKENS
FRESH_PROMPT_TOKENS = 1024  # prompt tokens below which a server has served nothing but its own start-up warm-up
ROUTER_EVIDENCE = "the target looks like a router (sgl-router/SMG): a rehost may land on another worker; probe the workers directly"


@dataclass(frozen=True)
class ProgressEvent:
    phase: Phase | str
    tokens_sent: int
    tokens_planned: int
    elapsed_s: float
    note: str = ""


ProgressFn = Callable[[ProgressEvent], None]

class _Stop(Exception):
    """Ends a probe early with an error reason (target trouble we detected ourselves)."""

    def __init__(self, reason: ErrorReason, evidence: str):
        super().__init__(evidence)
        self.reason, self.evidence = reason, evidence


async def run_probe(
    client: SGLangClient,
    settings: ProbeSettings,
    *,
    progress: ProgressFn | None = None,
    rng: random.Random | None = None,
    dp_ranks: DpRankRotation | None = None,
) -> ProbeRecord:
    """Run one probe and return its record with verdict, cause and evidence filled in.

    `dp_ranks`: whose turn of DP ranks this probe takes on a DP server (default: the process's).
    """
    return await _Probe(client, settings, progress, rng or random.Random(), dp_ranks or PROCESS_ROTATION).run()


class _Probe:
    def __init__(self, client: SGLangClient, settings: ProbeSettings, progress: ProgressFn | None, rng: random.Random,
                 dp_ranks: DpRankRotation):
        self.c, self.s, self.progress, self.dp_ranks = client, settings, progress, dp_ranks
        self.rec = ProbeRecord(target=settings.target, started_at=time.time())
        self.t0 = time.monotonic()
        self.facts = ServerFacts()
        self.phase: Phase | str = "preflight"
        self.sent = 0
        self.planned = 0
        self.dp_rank: int | None = None
        self.metrics_on = True
        self.first: CounterSnapshot | None = None
        self.t_first = self.t0
        self.prev: CounterSnapshot | None = None  # the latest snapshot: a restart shows against it
        self.sent_at_prev = 0  # self.sent when `prev` was taken
        self.r_ids: list[int] = []
        self.r_text = ""
        self.prompts = Prompts(rng)

    async def run(self) -> ProbeRecord:
        try:
            if await self.preflight():
                if self._fresh():
                    await self.warm_up()
                cold = await self.send_r(Phase.COLD, self.first)
                planted = cold.after
                if self.facts.write_policy == "write_through_selective":
                    # Selective backs a node up on its second hit; a returning context gets one, so R does.
                    planted = (await self.send_r(Phase.PRIME, cold.after)).after
                pressure = await self.pressure(planted)
                if self.rec.pressure.limited_by == "server_busy":
                    # Rehost and again would put R twice more in front of a queue of real users.
                    self.rec.verdict = Verdict.SKIPPED_BUSY
                    self.rec.evidence = (
                        f"the server became busy during pressure and stayed busy; probe stopped before rehost "
                        f"after {self.rec.tokens_canary + self.rec.tokens_pressure} tokens"
                    )
                else:
                    rehost = await self.send_r(Phase.REHOST, pressure.after)
                    await self.send_r(Phase.AGAIN, rehost.after)
        except SGLangError as exc:
            self.rec.reason, self.rec.evidence = exc.reason, f"{self._where()}: {exc.message}"
        except _Stop as stop:
            self.rec.reason, self.rec.evidence = stop.reason, stop.evidence
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of ours: still a record, never a crashed scheduler
            log.debug("probe of %s failed internally", self.s.target, exc_info=True)
            self.rec.reason = ErrorReason.INTERNAL
            self.rec.evidence = f"{self._where()}: internal error {type(exc).__name__}"
        self.rec.finished_at = time.time()
        d = decide(self.rec, self.s)
        self.rec.verdict, self.rec.cause, self.rec.reason = d.verdict, d.cause, d.reason
        self.rec.evidence, self.rec.host_fraction, self.rec.rehost_cold_ratio = d.evidence, d.host_fraction, d.rehost_cold_ratio
        self.emit("done", d.verdict.value)
        return self.rec

    def _where(self) -> str:
        return self.phase.value if isinstance(self.phase, Phase) else self.phase

    def emit(self, phase: Phase | str, note: str = "") -> None:
        self.phase = phase
        if self.progress is not None:
            self.progress(ProgressEvent(phase, self.sent, self.planned, time.monotonic() - self.t0, note))

    # --- preflight ---------------------------------------------------------------------

    async def preflight(self) -> bool:
        """Read the server; False when the probe must not send anything (verdict already decided)."""
        self.emit("preflight", "reading /server_info and /metrics")
        self.facts = self.rec.server = await self.c.server_info()
        if self.facts.looks_like_router:
            raise _Stop(ErrorReason.TARGET_IS_ROUTER, ROUTER_EVIDENCE)
        self.first = await self.snap()
        self.t_first = time.monotonic()
        if self.first is not None and looks_like_router(self.first):
            raise _Stop(ErrorReason.TARGET_IS_ROUTER, ROUTER_EVIDENCE)
        if not self.facts.enable_hierarchical_cache:
            return False
        busy = busy_reason(self.s, self.first)
        if busy:
            self.rec.verdict, self.rec.evidence = Verdict.SKIPPED_BUSY, busy
            return False
        length = clamp_context(self.s, self.facts)
        if length < MIN_CONTEXT_TOKENS:
            raise _Stop(ErrorReason.CONTEXT_TOO_LONG, f"the server's limits (max_req_input_len {self.facts.max_req_input_len}) leave no room for a probe context")
        self.rec.context_tokens = length
        self.r_ids = self.prompts.ids(length)
        self.dp_rank = pinned_rank(self.s.dp_rank, self.facts.dp_size, self.s.target, self.dp_ranks)
        self.rec.api = "openai" if self.s.api == "openai" else "native"
        self.planned = r_sends(self.facts) * length  # pressure is added once sized
        return True

    async def snap(self) -> CounterSnapshot | None:
        """SGLang's counters now; None when metrics are disabled. A restart ends the probe."""
        if not self.metrics_on:
            return None
        try:
            s = await self.c.metrics()
        except SGLangError as exc:
            if exc.status == 404:
                self.metrics_on = False
                return None
            raise
        # Against the previous snapshot, not only the first, and against what the server answered us
        # since: on a fresh server counters rebuilt after a restart climb past the first snapshot.
        why = broken_continuity(self.prev, s, self.sent - self.sent_at_prev) if self.prev is not None else None
        if why:
            raise _Stop(ErrorReason.SERVER_RESTARTED, f"{self._where()}: {why}")
        self.prev, self.sent_at_prev = s, self.sent
        return s

    def _fresh(self) -> bool:
        """Has the server served nothing real yet? Then its first request compiles kernels (live 0.5.17:
        10.2 s for 16 tokens, 0.1 s for 8,192 right after), and R's cold must not be that request.

        Not "no prompt tokens": SGLang's launcher sends a warm-up of its own (3 token ids, or a short
        sentence, per DP rank) that counts but compiles too little; every live fresh server read
        prompt_tokens_total 3 and then took 10.7-11.0 s for R. Without metrics nothing tells, and a
        warm-up costs a few tokens: assume fresh."""
        return self.first is None or (self.first.prompt_tokens or 0.0) < FRESH_PROMPT_TOKENS

    async def warm_up(self) -> None:
        self.emit(Phase.WARMUP, "first request of a fresh server: warming its kernels up before R")
        step = await self.one_request(Phase.WARMUP, self.first, None, WARMUP_TOKENS)
        # R's cold and the server's turnover rate are measured from here, without the warm-up in them.
        self.first, self.t_first = step.after, time.monotonic()

    # --- requests ------------------------------------------------------------------------

    async def send(self, ids: list[int] | None, tokens: int, tail: int = 0) -> GenerateResult:
        """One request; `ids` is R's (or None for new filler of about `tokens` tokens), followed by
        `tail` fresh tokens (R's prime on a hybrid model)."""
        if self.rec.api == "native":
            try:
                prompt = (ids or self.prompts.ids(tokens)) + (self.prompts.ids(tail) if tail else [])
                res = await self.c.generate(prompt, routed_dp_rank=self.dp_rank, timeout=self.s.timeout_s)
            except SGLangError as exc:
                if self.s.api != "auto" or exc.status not in (404, 405) or self.sent > 0:
                    raise
                self.rec.api = "openai"  # /generate not exposed here: OpenAI API only
                return await self.send(ids, tokens, tail)
        else:
            if ids is not None and not self.r_text:
                self.r_text = self.prompts.words(tokens)
            model = self.facts.served_model_name or self.facts.model_path
            text = self.r_text if ids is not None else self.prompts.words(tokens)
            if tail:
                text += " " + self.prompts.words(tail)
            res = await self.c.completion(text, model=model, timeout=self.s.timeout_s)
            if ids is not None and not tail:
                self.prompts.calibrate(self.r_text, res.prompt_tokens)
        self.sent += res.prompt_tokens
        return res

    async def send_r(self, phase: Phase, before: CounterSnapshot | None) -> StepRecord:
        self.emit(phase, "sending R")
        # The prime must make SGLang insert R again (its hit count grows while an insert walks R's
        # nodes). On a hybrid model R already matches to its last Mamba state, one token short of
        # its end, and an extension shorter than a checkpoint grain inserts nothing: so the prime
        # is R plus one grain of fresh tokens, a child of R that LRU evicts before R itself.
        tail = prime_tail(self.facts) if phase == Phase.PRIME else 0
        step = await self.one_request(phase, before, self.r_ids, len(self.r_ids), tail)
        if phase == Phase.COLD:
            self.rec.context_tokens = step.prompt_tokens
        self.emit(phase, f"{step.latency_s:.2f} s")
        return step

    async def one_request(self, phase: Phase, before: CounterSnapshot | None, ids: list[int] | None, tokens: int,
                          tail: int = 0) -> StepRecord:
        """A step of one request (`send`'s arguments), recorded with the counters after it."""
        step = StepRecord(phase, before=before)
        self.rec.steps.append(step)
        res = await self.send(ids, tokens, tail)
        step.latency_s, step.prompt_tokens, step.requests = res.latency_s, res.prompt_tokens, 1
        step.cached_tokens, step.cached = res.cached_tokens, _tiers(res)
        step.after = await self.snap()
        return step

    # --- pressure ------------------------------------------------------------------------

    async def pressure(self, planted: CounterSnapshot | None) -> StepRecord:
        step = StepRecord(Phase.PRESSURE, before=planted)
        self.rec.steps.append(step)
        pr = self.rec.pressure
        r_tokens = self.rec.context_tokens
        plan = plan_pressure(self.s, self.facts, planted, r_tokens)
        pr.planned_tokens = plan.need_tokens
        self.planned = r_sends(self.facts) * r_tokens + min(plan.need_tokens, plan.cap_tokens)
        self.emit(Phase.PRESSURE, f"LRU needs {plan.need_tokens} tokens of turnover")
        page = self.facts.page_size or 1
        # R's own allocation, taken out of the server's rate: its prompt tokens (what the uncached-prompt
        # fallback counts) plus a radix grain per request of ours for the generated token and alignment,
        # so an idle server never shows a trickle of "traffic" and waits for nothing.
        r_footprint = r_tokens + RADIX_GRAIN_TOKENS * r_sends(self.facts)
        window = self.s.passive_wait_s
        deadline = time.monotonic() + window
        now = planted
        while True:
            t = time.monotonic()
            rate = 0.0
            if turnover(planted, now) is not None:
                own = r_footprint + pr.synthetic_tokens + RADIX_GRAIN_TOKENS * pr.chunks
                rate = server_rate(turnover(self.first, now), own, t - self.t_first)
            busy = busy_reason(self.s, now)
            step_next = next_move(plan, planted, now, Progress(
                synthetic_sent=pr.synthetic_tokens, server_rate=rate, time_left_s=deadline - t, window_s=window,
                busy=bool(busy), busy_too_long=bool(busy) and t > deadline + window,
            ), page)
            if step_next.move == Move.STOP:
                if step_next.why in (CAP, BUSY):
                    pr.limited_by = step_next.why
                break
            if step_next.move == Move.WAIT:
                note = ("holding filler: " + busy.split(";")[0]) if step_next.why == BUSY else (
                    f"server traffic: {turnover(planted, now) or 0:.0f}/{plan.need_tokens} tokens at {rate:.0f}/s")
                self.emit(Phase.PRESSURE, note)
                await asyncio.sleep(self.s.poll_interval_s)
                now = await self.snap()
                continue
            res = await self.send(None, step_next.tokens)
            pr.synthetic_tokens += res.prompt_tokens
            pr.chunks += 1
            step.requests += 1
            now = await self.snap()
            self.emit(Phase.PRESSURE, f"filler {pr.chunks}")
        pr.eviction_confirmed = eviction_confirmed(planted, now, plan)
        # Only the server's own traffic: net allocations since R was planted minus our filler.
        pr.passive_tokens = int(max(0.0, min(plan.need_tokens, turnover(planted, now) or 0.0) - pr.synthetic_tokens))
        step.prompt_tokens = pr.synthetic_tokens
        step.after = now
        return step


def _tiers(res: GenerateResult) -> CachedTokens | None:
    """Per-tier cached tokens; a reported 0 cached tokens is all tiers 0 (SGLang then omits details)."""
    if res.details is not None:
        return res.details
    if res.cached_tokens == 0:
        return CachedTokens()
    return None
