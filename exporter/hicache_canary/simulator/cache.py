"""A pure, synchronous model of SGLang's HiCache radix tree (device tier + host tier). No IO, no clock.

One node per inserted segment (split on divergence), never one per token or page, so 700K host tokens
cost a few hundred nodes. Semantics follow SGLang 0.5.17's `UnifiedRadixCache` / `unified_tree_core`
(docs/simulator.md names the functions):

- Matching is page-aligned and leaves at least one token to compute (`_compute_max_prefix_len`).
  Residency along a match is [device nodes...][host-only nodes...].
- write_through backs a node up on its first insert/hit (threshold 1; write_through_selective: 2),
  un-backed ancestors first (backed-up nodes form a contiguous prefix); chunked inserts are never
  backed up under the `chunked_prefill_not_backed_up` failure. At device eviction an un-backed leaf
  is deleted, a backed-up one demoted to host.
- A write-through backup locks its node (and so the path to the root) until its ack is reaped by the
  scheduler's next step (`_execute_and_commit_kv_backup` -> `inc_lock_ref`; `writing_check` ->
  `dec_lock_ref`): `reap_acks`, called by the engine. Until then the node counts as used, not evictable.
- write_back backs up at device eviction (no lock), evicting host LRU to make room, else drops the leaf
  and counts `hicache_dropped_tokens_total{reason="host_pressure"}`.
- Hybrid (Mamba/GDN, `extra_buffer`): a request leaves Mamba states only at its checkpoints
  (`mamba_checkpoints`: one per prefill forward, i.e. per chunk, at the last 64-token mark of the
  forward, or at the branching point); it is cached in the tree only up to its last checkpoint. A split
  parent has no state. A prefix is reusable only up to the deepest node holding a state on device or
  host (the validator); the failure switches decide when a state reaches host.
- Load-back (H->D) of a host match needs device room (evicting others) and is skipped below 10 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import lcm

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HYBRID_FAILURES = ("mamba_state_not_backed_up", "chunked_prefill_not_backed_up", "host_mamba_pool_small", "none")
MAMBA_CHUNK = 64  # FLA's chunk size: SGLang's mamba_cache_chunk_size is max(64, page_size) (extra_buffer)
LOAD_BACK_THRESHOLD = 10  # SGLang's load_back_threshold


def mamba_checkpoints(prefix: int, total: int, chunk: int, grain: int, branch: int | None = None) -> list[int]:
    """Sequence lengths at which a request of `total` prompt tokens, `prefix` of them cached, leaves a
    Mamba state (SGLang's `_mamba_radix_cache_v2_req_prepare_for_extend`, extra_buffer strategy).

    The prefill runs in forwards of at most `chunk` tokens (chunked prefill; <= 0: one forward). A forward
    extending `n >= grain` tokens from `start` tracks the state at `start + (n // grain) * grain`, or at
    the branching point when that lies inside the forward on the grain (`mamba_branching_seqlen`: where a
    longer KV match than the last state ended). A forward of fewer than `grain` tokens tracks nothing.
    Each intermediate chunk inserts up to its state (`cache_unfinished_req`), the finished request up
    to its last one (`cache_finished_req`); the KV past it is freed, not cached.
    """
    step = chunk if chunk > 0 else max(total - prefix, 1)
    points: list[int] = []
    start = prefix
    while start < total:
        n = min(step, total - start)
        if n >= grain:
            point = start + (n // grain) * grain
            if branch is not None and start < branch < start + n and (branch - start) % grain == 0:
                point = branch
            points.append(point)
        start += n
    return points


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


class Node:
    __slots__ = ("key", "parent", "children", "device", "host", "mamba_dev", "mamba_host", "lock", "last", "hits",
                 "mlast")

    def __init__(self, key: tuple, parent: Node | None):
        self.key = key
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.device = False
        self.host = False
        self.mamba_dev = False
        self.mamba_host = False
        self.lock = 0
        self.last = 0
        self.hits = 0
        self.mlast = 0  # the Mamba LRU: touched only where a state is attached or a match ends


@dataclass
class Match:
    """What a request can reuse: `nodes` is the matched path, device part first."""

    nodes: list[Node]
    device_tokens: int  # already on device when matched
    host_tokens: int  # on host only, not (yet) loaded back
    loaded: int = 0  # loaded back H->D for this request
    kv_hit: int = 0  # KV matched before the Mamba validator cut it back (SGLang's full_kv_hit_length)

    @property
    def cached(self) -> int:
        return self.device_tokens + self.host_tokens + self.loaded


class HiCache:
    def __init__(self, cfg: CacheConfig):
        if cfg.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {cfg.write_policy!r}")
        if cfg.failure not in HYBRID_FAILURES:
            raise ValueError(f"unknown failure mode {cfg.failure!r}")
        self.cfg = cfg
        self.align = cfg.align
        self.threshold = 1 if cfg.write_policy == "write_through" else 2
        self.stats = CacheStats()
        self.reset()

    # ---- bookkeeping -------------------------------------------------------------------------
    def reset(self) -> None:
        """`/flush_cache`: both tiers cleared (SGLang resets the host pool too); counters kept."""
        self.root = Node((), None)
        self.root.device = self.root.host = True
        self.device_used = 0  # tokens held by tree nodes on device
        self.inflight = 0  # tokens allocated to running requests, not yet in the tree
        self.host_used = 0
        self.host_mamba_used = 0
        self.clock = 0
        self.pending_acks: list[Node] = []  # write-through backups whose ack the scheduler has not reaped

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    @property
    def device_free(self) -> int:
        return self.cfg.device_tokens - self.device_used - self.inflight

    def nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

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

    # ---- matching ----------------------------------------------------------------------------
    def _common(self, key: tuple, tokens: tuple, pos: int, limit: int) -> int:
        """Aligned length of the common prefix of key and tokens[pos:limit]."""
        n = min(len(key), limit - pos)
        if tokens[pos:pos + n] == key[:n]:
            return n - n % self.align
        a = self.align
        lo, hi = 0, n // a  # binary search in aligned units, each probe a C-speed slice compare
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens[pos:pos + mid * a] == key[:mid * a]:
                lo = mid
            else:
                hi = mid - 1
        return lo * a

    def _split(self, node: Node, n: int) -> Node:
        """Split node at n tokens; the new parent keeps residency but no Mamba state (leaf-only)."""
        mid = Node(node.key[:n], node.parent)
        mid.device, mid.host, mid.lock, mid.last, mid.hits = node.device, node.host, node.lock, node.last, node.hits
        node.parent.children[node.key[:self.align]] = mid
        node.key = node.key[n:]
        node.parent = mid
        mid.children[node.key[:self.align]] = node
        return mid

    def match(self, tokens: tuple) -> Match:
        limit = ((len(tokens) - 1) // self.align) * self.align
        node, pos, path = self.root, 0, []
        while pos < limit:
            child = node.children.get(tokens[pos:pos + self.align])
            if child is None:
                break
            n = self._common(child.key, tokens, pos, limit)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            pos += n
            node = child
        # Residency: device nodes first, then host-only ones (device children never sit under host-only).
        dev = 0
        while dev < len(path) and path[dev].device:
            dev += 1
        path = path[: dev + sum(1 for n in path[dev:] if n.host)]
        kv_hit = sum(len(n.key) for n in path)
        if self.cfg.hybrid:
            # The Mamba validator: the match ends at the deepest node holding a state (device or host).
            while path and not (path[-1].mamba_dev or path[-1].mamba_host):
                path.pop()
        dev = min(dev, len(path))
        device_tokens = sum(len(n.key) for n in path[:dev])
        host_tokens = sum(len(n.key) for n in path[dev:])
        if 0 < host_tokens < LOAD_BACK_THRESHOLD:
            path, host_tokens = path[:dev], 0
        now = self._tick()
        for n in path:
            n.last = now
        if path:
            path[-1].mlast = now
        return Match(path, device_tokens, host_tokens, kv_hit=kv_hit)

    # ---- locking and allocation --------------------------------------------------------------
    def lock(self, match: Match) -> None:
        for n in match.nodes:
            n.lock += 1

    def unlock(self, match: Match) -> None:
        for n in match.nodes:
            n.lock -= 1

    def load_back(self, match: Match) -> Match:
        """Bring the host part of a (locked) match to device; on failure keep only the device part."""
        host_nodes = [n for n in match.nodes if not n.device]
        if not host_nodes:
            return match
        need = sum(len(n.key) for n in host_nodes)
        if not self.make_device_room(need):
            for n in host_nodes:
                n.lock -= 1
            keep = match.nodes[: len(match.nodes) - len(host_nodes)]
            return Match(keep, match.device_tokens, 0, kv_hit=match.kv_hit)
        mamba = 0
        for n in host_nodes:
            n.device = True
            if n.mamba_host and self.cfg.hybrid:
                n.mamba_dev = True
                mamba += 1
        self.device_used += need
        self.stats.add(self.stats.load_back_tokens, "kv", need)
        if mamba:
            self.stats.add(self.stats.load_back_tokens, "mamba", mamba)
        self.stats.load_back_ops += 1
        return Match(match.nodes, match.device_tokens, 0, loaded=need, kv_hit=match.kv_hit)

    def allocate(self, n: int) -> bool:
        """Reserve n device slots for a running request (evicting LRU leaves as needed)."""
        if not self.make_device_room(n):
            return False
        self.inflight += n
        return True

    def release(self, n: int) -> None:
        self.inflight -= n

    # ---- insertion ---------------------------------------------------------------------------
    def checkpoints(self, tokens: tuple, match: Match | None = None) -> list[int]:
        """Where a request for `tokens`, served with `match`, leaves its Mamba states (hybrid only)."""
        prefix = match.cached if match is not None else 0
        grain = self.cfg.mamba_grain
        branch = None
        if match is not None:
            aligned = (match.kv_hit // grain) * grain
            branch = aligned if aligned > prefix else None
        return mamba_checkpoints(prefix, len(tokens), self.cfg.chunked_prefill_size, grain, branch)

    def insert(self, tokens: tuple, chunked: bool = False, match: Match | None = None) -> None:
        """Cache a finished request's tokens on device, backing up per the policy.

        Plain models cache the prompt page-aligned. A hybrid model caches each chunk up to its Mamba
        checkpoint (`checkpoints`, from the request's `match`) and attaches the state there; the
        finished request's insert is the one that counts hits and backs up (SGLang skips backups of
        chunked inserts, `_inc_hit_count_and_check(chunked=True)`).
        """
        now = self._tick()
        if self.cfg.hybrid:
            points = self.checkpoints(tokens, match)
            if not points:
                return  # no forward reached a 64-token mark: nothing of this request is cached
            for point in points[:-1]:
                self._attach_state(self._insert_path(tokens, point, now)[-1], now)
            touched = self._insert_path(tokens, points[-1], now)
            self._attach_state(touched[-1], now)
        else:
            touched = self._insert_path(tokens, (len(tokens) // self.align) * self.align, now)
        for n in touched:
            if self._hit_and_check(n, chunked):
                self._backup(n, with_mamba=self._write_through_backs_up_mamba(), lock=True)
            elif (self.cfg.hicache and self.cfg.write_policy != "write_back" and self.cfg.failure == "none"
                  and n.host and n.mamba_dev and not n.mamba_host and not chunked):
                # Fixed builds (#33639): component-only incremental backup of a late-attached state.
                self._backup_mamba(n)

    def _attach_state(self, node: Node, now: int) -> None:
        if node is not self.root:
            node.mamba_dev = True  # SGLang's commit_insert_component_data: the state sits where the insert ended
            node.mlast = now

    def _insert_path(self, tokens: tuple, end: int, now: int) -> list[Node]:
        """Make tokens[:end] a path of device nodes (splitting at `end`); the nodes walked, root excluded."""
        node, pos = self.root, 0
        touched: list[Node] = []
        while pos < end:
            child = node.children.get(tokens[pos:pos + self.align])
            if child is None:
                child = Node(tokens[pos:end], node)
                node.children[child.key[: self.align]] = child
                child.device = True
                self.device_used += len(child.key)
                child.last = now
                touched.append(child)
                break
            n = self._common(child.key, tokens, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            if not child.device:  # recomputed over an evicted node: its KV is on device again
                child.device = True
                self.device_used += len(child.key)
            child.last = now
            touched.append(child)
            pos += n
            node = child
        return touched

    # ---- write-through acks ------------------------------------------------------------------
    def _lock_path(self, node: Node, by: int) -> None:
        while node is not None and node is not self.root:
            node.lock += by
            node = node.parent

    def reap_acks(self) -> int:
        """The scheduler's step: every finished write-through releases its lock (`writing_check`).
        Returns the tokens released."""
        released = sum(len(n.key) for n in self.pending_acks)
        for n in self.pending_acks:
            self._lock_path(n, -1)
        self.pending_acks = []
        return released

    def _write_through_backs_up_mamba(self) -> bool:
        # The field report's build: KV reaches host at insert, the late-attached SSM state never does.
        return self.cfg.failure != "mamba_state_not_backed_up"

    def _hit_and_check(self, node: Node, chunked: bool) -> bool:
        if not node.device or (chunked and self.cfg.failure == "chunked_prefill_not_backed_up"):
            return False
        if self.cfg.write_policy == "write_back":
            return False
        node.hits += 1
        return self.cfg.hicache and not node.host and node.hits >= self.threshold

    # ---- host tier ---------------------------------------------------------------------------
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
            # SGLang's host Mamba LRU holds only states whose device copy is gone (`evict_component`
            # inserts a node there at its device tombstone); least recently matched first.
            victims = [n for n in self.nodes() if n.mamba_host and not n.mamba_dev and n is not node]
            if not victims:
                return
            victim = min(victims, key=lambda n: n.mlast)
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

    # ---- device eviction ---------------------------------------------------------------------
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
