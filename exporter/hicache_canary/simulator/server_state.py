"""The mutable state of one simulated server process (`Sim`): its engine, fault switches, HTTP counts,
the background load generator, and the `/_sim/state` snapshot. `restart` swaps in a fresh engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Callable

from . import protocol as P
from .config import SimConfig
from .engine import Engine
from .metrics import HttpStats, bucket_bounds


class Sim:
    """Mutable state of one simulated server process; `restart` swaps in a fresh engine."""

    def __init__(self, cfg: SimConfig):
        self.http = HttpStats()
        self.shutdown: Callable[[], None] | None = None
        self._bg: asyncio.Task | None = None
        self._bg_inflight: set[asyncio.Task] = set()
        self.restarts = 0
        self._install(cfg)

    def _install(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.faults = cfg.faults
        self.engine = Engine(cfg, bucket_bounds(cfg.metrics_profile))
        self.served = 0
        self.rng = random.Random(cfg.seed + 1)

    def start(self) -> None:
        if self.cfg.background_rps > 0 and self._bg is None:
            self._bg = asyncio.get_running_loop().create_task(self._background())

    async def stop(self) -> None:
        tasks = [t for t in (self._bg, *self._bg_inflight) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._bg = None
        self._bg_inflight.clear()

    async def restart(self, cfg: SimConfig) -> None:
        await self.stop()
        self._install(cfg)
        self.restarts += 1
        self.http = HttpStats()
        self.start()

    async def _background(self) -> None:
        """The server's own traffic: unique prompts at --background-rps (simulated seconds)."""
        rng = random.Random(self.cfg.seed + 2)
        interval = self.cfg.time_scale / self.cfg.background_rps
        limit = self.cfg.max_running_requests * 2  # don't let an overloaded sim queue without bound
        while True:
            await asyncio.sleep(interval)
            if len(self._bg_inflight) >= limit:
                continue
            tokens = tuple(rng.randrange(P.VOCAB) for _ in range(self.cfg.background_context_tokens))
            task = asyncio.get_running_loop().create_task(self.engine.generate(tokens, 1, kind="background"))
            self._bg_inflight.add(task)
            task.add_done_callback(self._bg_inflight.discard)

    def state(self) -> dict:
        e, c = self.engine, self.engine.cache
        nodes = sorted(c.nodes(), key=lambda n: -n.last)
        cfg = dataclasses.asdict(self.cfg)
        cfg["api_key"] = "<redacted>" if self.cfg.api_key else None
        return {
            "config": cfg,
            "restarts": self.restarts,
            "in_flight": e.running + e.queued,
            "running": e.running,
            "queued": e.queued,
            "aborted": e.stats.aborted,
            "requests_by_kind": dict(e.stats.requests_by_kind),
            "served": self.served,
            "faults": dataclasses.asdict(self.faults),
            "pools": {
                "device_total": self.cfg.max_total_tokens, "device_cached": c.device_used, "device_inflight": c.inflight,
                "host_total": self.cfg.host_tokens, "host_used": c.host_used,
                "host_mamba_total": self.cfg.host_mamba_states if self.cfg.hybrid_model else 0,
                "host_mamba_used": c.host_mamba_used,
            },
            "cache_stats": dataclasses.asdict(c.stats),
            "segments": [{"tokens": len(n.key), "device": n.device, "host": n.host, "mamba_device": n.mamba_dev,
                          "mamba_host": n.mamba_host, "locked": n.lock > 0} for n in nodes[:200]],
            "segments_total": len(nodes),
        }
