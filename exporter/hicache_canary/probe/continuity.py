"""Pure: may a probe keep reading counter deltas, or did the server lose its counters under it?

Every verdict read from counters assumes that two snapshots of one probe come from one server life.
A restart breaks that, and on a freshly started server it hides: the counters it rebuilds after
the restart can sit at or above the probe's first snapshot (taken near zero), so "a counter went
back" alone misses it. What cannot hide is our own traffic: SGLang counts every prompt token it
answers in `sglang:prompt_tokens_total` before the answer leaves (live 0.5.17: the counter rose
by exactly 16,384 across each 16,384-token R), and other clients only add to it. So between two
snapshots the counter must rise by at least the prompt tokens the server answered us; if it did
not, the server that answered is not the one whose counters we read (issue 14: a fresh server that
restarted just after R's cold request was judged `silent`).

`broken_continuity` is called for every snapshot against the previous one; a reason means
`error(server_restarted)`. It adds this accounting to the one restart rule (restarts.py) that the
restart watch uses too. SGLang's /metrics has no `prompt_tokens_total` at all until a request
finishes (prometheus_client's multiprocess mode shows no family without a sample): in a snapshot
that has SGLang families, an absent one reads 0, so R answered but missing from the counters is
caught too. Without SGLang families at all (metrics off or broken) there is nothing to check.
"""

from __future__ import annotations

from hicache_canary.models import CounterSnapshot
from hicache_canary.probe.restarts import CounterReading, restart_reason, snapshot_reading

RESTARTED = "the server restarted during the probe"


def _prompt(snap: CounterSnapshot) -> float | None:
    if snap.prompt_tokens is not None:
        return snap.prompt_tokens
    return 0.0 if snap.families else None


def broken_continuity(prev: CounterSnapshot, now: CounterSnapshot, answered_tokens: int) -> str | None:
    """Why `now` cannot be read against `prev` (None: it can).

    `answered_tokens`: prompt tokens the server reported answering us between the two snapshots.
    """
    before, after = snapshot_reading(prev), snapshot_reading(now)
    if not now.families:  # metrics off or broken now: a family missing says nothing, the start time still does
        before = CounterReading(start_time=before.start_time)
    why = restart_reason(before, after)
    if why is not None:
        return f"{RESTARTED} ({why})"
    a, b = _prompt(prev), _prompt(now)
    if answered_tokens > 0 and a is not None and b is not None and b - a < answered_tokens:
        return (
            f"{RESTARTED} (its prompt-token counter rose by {b - a:.0f} while it answered {answered_tokens} "
            f"prompt tokens of ours: the counters we read are not the ones that counted our requests)"
        )
    return None
