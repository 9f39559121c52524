"""Per-target state: the immutable `TargetSnapshot` the collector, the API and the status page read,
and `fold`, the pure step that turns the last snapshot and one probe record into the next one.

The scheduler owns the loop and publishes what `fold` returns; nothing here does IO, reads a clock
or edits the record it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from hicache_canary.settings.config import Target
from hicache_canary.models import CounterSnapshot, ErrorReason, Phase, ProbeRecord, ServerFacts, Verdict
from hicache_canary.service.probe_work import DOWN_REASONS

# Listed, not derived from Phase: steps such as Phase.PRIME time R too but are never a latency label.
LATENCY_PHASES = (Phase.COLD, Phase.REHOST, Phase.AGAIN)
# Seconds; from a device hit (~0.1 s) to a cold 40K prefill (~15 s) and slow servers beyond.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
SKIPS = (Verdict.SKIPPED_BUSY, Verdict.SKIPPED_BUDGET)


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[int, ...] = (0,) * len(LATENCY_BUCKETS)  # cumulative counts per upper bound
    count: int = 0
    sum: float = 0.0

    def observe(self, v: float) -> Histogram:
        b = tuple(c + (1 if v <= ub else 0) for c, ub in zip(self.buckets, LATENCY_BUCKETS))
        return Histogram(b, self.count + 1, self.sum + v)


@dataclass(frozen=True)
class TargetSnapshot:
    """Everything the collector and the API show for one target, never mutated once published."""

    target: Target
    last: ProbeRecord | None = None
    last_measured: ProbeRecord | None = None  # the last probe that timed R at least once
    server: ServerFacts | None = None  # the last /server_info a probe read
    host_used_tokens: float | None = None
    host_total_tokens: float | None = None
    last_conclusive: ProbeRecord | None = None  # the last probe whose verdict is about HiCache itself
    last_conclusive_at: float | None = None
    last_error_reason: ErrorReason | None = None
    # Consecutive conclusive verdicts equal to the last conclusive one (`streak_verdict`). Errors,
    # not_evicted, inconclusive and skips say nothing about HiCache: they neither extend nor break it.
    streak: int = 0
    streak_verdict: Verdict | None = None
    since_conclusive: int = 0  # probes (skips not counted) since the last conclusive verdict
    in_progress: bool = False
    phase: str | None = None
    up: bool | None = None
    budget_remaining: int = 0
    next_probe_at: float | None = None  # wall clock
    watch_errors: int = 0  # restart-watch polls that failed
    restarts_detected: int = 0  # restarts the watch noticed between probes
    consecutive_errors: int = 0
    probes_total: Mapping[Verdict, int] = field(default_factory=lambda: MappingProxyType({}))
    errors_total: Mapping[ErrorReason, int] = field(default_factory=lambda: MappingProxyType({}))
    tokens_canary: int = 0
    tokens_pressure: int = 0
    passive_tokens: int = 0
    latency: Mapping[Phase, Histogram] = field(default_factory=lambda: MappingProxyType({}))


def fresh(target: Target) -> TargetSnapshot:
    """A target before its first probe: its whole hourly budget left."""
    return TargetSnapshot(target=target, budget_remaining=target.token_budget_per_hour)


def _up_after(s: TargetSnapshot, verdict: Verdict, rec: ProbeRecord, up: bool | None) -> bool | None:
    """`up` as the record tells it: an error says whether the server answered; a skip for budget
    leaves what the preflight saw (`up`, None when it could not tell); any other verdict is an answer."""
    if verdict == Verdict.ERROR:
        up = (rec.reason or ErrorReason.INTERNAL) not in DOWN_REASONS
    elif verdict not in SKIPS or verdict == Verdict.SKIPPED_BUSY:
        up = True
    return s.up if up is None else up


def fold(s: TargetSnapshot, rec: ProbeRecord, up: bool | None, budget_remaining: int) -> TargetSnapshot:
    """The snapshot after probe record `rec` (its `finished_at` set): counts, streaks, latencies.

    `up`: what the preflight saw of the server (None: could not tell); `budget_remaining`: tokens
    left in the hour once this probe's are counted.
    """
    verdict = rec.verdict or Verdict.ERROR
    probes = dict(s.probes_total)
    probes[verdict] = probes.get(verdict, 0) + 1
    errors = dict(s.errors_total)
    last_error = s.last_error_reason
    consecutive = 0
    if verdict == Verdict.ERROR:
        reason = rec.reason or ErrorReason.INTERNAL
        errors[reason] = errors.get(reason, 0) + 1
        last_error = reason
        consecutive = s.consecutive_errors + 1
    elif verdict in SKIPS:
        consecutive = s.consecutive_errors  # a skip is neither a success nor a failure
    streak, streak_verdict, since = s.streak, s.streak_verdict, s.since_conclusive
    if verdict.conclusive:
        streak = streak + 1 if verdict == streak_verdict else 1
        streak_verdict = verdict
        since = 0
    elif verdict not in SKIPS:
        since += 1
    latency = dict(s.latency)
    for phase in LATENCY_PHASES:
        step = rec.step(phase)
        if step is not None and step.latency_s is not None:
            latency[phase] = latency.get(phase, Histogram()).observe(step.latency_s)
    measured = any(rec.step(p) is not None and rec.step(p).latency_s is not None for p in LATENCY_PHASES)
    counters = latest_counters(rec)
    return replace(
        s,
        last=rec,
        last_measured=rec if measured else s.last_measured,
        server=rec.server or s.server,
        host_used_tokens=counters.host_used_tokens if counters and counters.host_used_tokens is not None else s.host_used_tokens,
        host_total_tokens=counters.host_total_tokens if counters and counters.host_total_tokens is not None else s.host_total_tokens,
        last_conclusive=rec if verdict.conclusive else s.last_conclusive,
        last_conclusive_at=rec.finished_at if verdict.conclusive else s.last_conclusive_at,
        last_error_reason=last_error,
        streak=streak,
        streak_verdict=streak_verdict,
        since_conclusive=since,
        in_progress=False,
        phase=None,
        up=_up_after(s, verdict, rec, up),
        budget_remaining=budget_remaining,
        consecutive_errors=consecutive,
        probes_total=MappingProxyType(probes),
        errors_total=MappingProxyType(errors),
        tokens_canary=s.tokens_canary + rec.tokens_canary,
        tokens_pressure=s.tokens_pressure + rec.tokens_pressure,
        passive_tokens=s.passive_tokens + rec.pressure.passive_tokens,
        latency=MappingProxyType(latency),
    )


def latest_counters(rec: ProbeRecord) -> CounterSnapshot | None:
    """The last SGLang counters the probe read, if it reached the server at all."""
    for step in reversed(rec.steps):
        for snap in (step.after, step.before):
            if snap is not None:
                return snap
    return None


def after_watch(s: TargetSnapshot, reachable: bool | None, failed: bool, restart: bool) -> TargetSnapshot | None:
    """The snapshot after one restart-watch poll; None when the poll changed nothing.

    A quiet poll is not published: it would re-render the target's /metrics lines 200 times a
    minute in a fleet, for nothing. `reachable` None: the poll could not tell.
    """
    up = s.up if reachable is None else reachable
    if up == s.up and not failed and not restart:
        return None
    return replace(s, up=up, watch_errors=s.watch_errors + (1 if failed else 0),
                   restarts_detected=s.restarts_detected + (1 if restart else 0))


def outcome_line(rec: ProbeRecord) -> str:
    """The log line of one probe: verdict (cause or reason), ratio, tokens sent, passive tokens."""
    verdict = rec.verdict or Verdict.ERROR
    detail = rec.cause.value if verdict == Verdict.SILENT else (rec.reason.value if rec.reason else "")
    ratio = "-" if rec.rehost_cold_ratio is None else f"{rec.rehost_cold_ratio:.3f}"
    return (f"{verdict.value}{f' ({detail})' if detail else ''} ratio={ratio} "
            f"tokens={rec.tokens_canary + rec.tokens_pressure} passive={rec.pressure.passive_tokens}")
