"""The simulated GPU: latency calibration, jitter, queueing, aborts, host pool sizing."""

from __future__ import annotations

import asyncio

import pytest

from hicache_canary.simulator.config import SimConfig
from hicache_canary.simulator.engine import Engine, request_seconds
from hicache_canary.simulator.metrics import bucket_bounds


def test_latency_is_calibrated_to_the_field_report():
    assert request_seconds(40960, 0, 1) == pytest.approx(15.4)
    assert request_seconds(64, 40896, 1) == pytest.approx(0.42, abs=0.01)
    assert request_seconds(64, 0, 1) == pytest.approx(0.12, abs=0.01)


def _engine(**kw) -> Engine:
    cfg = SimConfig(time_scale=1e-5, **kw)
    return Engine(cfg, bucket_bounds(cfg.metrics_profile))


async def test_jitter_stays_within_its_fraction_and_is_seeded():
    async def latencies(seed):
        e = _engine(latency_jitter=0.3, seed=seed, warmup_seconds=0.0)
        return [(await e.generate(tuple(range(i, i + 4096)), 1)).e2e_s for i in range(0, 40 * 4096, 4096)]

    a, b = await latencies(1), await latencies(1)
    assert a == b
    base = request_seconds(4096, 0, 1)
    assert all(0.69 * base <= x <= 1.31 * base + 0.01 for x in a)
    assert max(a) - min(a) > 0.2 * base


async def test_a_cancelled_request_frees_its_slots_and_is_not_cached():
    e = _engine()
    e.cfg = SimConfig(time_scale=0.5)  # long enough to cancel mid-prefill
    task = asyncio.ensure_future(e.generate(tuple(range(8000)), 1))
    while e.running == 0:
        await asyncio.sleep(0.001)
    assert e.cache.inflight > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (e.running, e.cache.inflight, e.cache.device_used, e.stats.aborted) == (0, 0, 0, 1)


def test_host_pool_sizing_follows_sglang_order():
    assert SimConfig(enable_hierarchical_cache=True, max_total_tokens=1000).host_tokens == 2000  # ratio 2.0
    assert SimConfig(enable_hierarchical_cache=True, hicache_size=11.6).host_tokens == 708007  # 16 KiB/token
    assert SimConfig(enable_hierarchical_cache=True, hicache_size=11.6, hicache_host_tokens=5).host_tokens == 5
    assert SimConfig(hicache_host_tokens=5).host_tokens == 0  # HiCache off: no host pool


def test_bad_config_names_every_bad_flag():
    with pytest.raises(ValueError) as exc:
        SimConfig(hicache_write_policy="sometimes", time_scale=0, page_size=0)
    msg = str(exc.value)
    assert "--hicache-write-policy" in msg and "--time-scale" in msg and "--page-size" in msg
