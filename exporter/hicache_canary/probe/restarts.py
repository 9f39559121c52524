"""Pure: the one restart rule. Can two readings of a server's counters come from one process?

Used by the restart watch between probes (watch.py, from a cheap line scan of /metrics) and by the
canary between the snapshots of one probe (continuity.py, from CounterSnapshot). Two readings come
from different processes when:

- `process_start_time_seconds` changed, or
- a counter that only grows in a live process is lower than before, summed over its children; a
  family that was there and is gone reads 0 (SGLang creates labelled children, and some whole
  families, on their first increment, so a fresh process has none of them).

RESTART_COUNTERS is the one set of such counters, by SGLang family name (without `sglang:`): the
tokenizer's (one process-wide copy, moved by every request) and the radix cache's (repeated per TP
rank, which only makes the sum grow faster). Each reader takes those it can see: CounterSnapshot
carries the ones named with their field; the watch's line scan reads them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from hicache_canary.models import CounterSnapshot

# family -> CounterSnapshot field (None: the snapshot does not parse that family)
RESTART_COUNTERS: Mapping[str, str | None] = MappingProxyType({
    "prompt_tokens_total": "prompt_tokens",
    "generation_tokens_total": None,
    "num_requests_total": None,
    "evicted_tokens_total": "evicted_tokens",
    "hicache_backup_tokens_total": "backup_tokens",
    "load_back_tokens_total": "load_back_tokens",
    "cached_tokens_total": "cached_tokens",
    "prefill_effective_tokens_total": "prefill_effective_tokens",
    "hicache_dropped_tokens_total": "dropped_tokens",
})
START_TIME = "process_start_time_seconds"


@dataclass(frozen=True)
class CounterReading:
    """The restart counters of one /metrics body: family -> sum over children (absent: missing)."""

    counters: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    start_time: float | None = None

    def __reduce__(self) -> tuple[object, ...]:
        # A mappingproxy does not pickle, and readings come back from the probe worker process.
        return (_reading, (dict(self.counters), self.start_time))


def _reading(counters: dict[str, float], start_time: float | None) -> CounterReading:
    return CounterReading(MappingProxyType(counters), start_time)


def restart_reason(prev: CounterReading, now: CounterReading) -> str | None:
    """Why `now` cannot come from the same process as `prev` (None: it can)."""
    if prev.start_time is not None and now.start_time is not None and now.start_time != prev.start_time:
        return "its process start time changed"
    for name, before in prev.counters.items():
        if now.counters.get(name, 0.0) < before:
            return "its counters went back"
    return None


def snapshot_reading(snap: CounterSnapshot) -> CounterReading:
    """The restart counters a snapshot carries, and its process start time."""
    counters: dict[str, float] = {}
    for family, attr in RESTART_COUNTERS.items():
        value = getattr(snap, attr) if attr else None
        if value is not None:
            counters[family] = sum(value.values()) if isinstance(value, dict) else value
    return _reading(counters, snap.process_start_time)
