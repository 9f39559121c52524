"""Pure: what one probe record says, read the same way by the verdict and the suspected cause.

R's length and cacheable tokens, counter deltas between two snapshots (an absent child of a family
the server has counts as 0), the counter families a server evidently exports, the host and device
tokens a step took by SGLang's counters, and the Decision type both modules return.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_canary.models import Cause, CounterSnapshot, ErrorReason, Phase, ProbeRecord, StepRecord, Verdict


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    cause: Cause = Cause.NONE
    reason: ErrorReason | None = None
    evidence: str = ""
    host_fraction: float | None = None
    rehost_cold_ratio: float | None = None


def r_prompt_tokens(record: ProbeRecord) -> int:
    """R's length: the prompt tokens SGLang counted for its cold send, else the configured context size."""
    cold = record.step(Phase.COLD)
    return (cold.prompt_tokens if cold and cold.prompt_tokens else record.context_tokens) or 0


def cacheable_tokens(record: ProbeRecord) -> int:
    """Tokens of R the radix cache can hold: what `again` hit, else R page-aligned down (minus the last)."""
    again = record.step(Phase.AGAIN)
    if again and again.cached and again.cached.total > 0:
        return again.cached.total
    length = r_prompt_tokens(record)
    page = max(1, record.server.page_size if record.server else 1)
    return max(1, ((length - 1) // page) * page)


def delta(before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return None
    return max(0.0, after - before)


def _child(d: dict[str, float] | None, key: str, known: bool) -> float | None:
    """A labelled child; an absent child of a family this server has counts as 0 (SGLang creates
    children, and some whole families, only on their first increment)."""
    if d is not None and key in d:
        return d[key]
    return 0.0 if known else None


def total(d: dict[str, float] | None) -> float | None:
    return None if d is None else sum(d.values())


COUNTER_FAMILIES = {
    "backup_tokens": "hicache_backup_tokens_total",
    "load_back_tokens": "load_back_tokens_total",
    "cached_tokens": "cached_tokens_total",
    "prefill_effective_tokens": "prefill_effective_tokens_total",
    "dropped_tokens": "hicache_dropped_tokens_total",
}


def known_counters(record: ProbeRecord) -> frozenset[str]:
    """Counter fields this server evidently exports: seen in any snapshot of the probe."""
    seen = set()
    for step in record.steps:
        for snap in (step.before, step.after):
            if snap is None:
                continue
            for attr, family in COUNTER_FAMILIES.items():
                if getattr(snap, attr) is not None or family in snap.families:
                    seen.add(attr)
    # hicache_backup_tokens_total appears on its first backup, but came in the same releases as the
    # pre-seeded prefill_effective_tokens_total (0.5.23 has both, 0.5.17 neither): a server with the
    # latter and no backup series has backed up nothing yet.
    if "prefill_effective_tokens" in seen:
        seen.add("backup_tokens")
    return frozenset(seen)


def labelled_delta(before: CounterSnapshot | None, after: CounterSnapshot | None, attr: str, key: str, known: frozenset[str]) -> float | None:
    if before is None or after is None:
        return None
    k = attr in known
    return delta(_child(getattr(before, attr), key, k), _child(getattr(after, attr), key, k))


def _has_tier_labels(snap: CounterSnapshot | None) -> bool:
    return bool(snap and snap.cached_tokens and any(k in ("device", "host") for k in snap.cached_tokens))


@dataclass(frozen=True)
class TierCounts:
    device: float | None
    host: float
    source: str


def counter_tiers(step: StepRecord | None, known: frozenset[str]) -> TierCounts | None:
    """Host (and device) cached tokens over one step from SGLang's counters, best family first."""
    if step is None or step.before is None or step.after is None:
        return None
    b, a = step.before, step.after
    if _has_tier_labels(b) or _has_tier_labels(a):
        host = labelled_delta(b, a, "cached_tokens", "host", known)
        dev = labelled_delta(b, a, "cached_tokens", "device", known)
        if host is not None:
            return TierCounts(dev, host, "cached_tokens_total{cache_source}")
    if "prefill_effective_tokens" in known:
        host = labelled_delta(b, a, "prefill_effective_tokens", "host_hit", known)
        dev = labelled_delta(b, a, "prefill_effective_tokens", "device_hit", known)
        if host is not None:
            return TierCounts(dev, host, "prefill_effective_tokens_total{mode}")
    # load_back_* appears only after its first load-back: trust its absence as 0 only where the same
    # radix collector evidently exists (its backup counter is there).
    if "load_back_tokens" in known or "backup_tokens" in known:
        host = delta(total(b.load_back_tokens) or 0.0, total(a.load_back_tokens) or 0.0)
        return TierCounts(None, host or 0.0, "load_back_tokens_total")
    return None


def eviction_confirmed(record: ProbeRecord) -> bool:
    return bool(record.pressure.eviction_confirmed)


def evicted_between(again: StepRecord, r: int) -> bool:
    """A busy server may evict R again between rehost and again; then a missed again proves nothing."""
    if again.before is None or again.after is None or again.after.evicted_tokens is None:
        return False
    return (again.after.evicted_tokens - (again.before.evicted_tokens or 0.0)) >= r


