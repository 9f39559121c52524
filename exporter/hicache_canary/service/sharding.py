"""Which exporter replica probes which target: `shard: i/N` in the config.

Every replica runs the same config and the same discovery, and keeps only the targets it owns, so
each target is probed by exactly one replica without the replicas talking to each other. Ownership
is rendezvous hashing of the target name: every replica computes the same owner from the name
alone (sha256, never Python's per-process `hash()`), and going from N to N+1 replicas moves only
about 1/(N+1) of the targets (their history starts over on the new owner) instead of nearly all of
them, as `hash % N` would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from hicache_canary.settings.config import Shard


def _weight(index: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{index}/{name}".encode()).digest()[:8], "big")


def owner(name: str, count: int) -> int:
    """The replica (0..count-1) that probes target `name`."""
    if count <= 1:
        return 0
    return max(range(count), key=lambda i: _weight(i, name))


def owns(shard: Shard, name: str) -> bool:
    return owner(name, shard.count) == shard.index


class ShardView:
    """What this replica left to the others, per source, for /api/targets and the log."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self._elsewhere: dict[str, frozenset[str]] = {}

    def keep(self, source: str, names: Iterable[str]) -> set[str]:
        """The names of `source` this replica owns; the rest are remembered as someone else's."""
        names = set(names)
        mine = {n for n in names if owns(self.shard, n)}
        self._elsewhere[source] = frozenset(names - mine)
        return mine

    def summary(self) -> dict[str, object]:
        return {
            "shard": str(self.shard),
            "index": self.shard.index,
            "count": self.shard.count,
            "targets_on_other_shards": sorted(set().union(*self._elsewhere.values())) if self._elsewhere else [],
        }
