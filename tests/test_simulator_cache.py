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
    """One request as the engine runs it: match, lock, load back, reserve, insert, unlock."""
    m = c.match(tokens)
    c.lock(m)
    if c.cfg.hicache:
        m = c.load_back(m)
    need = len(tokens) - m.cached
    assert c.allocate(need)
    c.release(need)
    c.insert(tokens, chunked=len(tokens) > chunk)
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
    assert rehost.loaded == 40896 and rehost.device_tokens == 0
    assert again.device_tokens == 40896
    assert c.stats.backup_tokens["mamba"] >= 1 and c.stats.load_back_tokens["mamba"] == 1


def test_fixed_build_write_through_reuses_hybrid_host_prefixes():
    c, _, rehost, _, _, _ = _probe(write_policy="write_through", hybrid=True, failure="none")
    assert rehost.loaded == 40896
    assert c.stats.backup_tokens["mamba"] == 11  # KV and state go to host together at insert


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
