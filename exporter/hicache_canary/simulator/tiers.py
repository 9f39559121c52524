"""The device and host tiers of the HiCache model: what each holds, backing up to host, and eviction
from either (SGLang's `evict`, `evict_host`, `build_backup_spec`, `writing_check`). `HiCache`
(cache.py) decides when a request's nodes are backed up; this module carries it out. Pure.

- A write-through backup locks its node (and so the path to the root) until its ack is reaped by the
  scheduler's next step (`_execute_and_commit_kv_backup` -> `inc_lock_ref`; `writing_check` ->
  `dec_lock_ref`): `reap_acks`, called by the engine. Until then the node counts as used, not evictable.
- At device eviction an un-backed leaf is deleted, a backed-up one demoted to host; under write_back
  it is backed up first (no lock), evicting host LRU to make room, else dropped and counted as
  `hicache_dropped_tokens_total{reason="host_pressure"}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm

from .mamba import MAMBA_CHUNK, host_mamba_victim
from .tree import Node, RadixTree

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HYBRID_FAILURES = ("mamba_state_not_backed_up", "chunked_prefill_not_backed_up", "host_mamba_pool_small", "none")


@dataclass(frozen=True)
class CacheConfig:
    device_tokens: int
    page_size: int = 1
    hicache: bool = False
    host_tokens: int = 0
    write_policy: str = "write_through"
    hybrid: bool = False
    failure: str = "none"
    host_mamba_states: int = 30
    chunked_prefill_size: int = 4096

    @property
    def align(self) -> int:
        return self.page_size

    @property
    def mamba_grain(self) -> int:
        return lcm(self.page_size, MAMBA_CHUNK)


@dataclass
class CacheStats:
    """Counters as SGLang's RadixCacheMetricsCollector counts them (one logical count for all ranks)."""

    evicted_tokens: int = 0
    eviction_passes: int = 0
    backup_tokens: dict[str, int] = field(default_factory=dict)  # pool -> tokens (mamba: states)
    backup_ops: int = 0
    load_back_tokens: dict[str, int] = field(default_factory=dict)
    load_back_ops: int = 0
    dropped_tokens: dict[str, int] = field(default_factory=dict)  # reason -> tokens
    failed_backups: int = 0  # write_through backups that found no host room (silent in SGLang)

    def add(self, d: dict[str, int], key: str, n: int) -> None:
        d[key] = d.get(key, 0) + n


class Tiers(RadixTree):
    """The tree with device and host residency, pool accounting and the two evictions."""

    def __init__(self, cfg: CacheConfig):
        if cfg.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {cfg.write_policy!r}")
        if cfg.failure not in HYBRID_FAILURES:
            raise ValueError(f"unknown failure mode {cfg.failure!r}")
        self.cfg = cfg
        self.stats = CacheStats()
        super().__init__(cfg.align)
        self.reset()

    def reset(self) -> None:
        """`/flush_cache`: both tiers cleared (SGLang resets the host pool too); counters kept."""
        self.clear()
        self.device_used = 0  # tokens held by tree nodes on device
        self.inflight = 0  # tokens allocated to running requests, not yet in the tree
        self.host_used = 0
        self.host_mamba_used = 0
        self.pending_acks: list[Node] = []  # write-through backups whose ack the scheduler has not reaped

    @property
    def device_free(self) -> int:
        return self.cfg.device_tokens - self.device_used - self.inflight

    def evictable_tokens(self) -> int:
        return sum(len(n.key) for n in self.nodes() if n.device and n.lock == 0)

    def locked_tokens(self) -> int:
        return sum(len(n.key) for n in self.nodes() if n.device and n.lock > 0)

    def mamba_device_states(self) -> tuple[int, int]:
        """(locked, evictable) device Mamba states in the tree."""
        locked = evictable = 0
        for n in self.nodes():
            if n.mamba_dev:
                if n.lock:
                    locked += 1
                else:
                    evictable += 1
        return locked, evictable

    def reap_acks(self) -> int:
        """The scheduler's step: every finished write-through releases its lock (`writing_check`).
        Returns the tokens released."""
        released = sum(len(n.key) for n in self.pending_acks)
        for n in self.pending_acks:
            self._lock_path(n, -1)
        self.pending_acks = []
        return released

    def _backup(self, node: Node, with_mamba: bool, lock: bool = False) -> bool:
        """D->H copy of a node, with its state (SGLang's `build_backup_spec`). False if host is full.

        write-through (`lock`): un-backed ancestors first (`_build_backup_kv_action`), and each copied
        node stays locked until `reap_acks`. write-back (at eviction): the node alone."""
        chain = []
        x = node
        while x is not self.root and not x.host:
            chain.append(x)
            x = x.parent
            if not lock:
                break
        for x in reversed(chain):
            if not self.make_host_room(len(x.key), protect=node):
                self.stats.failed_backups += 1
                return False
            x.host = True
            self.host_used += len(x.key)
            self.stats.add(self.stats.backup_tokens, "kv", len(x.key))
            self.stats.backup_ops += 1
            if lock:
                self._lock_path(x, 1)
                self.pending_acks.append(x)
            if with_mamba and self.cfg.hybrid and x.mamba_dev and not x.mamba_host:
                self._backup_mamba(x)
        return True

    def _backup_mamba(self, node: Node) -> None:
        if self.host_mamba_used >= self.cfg.host_mamba_states:
            victim = host_mamba_victim(self.nodes(), node)
            if victim is None:
                return
            victim.mamba_host = False  # its host KV is now dead memory: the validator rejects it
            self.host_mamba_used -= 1
        node.mamba_host = True
        self.host_mamba_used += 1
        self.stats.add(self.stats.backup_tokens, "mamba", 1)

    def make_host_room(self, n: int, protect: Node | None = None) -> bool:
        """Evict host-only LRU leaves until n host slots are free (SGLang's evict_host)."""
        while self.cfg.host_tokens - self.host_used < n:
            victims = [x for x in self.nodes() if x.host and not x.device and not x.children and x.lock == 0
                       and x is not protect]
            if not victims:
                return False
            self._delete(min(victims, key=lambda x: x.last))
        return True

    def make_device_room(self, n: int) -> bool:
        if self.device_free >= n:
            return True
        self.stats.eviction_passes += 1
        while self.device_free < n:
            victims = [x for x in self.nodes() if x.device and x.lock == 0
                       and not any(c.device for c in x.children.values())]
            if not victims:
                return False
            self._evict_device(min(victims, key=lambda x: x.last))
        return True

    def _evict_device(self, node: Node) -> None:
        size = len(node.key)
        self.stats.evicted_tokens += size
        if self.cfg.hicache and self.cfg.write_policy == "write_back" and not node.host:
            if not self._backup(node, with_mamba=True):
                self.stats.add(self.stats.dropped_tokens, "host_pressure", size)
                self._delete(node)
                return
        if self.cfg.hicache and node.host:
            node.device = False  # demote: the device slots (and the device SSM state) are freed
            node.mamba_dev = False
            self.device_used -= size
            return
        self._delete(node)  # plain RadixCache, or write_through with no backup: gone

    def _delete(self, node: Node) -> None:
        for child in list(node.children.values()):
            self._delete(child)
        if node.device:
            self.device_used -= len(node.key)
        if node.host:
            self.host_used -= len(node.key)
        if node.mamba_host:
            self.host_mamba_used -= 1
        del node.parent.children[node.key[: self.align]]
        node.parent = None
