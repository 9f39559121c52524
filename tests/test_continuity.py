"""continuity.broken_continuity (pure): which snapshot pairs a probe may read deltas from."""

from __future__ import annotations

import pytest

from hicache_canary.probe.continuity import broken_continuity
from hicache_canary.models import CounterSnapshot

SGLANG = frozenset({"num_running_reqs", "evicted_tokens_total"})  # a /metrics from SGLang


def snap(prompt: float | None = None, evicted: float | None = 0.0, start: float | None = None, fams=SGLANG) -> CounterSnapshot:
    return CounterSnapshot(prompt_tokens=prompt, evicted_tokens=evicted, process_start_time=start, families=fams)


ROWS = [
    (snap(1000), snap(3048), 2048, None),
    (snap(1000), snap(9000), 2048, None),  # other clients only add
    (snap(1000), snap(1000), 0, None),  # nothing sent, nothing counted: fine
    (snap(None), snap(2048), 2048, None),  # fresh server: the family appears with R's first count
    # issue 14: a fresh server restarted after answering R; its counters sit where they started
    (snap(None), snap(None), 2048, "its prompt-token counter rose by 0 while it answered 2048 prompt tokens"),
    (snap(0), snap(0), 2048, "rose by 0 while it answered 2048"),
    (snap(2048), snap(4000), 6000, "rose by 1952 while it answered 6000"),
    (snap(5000), snap(3000), 0, "its counters went back"),
    (snap(5000, evicted=10), snap(7048, evicted=0), 2048, "its counters went back"),
    (snap(10, start=1.0), snap(2058, start=2.0), 2048, "its process start time changed"),
    # the restart watch's rule too: a family that was there and is gone was reset with its process
    (snap(5000, evicted=10), snap(7048, evicted=None), 2048, "its counters went back"),
    (snap(10, start=1.0, fams=frozenset()), snap(2058, start=2.0, fams=frozenset()), 2048, "its process start time changed"),
    # no SGLang families at all (metrics broken or off): nothing to check against
    (snap(None, evicted=None, fams=frozenset()), snap(None, evicted=None, fams=frozenset()), 2048, None),
]


@pytest.mark.parametrize("prev,now,answered,expected", ROWS, ids=[f"row{i}" for i in range(len(ROWS))])
def test_broken_continuity(prev, now, answered, expected) -> None:
    why = broken_continuity(prev, now, answered)
    if expected is None:
        assert why is None
    else:
        assert why is not None and why.startswith("the server restarted during the probe (") and expected in why, why
