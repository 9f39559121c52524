"""run_probe against the simulator as a real process on 127.0.0.1 (and a reshaping proxy in front).

Sizes are the field report's server scaled down 10x (device 40,000 / host 70,958 tokens, chunked
prefill 4096) with R = 8192, at a time scale that keeps each probe well under a second.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import httpx
import pytest

from canary_proxy import ReshapingProxy
from hicache_canary.probe.canary import WARMUP_TOKENS, ProgressEvent, run_probe
from hicache_canary.probe.dp_rotation import DpRankRotation, pinned_rank
from hicache_canary.models import (
    CachedTokens,
    Cause,
    CounterSnapshot,
    ErrorReason,
    GenerateResult,
    Phase,
    ProbeSettings,
    ServerFacts,
    Verdict,
)
from hicache_canary.probe.sglang_client import SGLangClient

SCALED = ("--enable-hierarchical-cache", "--enable-metrics", "--max-total-tokens", "40000",
          "--hicache-host-tokens", "70958", "--chunked-prefill-size", "4096")
HYBRID = (*SCALED, "--hybrid-model")
R = 8192


def settings(**kw) -> ProbeSettings:
    return ProbeSettings(**{"target": "sim", "context_tokens": R, "poll_interval_s": 0.05, "passive_wait_s": 2.0, "timeout_s": 30.0, **kw})


SEEDS = itertools.count(7)


async def probe(url: str, dp_ranks: DpRankRotation | None = None, **kw):
    events: list[ProgressEvent] = []
    async with SGLangClient(url) as c:
        # A new seed per probe, as in production (random.Random()): a repeated R would be a device hit.
        rec = await run_probe(c, settings(**kw), progress=events.append, rng=random.Random(next(SEEDS)), dp_ranks=dp_ranks)
    return rec, events


def prompt_tokens_total(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sglang:prompt_tokens_total"))


async def test_write_back_hybrid_is_reused_with_every_token_accounted(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_back")
    before = prompt_tokens_total(url)
    rec, events = await probe(url)
    assert rec.verdict == Verdict.REUSED, rec.evidence
    assert rec.cause == Cause.NONE
    assert rec.host_fraction >= 0.9
    assert rec.pressure.eviction_confirmed and rec.pressure.limited_by is None
    # Pressure stops at what LRU needs, not a fixed 10x40K: never more than one chunk beyond it.
    assert rec.pressure.synthetic_tokens <= rec.pressure.planned_tokens + 4096
    # A fresh server: a short warm-up request first, so R's cold prefill does not pay kernel compilation.
    # R is one more than a multiple of 64 on a hybrid model (its last Mamba state is then usable).
    assert rec.context_tokens == R - 63
    assert rec.tokens_canary == WARMUP_TOKENS + 3 * rec.context_tokens
    assert prompt_tokens_total(url) - before == rec.tokens_canary + rec.tokens_pressure
    assert [s.phase for s in rec.steps] == [Phase.WARMUP, Phase.COLD, Phase.PRESSURE, Phase.REHOST, Phase.AGAIN]
    assert events[-1].phase == "done" and events[-1].tokens_sent == rec.tokens_canary + rec.tokens_pressure
    # The next probe finds a server that has served requests: no warm-up.
    again, _ = await probe(url)
    assert [s.phase for s in again.steps][0] == Phase.COLD and again.tokens_canary == 3 * again.context_tokens


@pytest.mark.parametrize(
    "failure, cause",
    [
        pytest.param("mamba_state_not_backed_up", Cause.MAMBA_STATE_NOT_BACKED_UP, id="mamba-state"),
        pytest.param("chunked_prefill_not_backed_up", Cause.CHUNKED_PREFILL_NOT_BACKED_UP, id="chunked-prefill"),
        pytest.param("host_mamba_pool_small", Cause.HOST_POOL_PRESSURE, id="host-mamba-pool-small"),
    ],
)
async def test_write_through_failure_modes_are_silent_with_their_cause(sim, failure, cause) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_through", "--hybrid-failure", failure)
    rec, _ = await probe(url)
    assert (rec.verdict, rec.cause) == (Verdict.SILENT, cause), rec.evidence
    assert rec.step(Phase.REHOST).cached.host < 0.5 * R


async def test_write_through_without_failure_reuses(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_through", "--hybrid-failure", "none")
    rec, _ = await probe(url)
    assert rec.verdict == Verdict.REUSED, rec.evidence


async def test_idle_server_credits_no_passive_pressure(sim) -> None:
    """Nothing else runs: every token of turnover is the probe's own, none is the server's traffic."""
    url = sim(*HYBRID, "--hicache-write-policy", "write_back")
    for seed in range(2):  # the second probe runs on a full pool, where filler evicts whole older leaves
        rec, _ = await probe(url, passive_wait_s=600.0)  # no traffic: never waits for it
        assert rec.verdict == Verdict.REUSED, rec.evidence
        assert rec.pressure.passive_tokens == 0, rec.pressure
        assert rec.finished_at - rec.started_at < 60, "an idle server's probe waited for traffic"


# The field report's geometry on a healthy build: R = 11.5% of the device pool, chunked_prefill_size
# 1/43 of it, a 30-state host Mamba pool. Chunk-sized filler (43 contexts) pushed R's own state out.
REPORT_SHAPE = ("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--max-total-tokens", "88064",
                "--hicache-host-tokens", "176128", "--chunked-prefill-size", "2048", "--hybrid-failure", "none")


# Under write_through every prefill chunk of every filler context backs its Mamba state up at insert
# (SGLang keeps one per chunk): turning this device pool over backs up ~43 states, more than the 30
# the host Mamba pool holds, so R's state may be gone for a reason of the probe's own making. The
# guard says so (inconclusive, naming the Mamba pool) instead of a silent that would page someone.
@pytest.mark.parametrize("policy, verdict", [("write_through", Verdict.INCONCLUSIVE), ("write_back", Verdict.REUSED)])
async def test_report_geometry_on_a_healthy_build(sim, policy, verdict) -> None:
    url = sim(*REPORT_SHAPE, "--hicache-write-policy", policy)
    for _ in range(2):  # the second probe starts with a full host pool, as the report's did
        rec, _ = await probe(url, context_tokens=10_166)
        assert rec.verdict == verdict, rec.evidence
        if verdict == Verdict.INCONCLUSIVE:
            assert "host Mamba pool holds (30)" in rec.evidence
        assert rec.pressure.chunks < 15, rec.pressure


async def test_write_through_selective_primes_R_and_reuses(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_through_selective", "--hybrid-failure", "none")
    before = prompt_tokens_total(url)
    rec, _ = await probe(url)
    assert [s.phase for s in rec.steps] == [Phase.WARMUP, Phase.COLD, Phase.PRIME, Phase.PRESSURE, Phase.REHOST, Phase.AGAIN]
    assert rec.step(Phase.PRIME).cached.device >= R - 64  # a cheap device hit
    assert rec.verdict == Verdict.REUSED, rec.evidence
    # The prime is R plus 64 fresh tokens, so SGLang inserts (and counts a hit on) R's nodes again.
    assert rec.step(Phase.PRIME).prompt_tokens == rec.context_tokens + 64
    assert rec.tokens_canary == WARMUP_TOKENS + 4 * rec.context_tokens + 64
    assert prompt_tokens_total(url) - before == rec.tokens_canary + rec.tokens_pressure


async def test_write_through_selective_report_build_is_still_silent(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_through_selective")
    rec, _ = await probe(url)
    assert (rec.verdict, rec.cause) == (Verdict.SILENT, Cause.MAMBA_STATE_NOT_BACKED_UP), rec.evidence


async def test_hicache_off_sends_nothing(sim) -> None:
    url = sim("--enable-metrics", "--max-total-tokens", "40000")
    before = prompt_tokens_total(url)
    rec, _ = await probe(url)
    assert rec.verdict == Verdict.HICACHE_DISABLED
    assert rec.tokens_canary == rec.tokens_pressure == 0
    assert prompt_tokens_total(url) == before


async def test_too_little_pressure_is_not_evicted_never_silent(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_through")
    rec, _ = await probe(url, max_pressure_tokens=2048)
    assert rec.verdict == Verdict.NOT_EVICTED, rec.evidence
    assert rec.pressure.synthetic_tokens <= 2048 and rec.pressure.limited_by == "max_pressure_tokens"


async def test_openai_only_server_still_gets_a_verdict(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_back", "--enable-cache-report")
    with ReshapingProxy(url, openai_only=True) as proxy:
        rec, _ = await probe(proxy.url)
    assert rec.api == "openai"
    assert rec.verdict == Verdict.REUSED, rec.evidence
    assert all(b["path"] == "/v1/completions" for b in proxy.bodies)


async def test_without_tier_details_counters_decide(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_back")
    with ReshapingProxy(url, strip_details=True) as proxy:
        rec, _ = await probe(proxy.url)
    assert rec.step(Phase.REHOST).cached is None
    assert rec.verdict == Verdict.REUSED
    assert "cached_tokens_total" in rec.evidence


async def test_0_5_17_profile_without_details_uses_its_counters(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_back", "--metrics-profile", "0.5.17")
    with ReshapingProxy(url, strip_details=True) as proxy:
        rec, _ = await probe(proxy.url)
    assert rec.verdict == Verdict.REUSED, rec.evidence
    assert "cached_tokens_total" in rec.evidence


# No per-request numbers at all (OpenAI API without --enable-cache-report) and no tier counters:
# only evicted_tokens_total and latency are left. A small pool (16,000 tokens) at time scale 0.2
# keeps the pressure cheap while a cold 8K prefill (~0.6 s) stays far above the HTTP overhead.
NO_TIERS = dict(openai_only=True, strip_details=True,
                drop_metrics=("cached_tokens_total", "load_back", "prefill_effective", "hicache_backup"))


@pytest.mark.parametrize(
    "policy, min_cold, verdict",
    [
        pytest.param("write_through", 0.3, Verdict.SILENT, id="long-cold-rehost-like-cold-silent"),
        pytest.param("write_back", 0.3, Verdict.REUSED, id="long-cold-rehost-fast-reused"),
        pytest.param("write_through", 5.0, Verdict.INCONCLUSIVE, id="cold-too-short-to-tell-never-silent"),
    ],
)
async def test_without_details_or_tier_counters_latency_decides(sim, policy, min_cold, verdict) -> None:
    url = sim("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--max-total-tokens", "16000",
              "--hicache-host-tokens", "28000", "--hicache-write-policy", policy, time_scale=0.2)
    with ReshapingProxy(url, **NO_TIERS) as proxy:
        rec, _ = await probe(proxy.url, min_cold_latency_s=min_cold)
    assert rec.step(Phase.REHOST).cached is None and rec.step(Phase.REHOST).cached_tokens is None
    assert rec.verdict == verdict, rec.evidence
    assert "latency" in rec.evidence


async def test_router_is_named_not_judged(sim) -> None:
    url = sim(*HYBRID)
    with ReshapingProxy(url, router=True) as proxy:
        rec, _ = await probe(proxy.url)
    assert (rec.verdict, rec.reason) == (Verdict.ERROR, ErrorReason.TARGET_IS_ROUTER)
    assert "probe the workers directly" in rec.evidence
    assert rec.tokens_canary == 0


async def test_dp_server_pins_every_request_and_rotates(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_back")
    with ReshapingProxy(url, dp_size=2) as proxy:
        await probe(proxy.url, target="dp-rotation")
        first = {b.get("routed_dp_rank") for b in proxy.bodies}
        proxy.bodies.clear()
        await probe(proxy.url, target="dp-rotation")
        second = {b.get("routed_dp_rank") for b in proxy.bodies}
    assert len(first) == 1 and len(second) == 1 and first != second and None not in first | second


async def test_the_dp_rotation_is_the_callers(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_back")
    turns, seen = DpRankRotation(), []
    with ReshapingProxy(url, dp_size=2) as proxy:
        for kw in ({}, {}, {"dp_rank": 0}, {}):  # a configured rank takes no turn
            proxy.bodies.clear()
            await probe(proxy.url, dp_ranks=turns, **kw)
            seen.append({b.get("routed_dp_rank") for b in proxy.bodies})
    assert seen == [{0}, {1}, {0}, {0}]


def test_dp_rank_turns_per_target_and_none_without_dp() -> None:
    turns = DpRankRotation()
    assert [pinned_rank(None, 3, "a", turns) for _ in range(4)] == [0, 1, 2, 0]
    assert pinned_rank(None, 3, "b", turns) == 0
    assert pinned_rank(None, 1, "a", turns) is None and pinned_rank(2, 1, "a", turns) is None
    assert pinned_rank(2, 4, "a", turns) == 2 and pinned_rank(None, 4, "a", turns) == 0  # a's 5th turn, 4 mod 4


async def test_busy_server_is_skipped_without_tokens(sim) -> None:
    url = sim(*HYBRID)
    rec, _ = await probe(url, busy_queue_threshold=-1)  # any queue length counts as busy
    assert rec.verdict == Verdict.SKIPPED_BUSY and rec.tokens_canary == 0


async def test_server_traffic_is_credited_as_passive_pressure(sim) -> None:
    url = sim(*HYBRID, "--hicache-write-policy", "write_back", "--background-rps", "5",
              "--background-context-tokens", "4000", time_scale=0.002)
    rec, _ = await probe(url, passive_wait_s=5.0, busy_queue_threshold=1000)  # a busy server is the point here
    assert rec.pressure.passive_tokens > 0, rec.pressure
    assert rec.pressure.synthetic_tokens < rec.pressure.planned_tokens
    # The server's own traffic (5 simulated rps of 4,000-token prompts, up to 2,500 a second of real
    # time at this time scale) backs up 135-151k KV tokens between R's cold send and its re-send
    # (measured, 6 runs of 6): about twice the 70,958-token host pool, so R is pushed out of host
    # before it comes back, with a 2x margin rather than a race. A host pool that the server's own
    # traffic outruns serves R from nothing: `silent`, never `reused`.
    assert rec.verdict == Verdict.SILENT, rec.evidence
    assert rec.host_fraction == 0.0, rec.evidence


@pytest.mark.parametrize(
    "fault, reason",
    [
        pytest.param(("--fault-5xx-rate", "1"), ErrorReason.HTTP_5XX, id="5xx"),
        pytest.param(("--fault-malformed-json",), ErrorReason.BAD_RESPONSE, id="malformed-json"),
        # The dying process either refuses the next connection or drops one it had accepted: both true.
        pytest.param(("--fault-down-after", "1"), (ErrorReason.CONNECT_FAILED, ErrorReason.CONNECTION_LOST), id="down-mid-probe"),
    ],
)
async def test_server_errors_become_error_with_reason(sim, fault, reason) -> None:
    url = sim(*HYBRID, *fault)
    rec, _ = await probe(url)
    assert rec.verdict == Verdict.ERROR and rec.reason in (reason if isinstance(reason, tuple) else (reason,)), rec.evidence
    assert "\n" not in rec.evidence and rec.evidence


async def test_cancel_leaves_no_request_running(sim) -> None:
    url = sim(*HYBRID, "--warmup-seconds", "0", time_scale=1.0)  # a cold 8K prefill takes ~3 s: cancel in the middle
    async with SGLangClient(url) as c:
        seen = asyncio.Event()
        task = asyncio.create_task(run_probe(c, settings(), progress=lambda e: seen.set() if e.phase == Phase.COLD else None))
        await asyncio.wait_for(seen.wait(), 10)
        await asyncio.sleep(0.3)  # let the cold request reach the server
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        text = httpx.get(url + "/metrics").text
        running = [line for line in text.splitlines() if line.startswith("sglang:num_running_reqs")]
        if running and all(float(line.rsplit(" ", 1)[1]) == 0 for line in running):
            break
        assert asyncio.get_running_loop().time() < deadline, running
        await asyncio.sleep(0.05)


class _QueueBuildsUp:
    """A server that is idle at preflight and has real users queueing from R's cold prefill on."""

    def __init__(self) -> None:
        self.generated: list[int] = []

    async def server_info(self) -> ServerFacts:
        return ServerFacts(version="0.5.23", enable_hierarchical_cache=True, write_policy="write_back",
                           page_size=1, chunked_prefill_size=4096, max_total_num_tokens=20000,
                           max_req_input_len=100000, enable_metrics=True, hybrid_model=True)

    async def metrics(self) -> CounterSnapshot:
        queued = 5.0 if self.generated else 0.0
        return CounterSnapshot(num_queue_reqs=queued, num_running_reqs=1.0, kv_available_tokens=12000.0,
                               kv_evictable_tokens=2000.0, max_total_num_tokens=20000.0, evicted_tokens=0.0,
                               prompt_tokens=100_000.0 + sum(self.generated), host_used_tokens=0.0,  # has served traffic
                               host_total_tokens=40000.0)

    async def generate(self, input_ids, *, max_new_tokens=1, routed_dp_rank=None, timeout=300.0) -> GenerateResult:
        self.generated.append(len(input_ids))
        return GenerateResult(latency_s=0.01, prompt_tokens=len(input_ids), completion_tokens=1,
                              cached_tokens=0, details=CachedTokens())


async def test_filler_is_held_while_real_users_queue_and_the_probe_stops_before_rehost() -> None:
    server = _QueueBuildsUp()
    rec = await run_probe(server, settings(context_tokens=2000, passive_wait_s=0.2, poll_interval_s=0.02,
                                           busy_queue_threshold=2))
    assert server.generated == [1985], "only R's cold prefill (2000 to 1985: 64k+1 on a hybrid model): no filler, no rehost, no again"
    assert rec.verdict == Verdict.SKIPPED_BUSY and rec.pressure.limited_by == "server_busy"
    assert rec.tokens_canary == 1985 and rec.tokens_pressure == 0


async def test_a_fresh_servers_kernel_warm_up_never_lands_in_Rs_cold(sim) -> None:
    """Live 0.5.17: a fresh server reads prompt_tokens_total 3 (SGLang's own start-up warm-up) and its
    first real prompt still takes ~11 s of kernel compilation. The probe pays that with 64 tokens."""
    url = sim(*HYBRID, "--hicache-write-policy", "write_back", "--warmup-seconds", "10", time_scale=0.01)
    assert prompt_tokens_total(url) == 3  # the launcher's warm-up: counted, but it compiled nothing
    rec, _ = await probe(url)
    warm, cold = rec.step(Phase.WARMUP), rec.step(Phase.COLD)
    assert warm is not None and warm.prompt_tokens == WARMUP_TOKENS
    assert warm.latency_s >= 10 * 0.01  # the warm-up request paid the compilation
    assert cold.latency_s < 5 * 0.01, f"R's cold {cold.latency_s:.3f} s carries the warm-up"
