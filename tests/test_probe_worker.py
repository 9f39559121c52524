"""The probe worker process: probes and watch polls run there, phases and records come back, a
cancelled probe is cancelled there, and a worker that dies is replaced at the next call."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

import worker_fakes
from hicache_canary.settings.config import load_settings
from hicache_canary.models import Verdict
from hicache_canary.service.probe_work import ProbeFunctions
from hicache_canary.service.probe_worker import ProbeProcess, WorkerFailed
from hicache_canary.service.scheduler import Scheduler

FNS = ProbeFunctions(worker_fakes.probe, worker_fakes.client_factory, worker_fakes.estimate, worker_fakes.metrics_text)


@pytest.fixture(autouse=True)
def importable_fakes(monkeypatch):
    # The worker imports the fakes by name, as it imports hicache_canary.probe.canary in production.
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


def target():
    return load_settings(None, {"HICACHE_CANARY_TARGET_URL": "http://127.0.0.1:9"}).targets[0]


async def test_a_probe_runs_in_the_worker_and_its_phases_come_back_in_order():
    # Named, as the exporter names them: only the worker imports them.
    w = ProbeProcess(ProbeFunctions("worker_fakes:probe", "worker_fakes:client_factory", "worker_fakes:estimate",
                                    "worker_fakes:metrics_text"))
    phases: list[str] = []
    try:
        rec, up, need = await w.call("contact", target(), 10**6, None, on_phase=phases.append)
        assert rec.verdict == Verdict.REUSED and up is True and need == 1000
        assert rec.evidence != f"pid {os.getpid()}"  # it ran in another process
        assert phases == ["cold", "pressure", "rehost", "again"]
        rec, _, need = await w.call("contact", target(), 10, None)  # over budget: no probe, the need comes back
        assert rec is None and need == 1000
        reading, reachable, failed = await w.call("watch", target())
        assert dict(reading.counters) == {"prompt_tokens_total": 42.0} and reading.start_time == 7 and reachable and not failed
    finally:
        await w.close()


async def test_a_cancelled_call_cancels_the_probe_in_the_worker(tmp_path, monkeypatch):
    marker = tmp_path / "cancelled"
    monkeypatch.setenv("FAKE_PROBE_BLOCK", str(marker))
    w = ProbeProcess(FNS)
    try:
        call = asyncio.ensure_future(w.call("contact", target(), 10**6, None))
        await asyncio.sleep(1.0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):
            if marker.exists():
                break
            await asyncio.sleep(0.05)
        assert marker.read_text().startswith("cancelled in ")
    finally:
        await w.close(timeout=5)


async def test_a_dead_worker_fails_its_calls_and_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PROBE_BLOCK", str(tmp_path / "x"))
    w = ProbeProcess(FNS)
    try:
        call = asyncio.ensure_future(w.call("contact", target(), 10**6, None))
        await asyncio.sleep(1.0)
        os.kill(w._proc.pid, signal.SIGKILL)  # our own child
        with pytest.raises(WorkerFailed, match="exited"):
            await call
        monkeypatch.delenv("FAKE_PROBE_BLOCK")  # the replacement inherits the environment as it is now
        dead = w._proc.pid
        rec, _, _ = await w.call("contact", target(), 10**6, None)
        assert rec.verdict == Verdict.REUSED and w._proc.pid != dead
    finally:
        await w.close(timeout=5)


async def test_a_scheduler_offloading_to_the_worker_publishes_its_records():
    s = Scheduler([target()], worker_fakes.probe, worker_fakes.client_factory, estimate_fn=worker_fakes.estimate,
                  watch_fn=worker_fakes.metrics_text, offload=True, initial_delay=lambda i, n, iv: 0.0)
    s.start()
    try:
        for _ in range(200):
            snap = s.snapshot()["sglang"]
            if snap.last is not None:
                break
            await asyncio.sleep(0.05)
        assert snap.last.verdict == Verdict.REUSED and snap.up is True and not snap.in_progress
    finally:
        await s.stop()
