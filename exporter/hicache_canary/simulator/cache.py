"""A pure, synchronous model of SGLang's HiCache radix tree (device tier + host tier). No IO, no clock.

This module is the request path (match, load back, insert) and when a node is backed up; the tree's
shape (nodes, matching, splitting) is tree.py, the tiers' accounting, backup and eviction tiers.py, the
Mamba checkpoint rule and the host Mamba LRU's choice mamba.py. Semantics follow SGLang 0.5.17's
`UnifiedRadixCache` / `unified_tree_core` (docs/simulator.md names the functions):

- Matching is page-aligned and leaves at least one token to compute (`_compute_max_prefix_len`).
  Residency along a match is [device nodes...][host-only nodes...].
- write_through backs a node up on its first insert/hit (threshold 1; write_through_selective: 2),
  un-backed ancestors first (backed-up nodes form a contiguous prefix); chunked inserts are never
  backed up under the `chunked_prefill_not_backed_up` failure. At device eviction an un-backed leaf
  is deleted, a backed-up one demoted to host.
- write_back backs up at device eviction; the write-through ack lock and host pressure: tiers.py.
- Hybrid (Mamba/GDN, `extra_buffer`): a request leaves Mamba states only at its checkpoints
  (`mamba_checkpoints`: one per prefill forward, i.e. per chunk, at the last 64-token mark of the
  forward, or at the branching point); it is cached in the tree only up to its last checkpoint. A split
  parent has no state. A prefix is reusable only up to the deepest node holding a state on device or
  host (the validator); the failure switches decide when a state reaches host.
- Load-back (H->D) of a host match needs device room (evicting others) and is skipped below 10 tokens.
"""

from __future__ import annotations

from .mamba import MAMBA_CHUNK, mamba_checkpoints, request_checkpoints
from .tiers import HYBRID_FAILURES, WRITE_POLICIES, CacheConfig, CacheStats, Tiers
from .tree import Match, Node

LOAD_BACK_THRESHOLD = 10  # SGLang's load_back_threshold

__all__ = ["HYBRID_FAILURES", "LOAD_BACK_THRESHOLD", "MAMBA_CHUNK", "WRITE_POLICIES", "CacheConfig", "CacheStats",
           "HiCache", "Match", "Node", "mamba_checkpoints"]


class HiCache(Tiers):
    def __init__(self, cfg: CacheConfig):
        super().__init__(cfg)
        self.threshold = 1 if cfg.write_policy == "write_through" else 2

    def match(self, tokens: tuple) -> Match:
        # Page-aligned, and at least one token left to compute (`_compute_max_prefix_len`).
        path = self._walk(tokens, ((len(tokens) - 1) // self.align) * self.align)
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

    def checkpoints(self, tokens: tuple, match: Match | None = None) -> list[int]:
        """Where a request for `tokens`, served with `match`, leaves its Mamba states (hybrid only)."""
        return request_checkpoints(len(tokens), match, self.cfg.chunked_prefill_size, self.cfg.mamba_grain)

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

