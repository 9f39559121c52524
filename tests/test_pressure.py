"""Table tests for pressure sizing, turnover accounting and eviction confirmation."""

from __future__ import annotations

import pytest

from hicache_canary.models import CounterSnapshot, ProbeSettings, ServerFacts
from hicache_canary.probe.pressure import (
    chunk_tokens,
    clamp_context,
    estimate_probe_tokens,
    eviction_confirmed,
    filler_now,
    next_chunk,
    plan_pressure,
    server_rate,
    turnover,
)

S = ProbeSettings(target="t", context_tokens=40_000)
REPORT = ServerFacts(enable_hierarchical_cache=True, page_size=1, chunked_prefill_size=4096, max_total_num_tokens=400_000, max_req_input_len=262_135)


def gauges(avail, evictable, evicted=0.0, pool=400_000) -> CounterSnapshot:
    return CounterSnapshot(kv_available_tokens=avail, kv_evictable_tokens=evictable, evicted_tokens=evicted, max_total_num_tokens=pool)


def live(avail, evictable, used, pool=40_000, evicted=0.0) -> CounterSnapshot:
    return CounterSnapshot(kv_available_tokens=avail, kv_evictable_tokens=evictable, num_used_tokens=used,
                           evicted_tokens=evicted, max_total_num_tokens=pool)


LIVE = ServerFacts(enable_hierarchical_cache=True, hybrid_model=True, write_policy="write_through", page_size=1,
                   chunked_prefill_size=2048, max_total_num_tokens=40_000, max_req_input_len=32_762)


@pytest.mark.parametrize(
    "facts, snapshot, r, need, target, from_gauges",
    [
        pytest.param(REPORT, gauges(300_000, 100_000), 40_000, 400_000, 100_000, True, id="write-back-idle-free-plus-everything-evictable"),
        # Live 0.5.17, write_through, right after R's cold request (consecutive-probes/): R's 16,384
        # tokens were locked, in neither gauge. The first plan said 23,616 and R stayed on device.
        pytest.param(LIVE, live(1600, 22_016, 16_384), 16_384, 40_000, 38_400, True, id="live-write-through-R-locked-counted"),
        pytest.param(ServerFacts(), live(1600, 22_016, 16_384, pool=None), 16_384, 40_000, 38_400, True, id="no-pool-size-evictable-plus-used"),
        pytest.param(ServerFacts(), gauges(1600, 22_016, pool=None), 16_384, 39_999, 38_399, True, id="no-pool-no-used-assume-R-locked"),
        pytest.param(ServerFacts(page_size=64, max_total_num_tokens=24_000), gauges(5000, 19_000, pool=24_000), 6000, 24_000, 19_000, True, id="page-64"),
        pytest.param(ServerFacts(max_total_num_tokens=24_000), CounterSnapshot(evicted_tokens=0.0), 6000, 24_000, 24_000, False, id="no-gauges-whole-pool"),
        pytest.param(ServerFacts(max_total_num_tokens=24_000), None, 6000, 24_000, 24_000, False, id="no-metrics-at-all-whole-pool"),
    ],
)
def test_plan_need(facts, snapshot, r, need, target, from_gauges) -> None:
    plan = plan_pressure(S, facts, snapshot, r)
    assert (plan.need_tokens, plan.evict_target, plan.from_gauges) == (need, target, from_gauges)


HYB = ServerFacts(enable_hierarchical_cache=True, hybrid_model=True, chunked_prefill_size=8192, max_total_num_tokens=354_788, max_req_input_len=262_080)


@pytest.mark.parametrize(
    "settings, facts, r, need, mamba_states, chunk",
    [
        # Few, large contexts: every filler request is a context (and, on a hybrid model, a host Mamba
        # state); 43 chunk-sized ones on the report's pool pushed R's own state out of a 30-state pool.
        pytest.param(S, REPORT, 40_000, 400_000, None, 40_000, id="at-least-R-not-the-server-chunk"),
        pytest.param(S, REPORT, 2000, 400_000, None, 4096, id="server-chunk-when-larger-than-R"),
        pytest.param(ProbeSettings(target="t", pressure_chunk_tokens=2000), REPORT, 40_000, 400_000, None, 2000, id="setting-wins"),
        pytest.param(S, ServerFacts(max_total_num_tokens=400_000), 4000, 400_000, None, 8192, id="default-when-server-silent"),
        pytest.param(S, ServerFacts(chunked_prefill_size=-1, max_total_num_tokens=400_000), 4000, 400_000, None, 8192, id="chunking-disabled-minus-one"),
        pytest.param(S, ServerFacts(chunked_prefill_size=8192, max_req_input_len=4000, max_total_num_tokens=400_000), 40_000, 400_000, None, 3936, id="never-over-max-req-input-len"),
        pytest.param(S, ServerFacts(chunked_prefill_size=8192, max_total_num_tokens=10_000), 4000, 10_000, None, 2500, id="never-over-a-quarter-of-the-pool"),
        pytest.param(S, ServerFacts(chunked_prefill_size=5000, page_size=64, max_total_num_tokens=400_000), 2000, 400_000, None, 4992, id="page-aligned-down"),
        pytest.param(S, HYB, 40_960, 354_788, 30, 40_960, id="report-9-contexts-well-under-30-states"),
        pytest.param(S, HYB, 4096, 354_788, 30, 23_653, id="short-R-grows-filler-to-half-the-mamba-pool-in-contexts"),
        pytest.param(S, HYB, 4096, 354_788, 4, 88_697, id="tiny-mamba-pool-still-capped-at-a-quarter-pool"),
    ],
)
def test_chunk_size(settings, facts, r, need, mamba_states, chunk) -> None:
    assert chunk_tokens(settings, facts, r, need, mamba_states) == chunk


def test_report_probe_inserts_few_contexts() -> None:
    """The report's pool (R 40,960, 354,788 free) now needs 9 filler requests, not 43."""
    plan = plan_pressure(S, HYB, gauges(354_788 - 40_896, 40_896, pool=354_788), 40_960)
    assert plan.chunk_tokens == 40_960
    assert -(-plan.need_tokens // plan.chunk_tokens) <= 10


def test_cap_defaults_to_four_pools_and_honours_setting() -> None:
    assert plan_pressure(S, REPORT, gauges(0, 40_000), 40_000).cap_tokens == 1_600_000
    tiny = ProbeSettings(target="t", max_pressure_tokens=1000)
    plan = plan_pressure(tiny, REPORT, gauges(300_000, 40_000), 40_000)
    assert plan.cap_tokens == 1000
    assert next_chunk(plan, plan.need_tokens, 0, 1) == 1000
    assert next_chunk(plan, plan.need_tokens, 1000, 1) == 0


def test_next_chunk_sends_only_the_remainder_then_whole_chunks() -> None:
    plan = plan_pressure(S, REPORT, gauges(300_000, 40_000), 40_000)
    assert next_chunk(plan, 100_000, 0, 1) == 40_000  # R-sized filler
    assert next_chunk(plan, 1500, 0, 1) == 1500
    assert next_chunk(plan, 1500, 0, 64) == 1536
    assert next_chunk(plan, -50, 0, 1) == 10_000  # planned turnover done, not confirmed yet: quarter chunks


@pytest.mark.parametrize(
    "planted, now, expected",
    [
        pytest.param(gauges(300_000, 40_000, 0), gauges(200_000, 140_000, 0), 100_000, id="free-slots-consumed"),
        pytest.param(gauges(1000, 40_000, 500), gauges(0, 40_000, 20_500), 21_000, id="free-then-evictions"),
        pytest.param(CounterSnapshot(prompt_tokens=100.0, cached_tokens={"device": 10.0}), CounterSnapshot(prompt_tokens=5100.0, cached_tokens={"device": 1010.0}), 4000, id="fallback-uncached-prompt-tokens"),
        pytest.param(CounterSnapshot(), CounterSnapshot(), None, id="nothing-tells"),
        # An 8K filler that evicts R's whole 40K leaf frees 32K slots: allocations were 8K, not 40K
        # (the idle server that was credited 7-30K tokens of "passive pressure").
        pytest.param(gauges(0, 40_000, 0), gauges(32_000, 8000, 40_000), 8000, id="whole-leaf-eviction-frees-slack"),
    ],
)
def test_turnover(planted, now, expected) -> None:
    assert turnover(planted, now) == expected


def test_eviction_proven_only_when_everything_in_the_pool_at_planting_left() -> None:
    planted = gauges(0, 100_000, evicted=1000, pool=100_000)
    plan = plan_pressure(S, REPORT, planted, 40_000)
    assert plan.evict_target == 100_000
    assert not eviction_confirmed(planted, gauges(0, 0, evicted=1000 + 99_999), plan)
    assert eviction_confirmed(planted, gauges(0, 0, evicted=1000 + 100_000), plan)
    assert not eviction_confirmed(CounterSnapshot(), CounterSnapshot(), plan)  # no counter: never confirmed


def test_server_rate_takes_our_own_requests_out() -> None:
    assert server_rate(50_000, 40_000, 10.0) == 1000.0
    assert server_rate(30_000, 40_000, 10.0) == 0.0  # an idle server: only our tokens moved
    assert server_rate(None, 0, 10.0) == 0.0


@pytest.mark.parametrize(
    "remaining, rate, time_left, expected",
    [
        pytest.param(100_000, 0.0, 300, 100_000, id="idle-server-all-filler-now"),
        pytest.param(100_000, 1000.0, 300, 0, id="traffic-covers-it-in-the-window-no-filler"),
        pytest.param(400_000, 1000.0, 300, 0, id="traffic-seen-first-half-of-the-window-only-measures"),
        pytest.param(400_000, 1000.0, 150, 250_000, id="filler-only-for-what-traffic-will-not-cover"),
        pytest.param(100_000, 1000.0, 0, 100_000, id="window-over-filler-for-the-rest"),
        pytest.param(-5, 1000.0, 300, 0, id="nothing-left"),
    ],
)
def test_filler_now(remaining, rate, time_left, expected) -> None:
    assert filler_now(remaining, rate, time_left, 300) == expected


def test_context_is_clamped_to_the_server() -> None:
    assert clamp_context(S, REPORT) == 40_000
    assert clamp_context(S, ServerFacts(max_req_input_len=23_994, max_total_num_tokens=24_000)) == 12_000
    assert clamp_context(S, ServerFacts(max_req_input_len=8000)) == 8000 - 64


def test_estimate_beats_the_reports_manual_method() -> None:
    idle = gauges(360_000, 0)
    est = estimate_probe_tokens(S, REPORT, idle)
    assert est == 3 * 40_000 + 360_000
    assert est < 40_000 + 10 * 40_000 + 2 * 40_000
    assert estimate_probe_tokens(ProbeSettings(target="t", context_tokens=40_000, max_pressure_tokens=0), REPORT, idle) == 120_000
