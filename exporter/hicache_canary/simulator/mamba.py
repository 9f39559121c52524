"""Hybrid (Mamba/GDN) models: where a request leaves its recurrent states, and which state the host
Mamba pool gives up when full. Pure functions; `HiCache` (cache.py) applies them to its tree.
"""

from __future__ import annotations

from collections.abc import Iterable

from .tree import Match, Node

MAMBA_CHUNK = 64  # FLA's chunk size: SGLang's mamba_cache_chunk_size is max(64, page_size) (extra_buffer)


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


def request_checkpoints(total: int, match: Match | None, chunk: int, grain: int) -> list[int]:
    """`mamba_checkpoints` for a request of `total` tokens served with `match`: its cached part is the
    prefix, and a KV match reaching past it on the grain is the branching point."""
    prefix = match.cached if match is not None else 0
    branch = None
    if match is not None:
        aligned = (match.kv_hit // grain) * grain
        branch = aligned if aligned > prefix else None
    return mamba_checkpoints(prefix, total, chunk, grain, branch)


def host_mamba_victim(nodes: Iterable[Node], incoming: Node) -> Node | None:
    """The state the full host Mamba pool gives up for `incoming`, or None (nothing it may evict).

    SGLang's host Mamba LRU holds only states whose device copy is gone (`evict_component` inserts a
    node there at its device tombstone); least recently matched first.
    """
    victims = [n for n in nodes if n.mamba_host and not n.mamba_dev and n is not incoming]
    return min(victims, key=lambda n: n.mlast) if victims else None
