"""next_move: the pressure loop's one decision (send filler, wait, stop), as a table fed by snapshots.

The live rows replay what a real SGLang 0.5.17 reported during a probe that went wrong
(tests/testdata/sglang/sglang-0.5.17-live/consecutive-probes/): under write_through R stayed locked
after its cold request, the first plan left it out and other entries leaving were taken for R's.
"""

from __future__ import annotations

import dataclasses

import pytest

from fixtures import sglang_json
from live_records import record
from hicache_canary.models import CounterSnapshot, Phase, ProbeSettings, ServerFacts
from hicache_canary.probe.pressure import BUSY, CAP, NO_COUNTER, PROVEN, Move, Next, Progress, next_move, plan_pressure

S = ProbeSettings(target="t", context_tokens=16_384)
LIVE = ServerFacts(enable_hierarchical_cache=True, hybrid_model=True, write_policy="write_through", page_size=1,
                   chunked_prefill_size=2048, max_total_num_tokens=40_000, max_req_input_len=32_762)


def live_probe(name: str) -> dict[str, CounterSnapshot]:
    rec = record(sglang_json(f"sglang-0.5.17-live/consecutive-probes/{name}"))
    return {"planted": rec.step(Phase.COLD).after, "after_pressure": rec.step(Phase.PRESSURE).after}


@pytest.mark.parametrize("name", ["probe_write_through_second.json", "probe_write_through_small_host_second.json"])
def test_live_write_through_the_old_stop_point_is_not_proof(name) -> None:
    """The old canary stopped here and called it confirmed (evicted +22,028 against a target of
    22,016); R then came back 14,336 tokens from device. Now it sends more filler instead."""
    snaps = live_probe(name)
    plan = plan_pressure(S, LIVE, snaps["planted"], 16_384)
    assert plan.need_tokens == 40_000  # R's locked 16,384 tokens are counted
    assert plan.evict_target == 40_000 - snaps["planted"].kv_available_tokens
    nxt = next_move(plan, snaps["planted"], snaps["after_pressure"], Progress(synthetic_sent=23_637))
    assert nxt.move == Move.SEND and nxt.tokens > 0


def idle(avail=0.0, evictable=0.0, used=0.0, evicted=0.0, pool=40_000) -> CounterSnapshot:
    return CounterSnapshot(kv_available_tokens=avail, kv_evictable_tokens=evictable, num_used_tokens=used,
                           evicted_tokens=evicted, max_total_num_tokens=pool, num_queue_reqs=0.0)


PLANTED = idle(avail=1600, evictable=22_016, used=16_384, evicted=90_664)  # live numbers, write_through
PLAN = plan_pressure(S, LIVE, PLANTED, 16_384)
CHUNK = PLAN.chunk_tokens


@pytest.mark.parametrize(
    "now, progress, expected",
    [
        pytest.param(PLANTED, Progress(), Next(Move.SEND, min(CHUNK, 40_000)), id="idle-server-first-chunk"),
        pytest.param(idle(0, 20_000, 0, 90_664 + 36_000), Progress(synthetic_sent=37_600), Next(Move.SEND, 2400), id="plan-almost-spent-sends-the-remainder"),
        pytest.param(idle(0, 38_000, 0, 90_664 + 38_399), Progress(synthetic_sent=40_000), Next(Move.SEND, 64), id="one-token-short-of-proof-sends-a-radix-grain"),
        pytest.param(idle(0, 38_000, 0, 90_664 + 38_400), Progress(synthetic_sent=40_000), Next(Move.STOP, why=PROVEN), id="everything-at-planting-evicted-proven"),
        pytest.param(idle(0, 38_000, 0, 90_664 + 38_399), Progress(synthetic_sent=PLAN.cap_tokens), Next(Move.STOP, why=CAP), id="cap-spent-without-proof-stops"),
        pytest.param(idle(0, 20_000, 0, 90_664 + 10_000), Progress(synthetic_sent=0, server_rate=500.0, time_left_s=250, window_s=300), Next(Move.WAIT, why="server_traffic"), id="traffic-will-do-it-wait"),
        pytest.param(dataclasses.replace(PLANTED, num_queue_reqs=9.0), Progress(busy=True), Next(Move.WAIT, why=BUSY), id="users-queueing-hold-filler"),
        pytest.param(dataclasses.replace(PLANTED, num_queue_reqs=9.0), Progress(busy=True, busy_too_long=True), Next(Move.STOP, why=BUSY), id="users-queueing-too-long-stop"),
    ],
)
def test_next_move(now, progress, expected) -> None:
    assert next_move(PLAN, PLANTED, now, progress) == expected


def test_without_an_eviction_counter_the_planned_turnover_is_all_it_sends() -> None:
    planted = CounterSnapshot(prompt_tokens=1000.0)
    plan = plan_pressure(S, LIVE, planted, 16_384)
    assert plan.need_tokens == 40_000 and not plan.from_gauges
    assert next_move(plan, planted, CounterSnapshot(prompt_tokens=1000.0 + 39_000), Progress(synthetic_sent=39_000)) == Next(Move.SEND, 1000)
    # An eviction counter that lags the plan (refreshed entries): quarter chunks past the plan.
    planted, now = CounterSnapshot(prompt_tokens=0.0, evicted_tokens=0.0), CounterSnapshot(prompt_tokens=41_000.0, evicted_tokens=30_000.0)
    assert next_move(plan, planted, now, Progress(synthetic_sent=41_000)) == Next(Move.SEND, plan.chunk_tokens // 4)
    assert next_move(plan, planted, CounterSnapshot(prompt_tokens=1000.0 + 40_000), Progress(synthetic_sent=40_000)) == Next(Move.STOP, why=NO_COUNTER)
    # No metrics at all: our own sends are the only measure.
    assert next_move(plan, None, None, Progress(synthetic_sent=40_000)) == Next(Move.STOP, why=NO_COUNTER)
