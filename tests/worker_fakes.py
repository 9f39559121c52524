"""Probe functions for tests/test_probe_worker.py, importable by the worker process (by name)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from hicache_canary.models import Phase, ProbeRecord, Verdict


class Client:
    async def aclose(self) -> None:
        pass


def client_factory(target):
    return Client()


async def probe(client, settings, *, progress=None):
    for phase in (Phase.COLD, Phase.PRESSURE, Phase.REHOST, Phase.AGAIN):
        progress(phase)
        await asyncio.sleep(0.01)
    if os.environ.get("FAKE_PROBE_BLOCK"):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            Path(os.environ["FAKE_PROBE_BLOCK"]).write_text(f"cancelled in {os.getpid()}")
            raise
    return ProbeRecord(target=settings.target, started_at=time.time(), finished_at=time.time(), verdict=Verdict.REUSED,
                       evidence=f"pid {os.getpid()}")


async def estimate(client, target) -> int:
    return 1000


async def metrics_text(client) -> str:
    return "sglang:prompt_tokens_total 42\nprocess_start_time_seconds 7\n"
