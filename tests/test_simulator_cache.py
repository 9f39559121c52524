"""The pure HiCache model: policies and failure modes behave as SGLang's code says (facts 3a-3c)."""

from __future__ import annotations

import random
import time

import pytest

from hicache_canary.simulator.cache import CacheConfig, HiCache

CTX = 40960


def _tokens(rng: random.Random, n: int = CTX) -> tuple:
    return tuple(memoryview(rng.randbytes(4 * n)).cast("I"))  # the cache never looks at id values


def _serve(c: HiCache, tokens: tuple, chunk: int = 4096):
    """One request as the engine runs it: (scheduler step) match, lock, load back, reserve, (step) insert, unlock."""
    c.reap_acks()
    m = c.match(tokens)
    c.lock(m)
    if c.cfg.hicache:
        m = c.load_back(m)
    need = len(tokens) - m.cached
    assert c.allocate(need)
    c.release(need)
    c.reap_acks()
    c.insert(tokens, chunked=len(tokens) > chunk, match=m)
    c.unlock(m)
    return m


def _probe(pressure: int = 10, **kw):
    """The field report's probe: R cold, `pressure` unique 40K contexts, R again twice."""
    c = HiCache(CacheConfig(device_tokens=400000, hicache=True, host_tokens=709577, **kw))
    rng = random.Random(7)
    r = _tokens(rng)
    cold = _serve(c, r)
    host_before = c.host_used
    for _ in range(pressure):
        _serve(c, _tokens(rng))
    host_after = c.host_used
    rehost = _serve(c, r)
    again = _serve(c, r)
    return c, cold, rehost, again, host_before, host_after


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_plain_model_reuses_the_host_copy_under_both_policies(policy):
    c, cold, rehost, again, _, _ = _probe(write_policy=policy)
    assert cold.cached == 0
    assert rehost.device_tokens == 0 and rehost.loaded == CTX - 1  # page 1: all but the last token
    assert again.device_tokens == CTX - 1
    assert c.stats.load_back_tokens["kv"] == CTX - 1


def test_hybrid_write_through_silently_loses_the_state_while_the_host_pool_grows():
    c, cold, rehost, again, host_before, host_after = _probe(write_policy="write_through", hybrid=True,
                                                             failure="mamba_state_not_backed_up")
    assert rehost.cached == 0  # rehost == cold: the host KV has no Mamba state at its boundary
    assert again.device_tokens == 40896  # the device tier still works (64-token checkpoints)
    assert host_after > host_before > 0 and host_after >= 10 * 40896
    assert c.stats.backup_tokens.get("mamba", 0) == 0 and not c.stats.load_back_tokens


def test_hybrid_write_back_backs_up_state_with_kv_at_eviction():
    c, _, rehost, again, _, _ = _probe(write_policy="write_back", hybrid=True, failure="mamba_state_not_backed_up")
    # R = 10 chunks of 4096: states at each chunk end; the rehost may use at most 40,959 tokens, so it
    # ends on the 9th chunk's state; it tracks a new one at 40,896 (the branching point) for `again`.
    assert rehost.loaded == 36864 and rehost.device_tokens == 0
    assert again.device_tokens == 40896
    assert c.stats.backup_tokens["mamba"] >= 9 and c.stats.load_back_tokens["mamba"] == 9


def test_fixed_build_write_through_reuses_hybrid_host_prefixes():
    # Every chunk node's state goes to host with its KV at insert (10 per 40K context): a host Mamba
    # pool of 30 states holds three contexts, so give it room for the probe's twelve.
    c, _, rehost, _, _, _ = _probe(write_policy="write_through", hybrid=True, failure="none", host_mamba_states=120)
    assert rehost.loaded == 36864
    assert c.stats.backup_tokens["mamba"] == 11 * 10


def test_fixed_build_write_through_outgrows_a_small_host_mamba_pool_with_chunk_states():
    c, _, rehost, _, _, _ = _probe(write_policy="write_through", hybrid=True, failure="none", host_mamba_states=30)
    assert rehost.cached == 0  # R's ten states were pushed out by three 40K contexts' thirty
    assert c.host_mamba_used == 30


def test_chunked_prefills_are_never_backed_up_under_write_through():
    c, _, rehost, _, _, host_after = _probe(write_policy="write_through", hybrid=True,
                                            failure="chunked_prefill_not_backed_up")
    assert rehost.cached == 0
    assert host_after == 0 and not c.stats.backup_tokens  # no backups at all: the chunked signature
    short = HiCache(CacheConfig(device_tokens=8192, hicache=True, host_tokens=20000, hybrid=True,
                                failure="chunked_prefill_not_backed_up"))
    _serve(short, _tokens(random.Random(1), 1000))  # shorter than the chunk: backed up as usual
    assert short.host_used == 960


def test_small_host_mamba_pool_leaves_dead_host_kv():
    c, _, rehost, _, _, host_after = _probe(write_policy="write_through", hybrid=True,
                                            failure="host_mamba_pool_small", host_mamba_states=4)
    assert rehost.cached == 0
    assert host_after > 400000 and c.host_mamba_used == 4


def test_write_back_drops_with_host_pressure_when_the_host_pool_cannot_make_room():
    c = HiCache(CacheConfig(device_tokens=10000, hicache=True, host_tokens=3000, write_policy="write_back"))
    rng = random.Random(3)
    a = _tokens(rng, 4000)
    _serve(c, a)
    c.lock(c.match(a))  # a running request pins a; the next ones must evict each other
    for _ in range(4):
        _serve(c, _tokens(rng, 4000))
    assert c.stats.dropped_tokens["host_pressure"] > 0
    assert c.host_used <= 3000


def test_write_through_selective_needs_a_second_hit_before_backing_up():
    c = HiCache(CacheConfig(device_tokens=100000, hicache=True, host_tokens=100000,
                            write_policy="write_through_selective"))
    r = _tokens(random.Random(4), 5000)
    _serve(c, r)
    assert c.host_used == 0
    _serve(c, r)
    assert c.host_used == 5000


def test_page_alignment_and_load_back_threshold():
    c = HiCache(CacheConfig(device_tokens=100000, page_size=64, hicache=True, host_tokens=100000))
    r = _tokens(random.Random(5), 1000)
    _serve(c, r)
    assert c.match(r).device_tokens == 960  # 15 pages of 64; the tail page is not cached
    tiny = HiCache(CacheConfig(device_tokens=20, hicache=True, host_tokens=100))
    t = _tokens(random.Random(6), 9)
    _serve(tiny, t)
    _serve(tiny, _tokens(random.Random(8), 18))  # evicts t to host
    assert tiny.match(t).cached == 0  # 8 host tokens are below SGLang's load_back_threshold of 10


def test_hicache_off_is_plain_radix_cache_evicted_is_gone():
    c = HiCache(CacheConfig(device_tokens=50000))
    rng = random.Random(9)
    r = _tokens(rng, 30000)
    _serve(c, r)
    _serve(c, _tokens(rng, 30000))
    assert c.match(r).cached == 0 and c.host_used == 0
    assert c.stats.evicted_tokens == 30000 and not c.stats.backup_tokens


def test_reset_clears_both_tiers():
    c, *_ = _probe(write_policy="write_back")
    c.reset()
    assert c.host_used == 0 and c.device_used == 0 and not list(c.nodes())


def test_a_40k_request_costs_well_under_50ms_of_cpu_with_a_full_host_pool():
    c, *_ = _probe(write_policy="write_through", pressure=16)
    r = _tokens(random.Random(11))
    t = time.process_time()
    _serve(c, r)
    _serve(c, r)
    assert (time.process_time() - t) / 2 < 0.05


# --- What the live 0.5.17 server taught (tests/testdata/sglang/sglang-0.5.17-live) -------------------


def _live(**kw) -> HiCache:
    """The live servers' geometry: device 40,000, ratio 4, --chunked-prefill-size 2048, hybrid."""
    return HiCache(CacheConfig(**{"device_tokens": 40000, "hicache": True, "host_tokens": 160000, "hybrid": True,
                                  "failure": "none", "host_mamba_states": 128, "chunked_prefill_size": 2048, **kw}))


@pytest.mark.parametrize(
    "r_len, rehost, again",
    [
        pytest.param(16384, 14336, 16320, id="16384-consecutive-probes"),  # probe_write_through_second.json
        pytest.param(16320, 14336, 16256, id="16320-first-probes"),  # consecutive-probes/README.md
        pytest.param(6000, 5952, 5952, id="6000-earlier-run"),  # sglang-0.5.17-live/README.md table
        pytest.param(1500, 1472, 1472, id="1500-earlier-run"),
    ],
)
def test_hybrid_hits_stop_at_mamba_checkpoints_as_live(r_len, rehost, again):
    c = _live()
    rng = random.Random(r_len)
    r = _tokens(rng, r_len)
    _serve(c, r, chunk=2048)
    for _ in range(5):
        _serve(c, _tokens(rng, 8000), chunk=2048)
    assert c.match(r).device_tokens == 0  # R left the device
    m = _serve(c, r, chunk=2048)
    assert (m.device_tokens, m.loaded) == (0, rehost)
    assert _serve(c, r, chunk=2048).device_tokens == again


@pytest.mark.parametrize(
    "r_len, rehost",
    [
        # Live 0.5.17 with --chunked-prefill-size 16384 (conformance/big-chunk/): a 16,384-token R
        # came back 0 from host (its one Mamba state sits at its own end), a 16,321-token R 16,320.
        pytest.param(16384, 0, id="16384-one-state-at-its-end-0"),
        pytest.param(16321, 16320, id="16321-state-at-its-last-but-one-token"),
    ],
)
def test_one_chunk_as_long_as_R_leaves_no_usable_state_unless_R_is_64k_plus_1(r_len, rehost):
    c = _live(chunked_prefill_size=16384)
    rng = random.Random(r_len)
    r = _tokens(rng, r_len)
    _serve(c, r, chunk=16384)
    for _ in range(4):
        _serve(c, _tokens(rng, 10000), chunk=16384)
    assert c.match(r).device_tokens == 0
    m = _serve(c, r, chunk=16384)
    assert (m.device_tokens, m.loaded) == (0, rehost)


def test_a_request_shorter_than_the_mamba_grain_caches_nothing():
    c = _live()
    _serve(c, _tokens(random.Random(1), 16))  # the live nudge: no forward reached a 64-token mark
    assert c.device_used == 0 and c.host_used == 0


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_write_through_locks_R_until_the_next_scheduler_step(policy):
    """write-through-lock/README.md: R is counted used, not evictable, while the server idles."""
    c = _live(write_policy=policy, hybrid=False)
    rng = random.Random(2)
    r = _tokens(rng, 8192)
    _serve(c, _tokens(rng, 512))
    for _ in range(2 if policy == "write_through_selective" else 1):  # selective backs up on the 2nd hit
        _serve(c, r)
    # The backup reached host at once (selective: the 512, seen once, never backs up).
    assert c.host_used == (8192 if policy == "write_through_selective" else 512 + 8192)
    assert (c.locked_tokens(), c.evictable_tokens()) == (8192, 512)  # idle: the ack is not reaped
    assert c.reap_acks() == 8192  # any request (the live nudge: 16 tokens) is a scheduler step
    assert (c.locked_tokens(), c.evictable_tokens()) == (0, 8704)
    assert c.make_device_room(40000) and c.device_used == 0  # now R can leave the device


def test_write_back_never_locks_at_insert():
    c = _live(write_policy="write_back", hybrid=False)
    _serve(c, _tokens(random.Random(3), 8192))
    assert (c.locked_tokens(), c.evictable_tokens(), c.host_used) == (0, 8192, 0)
