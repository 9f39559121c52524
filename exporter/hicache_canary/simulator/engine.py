"""The one simulated GPU: an asyncio scheduler in front of the HiCache model.

At most `max_running_requests` requests run; the rest wait in the queue, so `num_running_reqs` and
`num_queue_reqs` are real. A running request matches the cache, loads its host part back, reserves
device slots for the rest, then holds the GPU for its simulated prefill/decode time x `time_scale`;
on success its tokens are inserted (and backed up per the write policy), on cancellation (client
disconnect) they are released. Latency is calibrated to the field report: 40K cold ~15.4 s,
load-back of 40K from host ~0.4 s in total, device hit ~0.1 s; a fresh server's first request also
pays `warmup_seconds` of kernel warm-up (live 0.5.17: 10.2 s for a 16-token first request).

Scheduler steps: SGLang reaps write-through acks (`check_hicache_events` -> `writing_check`) at the
start of each scheduling pass and sleeps when idle, so a backup's lock lasts until the next request
is admitted or another running request finishes. The engine reaps at exactly those two moments.
"""

from __future__ import annotations

import asyncio
import random
import time
from bisect import bisect_left
from dataclasses import dataclass, field

from .cache import CacheConfig, HiCache, Match
from .config import SimConfig

BASE_S = 0.1  # scheduling + one decode step: a full device hit answers in ~0.1 s
PREFILL_S_PER_TOKEN = (15.4 - BASE_S) / 40960  # cold 40K prefill ~15.4 s
LOAD_BACK_S_PER_TOKEN = 0.3 / 40960  # H->D copy: a 40K rehost from host ~0.4 s in total
DECODE_S_PER_TOKEN = 1 / 48.3  # the 0.5.23 fixture's gen_throughput
STARTUP_WARMUP_IDS = (10, 11, 12)
STARTUP_WARMUP_NEW_TOKENS = 8


def request_seconds(uncached: int, host: int, new_tokens: int) -> float:
    """Simulated service time of one request (pure; before jitter and time scale)."""
    return BASE_S + uncached * PREFILL_S_PER_TOKEN + host * LOAD_BACK_S_PER_TOKEN + max(new_tokens - 1, 0) * DECODE_S_PER_TOKEN


class Hist:
    """A cumulative-bucket histogram (bounds from the metrics template of the active profile)."""

    def __init__(self, bounds: list[float]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1


@dataclass
class EngineStats:
    """Tokenizer- and scheduler-side counters (radix-cache counters live in HiCache.stats)."""

    prompt_tokens: dict[str, int] = field(default_factory=dict)  # is_streaming -> tokens
    generation_tokens: dict[str, int] = field(default_factory=dict)
    num_requests: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)  # cache_source -> tokens, creation order
    prefill_effective: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("input", "device_hit", "host_hit", "storage_hit"), 0))
    realtime: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("prefill_compute", "prefill_cache", "decode"), 0))
    forward_s: dict[str, float] = field(default_factory=lambda: {"extend": 0.0, "decode": 0.0})
    cache_hit_rate: float = 0.0
    aborted: int = 0
    requests_by_kind: dict[str, int] = field(default_factory=dict)
    hists: dict[str, Hist] = field(default_factory=dict)


@dataclass(frozen=True)
class GenResult:
    rid: str
    prompt_tokens: int
    completion_tokens: int
    cached_device: int
    cached_host: int
    e2e_s: float  # simulated seconds
    queue_s: float

    @property
    def cached(self) -> int:
        return self.cached_device + self.cached_host


class Engine:
    def __init__(self, cfg: SimConfig, bucket_bounds: dict[str, list[float]]):
        self.cfg = cfg
        self.cache = HiCache(CacheConfig(
            device_tokens=cfg.max_total_tokens, page_size=cfg.page_size, hicache=cfg.enable_hierarchical_cache,
            host_tokens=cfg.host_tokens, write_policy=cfg.hicache_write_policy, hybrid=cfg.hybrid_model,
            failure=cfg.hybrid_failure if cfg.enable_hierarchical_cache else "none",
            host_mamba_states=cfg.host_mamba_states, chunked_prefill_size=cfg.chunked_prefill_size,
        ))
        self.warm = False  # kernels compiled: only a fresh process's first request pays warm-up
        self.stats = EngineStats(hists={name: Hist(b) for name, b in bucket_bounds.items()})
        self.rng = random.Random(cfg.seed)
        self.running = 0
        self.queued = 0
        self._slots = asyncio.Semaphore(cfg.max_running_requests)
        self._gpu = asyncio.Lock()
        self._freed = asyncio.Event()
        self._seq = 0
        self.started_at = time.time()
        # SGLang's launcher sends one warm-up request of its own before it reports healthy
        # (0.5.17 http_server._execute_server_warmup: input_ids [10, 11, 12], max_new_tokens 8). It shows
        # in the tokenizer's counters but is too short to compile what a real prompt needs: live, every
        # fresh server read prompt_tokens_total 3, and its first 16,384-token prompt still took 11.0 s.
        self._account(len(STARTUP_WARMUP_IDS), STARTUP_WARMUP_NEW_TOKENS, 0, 0, len(STARTUP_WARMUP_IDS), 0.0, 0.0, 0.0, False)

    def _observe(self, name: str, v: float) -> None:
        h = self.stats.hists.get(name)
        if h is not None:
            h.observe(v)

    def _next_rid(self) -> str:
        self._seq += 1
        return f"{self.rng.getrandbits(64):016x}{self._seq:016x}"

    async def generate(self, tokens: tuple, max_new_tokens: int, kind: str = "generate", streaming: bool = False,
                       log_metrics: bool = True) -> GenResult:
        s = self.stats
        s.requests_by_kind[kind] = s.requests_by_kind.get(kind, 0) + 1
        t_arrive = time.monotonic()
        must_wait = self._slots.locked()
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        # Queue time is waiting for a slot, in simulated seconds; the event loop's own microseconds are not
        # (divided by a small time scale they would read as seconds).
        queue_s = (time.monotonic() - t_arrive) / self.cfg.time_scale if must_wait else 0.0
        reserved, match = 0, None
        try:
            self.cache.reap_acks()  # this request's admission is a scheduler step
            match, reserved = await self._admit(tokens, max_new_tokens)
            device, host = match.device_tokens, match.loaded
            uncached = len(tokens) - match.cached
            service = request_seconds(uncached, host, max_new_tokens)
            if self.cfg.latency_jitter:
                service *= 1 + self.rng.uniform(-self.cfg.latency_jitter, self.cfg.latency_jitter)
            if not self.warm:
                self.warm = True
                service += self.cfg.warmup_seconds
            async with self._gpu:
                await asyncio.sleep(service * self.cfg.time_scale)
            self.cache.release(reserved)
            reserved = 0
            self.cache.reap_acks()  # the step that finishes this request reaps what finished before it
            self.cache.insert(tokens, chunked=len(tokens) > self.cfg.chunked_prefill_size, match=match)
        except asyncio.CancelledError:
            s.aborted += 1
            raise
        finally:
            if reserved:
                self.cache.release(reserved)
            if match is not None:
                self.cache.unlock(match)
            self.running -= 1
            self._slots.release()
            self._freed.set()
        e2e = queue_s + service
        if log_metrics:
            self._account(len(tokens), max_new_tokens, device, host, uncached, service, queue_s, e2e, streaming)
        return GenResult(self._next_rid(), len(tokens), max_new_tokens, device, host, e2e, queue_s)

    async def _admit(self, tokens: tuple, max_new_tokens: int) -> tuple[Match, int]:
        """Match, load back, reserve; wait for a running request to finish when the pool is pinned."""
        while True:
            match = self.cache.match(tokens)
            self.cache.lock(match)
            if self.cfg.enable_hierarchical_cache:
                match = self.cache.load_back(match)
            need = len(tokens) - match.cached + max_new_tokens
            if self.cache.allocate(need):
                return match, need
            self.cache.unlock(match)
            self._freed.clear()
            await self._freed.wait()

    def _account(self, prompt: int, new: int, device: int, host: int, uncached: int, service: float,
                 queue_s: float, e2e: float, streaming: bool) -> None:
        s = self.stats
        key = "true" if streaming else "false"
        s.prompt_tokens[key] = s.prompt_tokens.get(key, 0) + prompt
        s.generation_tokens[key] = s.generation_tokens.get(key, 0) + new
        s.num_requests[key] = s.num_requests.get(key, 0) + 1
        for source, n in (("device", device), ("host", host)):
            if n > 0:  # SGLang's tokenizer only creates a cache_source child on a non-zero count
                s.cached_tokens[source] = s.cached_tokens.get(source, 0) + n
        s.prefill_effective["input"] += uncached
        s.prefill_effective["device_hit"] += device
        s.prefill_effective["host_hit"] += host
        s.realtime["prefill_compute"] += uncached
        s.realtime["prefill_cache"] += device + host
        s.realtime["decode"] += new
        decode_s = max(new - 1, 0) * DECODE_S_PER_TOKEN
        s.forward_s["extend"] += service - decode_s
        s.forward_s["decode"] += decode_s
        s.cache_hit_rate = (device + host) / prompt if prompt else 0.0
        self._observe("sglang:time_to_first_token_seconds", queue_s + service - decode_s)
        self._observe("sglang:e2e_request_latency_seconds", e2e)
        self._observe("sglang:queue_time_seconds", queue_s)
        self._observe("sglang:prompt_tokens_histogram", prompt)
        self._observe("sglang:uncached_prompt_tokens_histogram", uncached)
        self._observe("sglang:generation_tokens_histogram", new)
        if new > 1:
            self._observe("sglang:request_time_per_output_token_seconds", DECODE_S_PER_TOKEN)
            for _ in range(min(new - 1, 64)):
                self._observe("sglang:inter_token_latency_seconds", DECODE_S_PER_TOKEN)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.queued == 0

    def flush(self) -> bool:
        """`/flush_cache`: refuse while anything runs or waits (SGLang answers 400 then)."""
        if not self.idle:
            return False
        self.cache.reset()
        return True

