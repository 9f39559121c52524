"""Which DP rank a probe pins its requests to: the configured one, else the next in a per-target turn.

A DP server keeps one radix tree per DP rank; a probe must send R, the filler and the re-sends to
one rank, and successive probes should cover every rank (a silent rank hides behind healthy ones).
The turn is state that lives as long as the process that runs probes: the caller owns a
DpRankRotation and hands it to canary.run_probe. PROCESS_ROTATION is the one the probe worker and
`hicache-canary probe` use when they pass none (a single probe starts at rank 0).
"""

from __future__ import annotations


class DpRankRotation:
    """Per target: 0, 1, ..., dp_size - 1, 0, ... (a dp_size that changes between probes wraps)."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def take(self, target: str, dp_size: int) -> int:
        n = self._next.get(target, 0)
        self._next[target] = n + 1
        return n % dp_size


def pinned_rank(configured: int | None, dp_size: int, target: str, rotation: DpRankRotation) -> int | None:
    """The rank to pin: None on a server without DP; the configured rank; else the rotation's turn."""
    if dp_size <= 1:
        return None
    if configured is not None:
        return configured
    return rotation.take(target, dp_size)


PROCESS_ROTATION = DpRankRotation()
