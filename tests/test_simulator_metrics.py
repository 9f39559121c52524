"""`/metrics` of the simulator against real SGLang output, family by family (names, TYPE, HELP, labels)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache_canary.simulator.config import SimConfig
from hicache_canary.simulator.engine import Engine
from hicache_canary.simulator.metrics import HttpStats, bucket_bounds, render
from fixtures import SGLANG

FIXTURES = SGLANG


def _families(text: str) -> dict:
    """name -> (type, help, {frozenset(label keys)}, {tp_rank values})."""
    out = {}
    helps = {line.split(" ", 3)[2]: line.split(" ", 3)[3] for line in text.splitlines() if line.startswith("# HELP ")}
    for fam in text_string_to_metric_families(text):
        keys = {frozenset(k for k in s.labels if k != "le") for s in fam.samples}
        ranks = {s.labels.get("tp_rank") for s in fam.samples}
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, helps.get(name), keys, ranks)
    return out


async def _probe(cfg: SimConfig, pressure: int = 10) -> Engine:
    engine = Engine(cfg, bucket_bounds(cfg.metrics_profile))
    rng = random.Random(1)
    r = tuple(rng.randrange(150000) for _ in range(40960))
    await engine.generate(r, 4)
    for _ in range(pressure):
        await engine.generate(tuple(rng.randrange(150000) for _ in range(40960)), 4)
    await engine.generate(r, 4)
    await engine.generate(r, 4)
    return engine


def _cfg(**kw) -> SimConfig:
    base = dict(enable_hierarchical_cache=True, hybrid_model=True, enable_metrics=True, tp_size=2,
                hicache_host_tokens=709577, time_scale=1e-6, speculative_algorithm="DFLASH")
    return SimConfig(**{**base, **kw})


@pytest.mark.parametrize("profile,fixture,http", [
    ("0.5.23", "sglang-0.5.23/metrics_write_back_healthy.txt", False),
    ("0.5.17", "sglang-0.5.17-live/metrics_write_back_after_probe.txt", True),
])
async def test_write_back_probe_emits_exactly_the_fixture_families(profile, fixture, http):
    cfg = _cfg(hicache_write_policy="write_back", metrics_profile=profile, tp_size=2 if profile == "0.5.23" else 1)
    engine = await _probe(cfg)
    stats = HttpStats()
    if http:  # 0.5.17 exports per-endpoint HTTP counts; the app fills these, here we stand in for it
        for ep in (("/health", "GET"), ("/model_info", "GET"), ("/generate", "POST"), ("/server_info", "GET"),
                   ("/metrics", "GET")):
            stats.requests[ep] = 1
            stats.active[ep] = 0
            stats.responses[(*ep, "200")] = 1
    ours = _families(render(cfg, engine, stats))
    real = _families((FIXTURES / fixture).read_text())
    assert set(ours) == set(real), f"missing {set(real) - set(ours)}, extra {set(ours) - set(real)}"
    for name, (typ, doc, keys, ranks) in real.items():
        assert ours[name][0] == typ, name
        assert ours[name][1] == doc, name
        assert ours[name][2] == keys, name
        assert ours[name][3] == ranks, name


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def test_write_through_hybrid_shows_the_silent_signature_on_every_rank():
    cfg = _cfg(hicache_write_policy="write_through")
    engine = await _probe(cfg)
    text = render(cfg, engine, HttpStats())
    s = _samples(text)
    for rank in ("0", "1"):
        radix = (("cache_type", "UnifiedRadixCache"), ("dp_rank", "0"), ("pool", "kv"), ("pp_rank", "0"),
                 ("tp_rank", rank))
        # 40,960 = 10 chunks of 4,096: each context is cached up to its last Mamba state, its own end.
        assert s[("sglang:hicache_backup_tokens_total", radix)] == 11 * 40960
    assert "sglang:load_back_tokens_total" not in text  # absent until the first load-back
    assert 'cache_source="host"' not in text
    host_used = [v for (n, _), v in s.items() if n == "sglang:hicache_host_used_tokens"]
    assert host_used == [11 * 40960]  # scheduler gauges come from rank 0 only


async def test_hicache_off_has_no_hicache_families_and_counts_evictions():
    cfg = _cfg(enable_hierarchical_cache=False, hybrid_model=False, tp_size=1)
    engine = await _probe(cfg)
    text = render(cfg, engine, HttpStats())
    names = {f.name for f in text_string_to_metric_families(text)}
    assert not {n for n in names if "hicache_" in n or "load_back" in n}
    s = _samples(text)
    key = ("sglang:evicted_tokens_total", (("cache_type", "UnifiedRadixCache"), ("dp_rank", "0"), ("pp_rank", "0"),
                                           ("tp_rank", "0")))
    assert s[key] > 0


async def test_fresh_server_has_no_radix_counters_but_preseeded_prefill_modes():
    cfg = _cfg()
    engine = Engine(cfg, bucket_bounds(cfg.metrics_profile))
    text = render(cfg, engine, HttpStats())
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "sglang:evicted_tokens" not in names and "sglang:hicache_backup_tokens" not in names
    assert "sglang:cached_tokens" not in names
    s = _samples(text)
    modes = {dict(k)["mode"] for (n, k) in s if n == "sglang:prefill_effective_tokens_total"}
    assert modes == {"input", "device_hit", "host_hit", "storage_hit"}


async def test_metrics_missing_fault_drops_the_cache_families_only():
    cfg = _cfg(hicache_write_policy="write_back")
    engine = await _probe(cfg, pressure=10)
    from dataclasses import replace

    from hicache_canary.simulator.config import Faults
    text = render(replace(cfg, faults=Faults(metrics_missing=True)), engine, HttpStats())
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sglang:num_running_reqs", "sglang:prompt_tokens"} <= names
    assert not {n for n in names if "hicache_" in n or "evicted_" in n or "load_back" in n}
