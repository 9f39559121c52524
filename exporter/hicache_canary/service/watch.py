"""The restart watch between probes: read SGLang's /metrics cheaply and tell whether it restarted.

Silent configurations arrive with restarts (a deploy flips a flag), so a restarted server should be
probed soon rather than at its next scheduled probe. Every `watch_interval` the scheduler GETs
/metrics (no GPU work, never /generate) and folds the result into a `WatchState` with `observe()`.
A restart is:

- the server was unreachable and now answers again, or
- the one restart rule (restarts.py) says so: `process_start_time_seconds` changed, or one of
  RESTART_COUNTERS (SGLang's tokenizer and radix-cache counters, summed over their children) is
  lower than last seen or gone.

The read is a line scan for those few names, not a parse of the whole exposition (which costs
50-150 ms of Python on a real server): a watch every 30 s must cost the exporter nothing.
Everything here but `watch_period` and `delay_after_restart` is pure data in, data out.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from hicache_canary.probe.restarts import RESTART_COUNTERS, START_TIME, CounterReading, restart_reason

PREFIXES = ("sglang:", "sglang_")  # SGLang's own, and sgl-router's renaming
WatchReading = CounterReading  # what one poll read (the name the scheduler and the probe worker use)


@dataclass(frozen=True)
class WatchState:
    """What the watch knows about one server between polls."""

    reading: WatchReading | None = None  # the last successful read (None: none yet)
    down: bool = False  # the last poll could not reach the server
    seen_down: bool = False  # unreachable at some point since the last successful read


def read_metrics(text: str) -> WatchReading:
    """Sum the watched counters' samples in an exposition body; malformed lines are ignored."""
    sums: dict[str, float] = {}
    start: float | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        short = None
        for prefix in PREFIXES:
            if name.startswith(prefix):
                short = name[len(prefix):]
                break
        if short not in RESTART_COUNTERS and name != START_TIME:
            continue
        rest = line.rsplit("}", 1)[-1] if line[name_end] == "{" else line[name_end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if name == START_TIME:
            start = value if start is None else max(start, value)
        else:
            sums[short] = sums.get(short, 0.0) + value  # type: ignore[index]
    return WatchReading(MappingProxyType(sums), start)


def restarted(prev: WatchReading, now: WatchReading) -> bool:
    """True when `now` cannot come from the same process as `prev` (restarts.restart_reason)."""
    return restart_reason(prev, now) is not None


def observe(state: WatchState, reading: WatchReading | None, reachable: bool) -> tuple[WatchState, bool]:
    """Fold one poll into the state; returns (new state, restart detected).

    `reachable` False: the server did not answer (connect failed, timed out, 5xx). `reading` None
    with `reachable` True: it answered but /metrics is unusable (metrics disabled), so only the
    unreachable -> back signal is left.
    """
    if not reachable:
        return WatchState(reading=state.reading, down=True, seen_down=True), False
    back = state.seen_down
    dropped = state.reading is not None and reading is not None and restarted(state.reading, reading)
    return WatchState(reading=reading if reading is not None else state.reading, down=False, seen_down=False), back or dropped


def after_probe(state: WatchState, prompt_tokens: float | None, start_time: float | None, reached: bool) -> WatchState:
    """Fold what a probe saw into the baseline, so a restart right after a probe is still caught.

    The watch pauses while a probe runs; without this, a server restarted just after a probe would
    give the watch its first reading from the new process, and nothing to compare it with.
    `prompt_tokens` is the probe's last CounterSnapshot.prompt_tokens (the same sum over children).
    """
    if not reached:
        return state
    counters = dict(state.reading.counters) if state.reading else {}
    if prompt_tokens is not None:
        counters["prompt_tokens_total"] = max(prompt_tokens, counters.get("prompt_tokens_total", 0.0))
    start = start_time if start_time is not None else (state.reading.start_time if state.reading else None)
    reading = WatchReading(MappingProxyType(counters), start) if counters or start is not None else state.reading
    return WatchState(reading=reading, down=False, seen_down=False)


def watch_period(watch_interval: float, probe_interval: float) -> float | None:
    """Seconds between polls, or None when watching adds nothing.

    Off when disabled (0) and when it would not poll more often than the probes themselves, which
    read /metrics and notice restarts on their own.
    """
    if watch_interval <= 0 or watch_interval >= probe_interval:
        return None
    return watch_interval


def delay_after_restart(restart_probe_delay: float, probe_interval: float) -> float:
    """How long after a detected restart to probe: time to warm up, never beyond the interval."""
    return max(0.0, min(restart_probe_delay, probe_interval))
