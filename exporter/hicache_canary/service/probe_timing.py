"""When each target's next probe starts: pure decisions, tested as tables without a loop or clock.

The scheduler's loop (scheduler.py) asks these after every probe and before the first one.
"""

from __future__ import annotations

import random

from hicache_canary.models import ErrorReason, ProbeRecord, Verdict

# The preflight (estimate: /server_info and /metrics) begins this long before the probe's start
# slot, so the probe proper starts on the slot even when those reads are slow.
PREFLIGHT_ALLOWANCE_S = 0.3


def start_offset(index: int, count: int, interval: float, spread_cap: float = 30.0) -> float:
    """Spread the first probes so targets don't all hit their servers (and our CPU) at once."""
    if count <= 1:
        return 0.0
    return index * min(interval, spread_cap) / count


def next_start(last_start: float | None, now: float, spacing: float) -> float:
    """When the next probe may start: `spacing` after the previous start of any target.

    Many targets may share a GPU host, a network link and this exporter's CPU; with a fixed interval
    and a 10% jitter their probes drift into each other by chance, so starts are also spaced apart
    across the whole exporter (on top of `max_concurrent_probes`, which caps how many run at once).
    """
    if last_start is None or spacing <= 0:
        return now
    return max(now, last_start + spacing)


def watch_phase(period: float, rng: random.Random) -> float:
    """First restart-watch poll of a target: anywhere in one period, so 200 targets' polls (and
    their parsing in the probe worker) are spread over the period rather than arriving together."""
    return period * rng.uniform(0.0, 1.0)


def needs_confirmation(verdict: Verdict | None, streak: int) -> bool:
    """A `silent` that starts a new streak is re-probed early instead of after a whole interval.

    HiCacheSilent pages only on two silent verdicts in a row (one odd probe must not wake anyone);
    confirming the first one at once brings the second within `confirm_after` instead of a second
    interval. Only the first of a streak: once confirmed, the regular interval is enough.
    """
    return verdict == Verdict.SILENT and streak == 1


def next_delay(
    verdict: Verdict | None,
    interval: float,
    consecutive_errors: int,
    budget_wait: float | None = None,
    confirm_after: float | None = None,
) -> float:
    """Seconds until the next probe, before jitter.

    `confirm_after`: set when the last verdict needs confirming (`needs_confirmation`); 0 or None
    means no early probe. Never later than the regular interval.
    """
    if verdict == Verdict.SILENT and confirm_after:
        return min(confirm_after, interval)
    if verdict == Verdict.ERROR and consecutive_errors > 0:
        # A blip is re-checked soon; a dead server is left alone, up to 4 intervals.
        return min(interval / 4 * 2 ** (consecutive_errors - 1), interval * 4)
    if verdict == Verdict.SKIPPED_BUSY:
        return min(interval / 4, 300.0)
    if verdict == Verdict.SKIPPED_BUDGET and budget_wait is not None:
        return max(1.0, min(budget_wait, interval))
    return interval


def jittered(delay: float, rng: random.Random, spread: float = 0.1) -> float:
    """Spread probes of many targets apart by shortening waits only, so the worst case is `delay`.

    Detection is promised within one interval (+ for:); a jitter that could lengthen a wait
    would make that 1.1 intervals.
    """
    return delay * rng.uniform(1 - spread, 1.0)


def after_probe_delay(delay: float, rec: ProbeRecord | None, restart_delay: float) -> float:
    """A probe that a restart cut short is retried once the server warmed up, not after backoff."""
    if rec is not None and rec.verdict == Verdict.ERROR and rec.reason == ErrorReason.SERVER_RESTARTED:
        return min(delay, restart_delay)
    return delay


def start_slot(last_start: float | None, now: float, spacing: float) -> tuple[float, float]:
    """(probe start, preflight start) of the next probe, with `spacing` > 0 between starts.

    Never sooner than the preflight allowance either, or the first probe would start when its
    preflight ends rather than on its slot.
    """
    allowance = min(PREFLIGHT_ALLOWANCE_S, spacing / 2)
    at = max(next_start(last_start, now, spacing), now + allowance)
    return at, at - allowance
