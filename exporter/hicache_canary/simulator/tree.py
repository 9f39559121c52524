"""The radix tree's shape, apart from what lives where: nodes keyed by their first page, split on
divergence, walked page-aligned. `HiCache` (cache.py) adds the device and host tiers on top.

One node per inserted segment, never one per token or page, so 700K host tokens cost a few hundred
nodes. Pure: no IO, and the clock is a counter ticked once per match or insert (the LRU order).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


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


class RadixTree:
    """Structure only: the root, the LRU clock, aligned prefix matching and node splitting."""

    def __init__(self, align: int):
        self.align = align
        self.clear()

    def clear(self) -> None:
        self.root = Node((), None)
        self.root.device = self.root.host = True
        self.clock = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

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

    def _walk(self, tokens: tuple, limit: int) -> list[Node]:
        """The existing nodes along tokens[:limit], split where the match ends inside one."""
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
        return path

    def _lock_path(self, node: Node | None, by: int) -> None:
        while node is not None and node is not self.root:
            node.lock += by
            node = node.parent
