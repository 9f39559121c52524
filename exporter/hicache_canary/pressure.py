"""How much eviction pressure a probe needs, and when it has done its job. Pure: no IO, no clock.

SGLang's device radix cache evicts least-recently-used evictable leaves only when an allocation finds
no free slot. Right after R's cold prefill, R is the most recently used entry, so new allocations
first consume the free slots, then evict every evictable entry older than R, then R itself:

    need = kv_available_after_cold + kv_evictable_older_than_R + R      (page-aligned up)

where `kv_evictable_older_than_R = kv_evictable_tokens - R` read right after the cold request
(R is evictable then). Before R is planted the same sum is `kv_available + kv_evictable`. Without
those gauges (0.5.17) the bound is the whole device pool, `max_total_num_tokens`: nothing can hold
more slots than that.

Eviction is *confirmed* only from SGLang's `evicted_tokens_total`: its delta since R was planted must
reach everything evictable at planting, `kv_evictable_tokens` after cold (= older + R; at least R
rounded down to 64 tokens, in case R was still locked), or a whole device pool without the gauges. A host
backup of R is not used as proof: under write_through R is backed up at insert time, long before it
leaves the device. Filler stops as soon as eviction is confirmed.

Turnover since R was planted, ours and the server's alike, is the net allocation volume
`evicted_tokens delta + (kv_available_then - kv_available_now)`, signed: LRU evicts whole leaves, so
an 8K filler that evicts R's 40K leaf frees 32K slots it never used (clamping the free part at 0 had
an idle server credited with tens of thousands of tokens of "passive pressure"). Without the gauges
it falls back to uncached prompt tokens (`prompt_tokens_total` minus `cached_tokens_total` deltas).
What the server's own traffic contributes (turnover minus our own requests) is credited as passive
pressure.

Passive first: the server's own turnover rate is measured from the probe's first snapshot on (R's cold
prefill included, R's own tokens taken out). Filler is sent only for the part that traffic will not
cover before `passive_wait_s` after R was planted runs out (`filler_now`, decided in the window's
second half, once the rate is read over more than a few requests); on an idle server that is all of
it, at once, and after the window whatever is left.

Filler requests are few and large: every filler request is a context the radix tree inserts (and, on
a hybrid model under write_through, a host Mamba state: 43 chunk-sized requests on the report's pool
pushed R's own state out of a 30-state host Mamba pool). A request is `pressure_chunk_tokens` if set,
else the larger of R's length and the server's `chunked_prefill_size` (8192 if unknown), grown on a
hybrid model so the probe inserts at most half the host Mamba pool's states in contexts; never above
`max_req_input_len` and never above a quarter of the device pool. Synthetic filler per probe is
capped by `max_pressure_tokens` (default: 4x pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .models import CounterSnapshot, ProbeSettings, ServerFacts

CONTEXT_MARGIN_TOKENS = 64  # room under max_req_input_len for the generated token and specials
DEFAULT_CHUNK_TOKENS = 8192
DEFAULT_CAP_POOLS = 4
MIN_CONTEXT_TOKENS = 16
RADIX_GRAIN_TOKENS = 64  # coarsest cache granularity SGLang uses (Mamba checkpoint chunk, extra_buffer)


def align_up(n: float, page: int) -> int:
    page = max(1, page)
    return int(math.ceil(max(0.0, n) / page) * page)


def align_down(n: float, page: int) -> int:
    page = max(1, page)
    return int(max(0.0, n) // page * page)


def clamp_context(settings: ProbeSettings, facts: ServerFacts) -> int:
    """R's length: the asked-for context, within the server's input limit and half its device pool."""
    limit = settings.context_tokens
    if facts.max_req_input_len:
        limit = min(limit, facts.max_req_input_len - CONTEXT_MARGIN_TOKENS)
    if facts.max_total_num_tokens:
        limit = min(limit, facts.max_total_num_tokens // 2)
    return max(0, limit)


def cached_len(r_tokens: int, page_size: int) -> int:
    """Tokens of an R-token prompt that the radix tree keeps (whole pages of all but the last token)."""
    return align_down(max(0, r_tokens - 1), page_size)


def chunk_tokens(settings: ProbeSettings, facts: ServerFacts, r_tokens: int = 0, need_tokens: int | None = None,
                 host_mamba_states: float | None = None) -> int:
    """Tokens per filler request (see the module docstring): few, large contexts."""
    if settings.pressure_chunk_tokens:
        chunk = settings.pressure_chunk_tokens
    else:
        server = facts.chunked_prefill_size if facts.chunked_prefill_size and facts.chunked_prefill_size > 0 else DEFAULT_CHUNK_TOKENS
        chunk = max(server, r_tokens)
        if facts.hybrid_model and host_mamba_states and need_tokens:
            # Each filler context takes a host Mamba state: keep them to half the pool's states.
            most = max(1, int(host_mamba_states) // 2)
            chunk = max(chunk, math.ceil(need_tokens / most))
    if chunk <= 0:  # chunked prefill disabled on the server (-1)
        chunk = DEFAULT_CHUNK_TOKENS
    if facts.max_req_input_len:
        chunk = min(chunk, facts.max_req_input_len - CONTEXT_MARGIN_TOKENS)
    if facts.max_total_num_tokens:
        chunk = min(chunk, facts.max_total_num_tokens // 4)
    return max(facts.page_size or 1, align_down(chunk, facts.page_size or 1))


def _pool(facts: ServerFacts, snap: CounterSnapshot | None) -> int | None:
    if snap is not None and snap.max_total_num_tokens:
        return int(snap.max_total_num_tokens)
    return facts.max_total_num_tokens


@dataclass(frozen=True)
class PressurePlan:
    need_tokens: int  # turnover that pushes R out
    evict_target: int  # evicted_tokens_total delta that confirms R is gone
    chunk_tokens: int
    cap_tokens: int  # most synthetic filler we may send
    from_gauges: bool  # False: sized from max_total_num_tokens (gauges absent)


def plan_pressure(settings: ProbeSettings, facts: ServerFacts, after_cold: CounterSnapshot | None, r_tokens: int) -> PressurePlan:
    """Size the pressure from the counters read right after R's cold request."""
    page = facts.page_size or 1
    r = cached_len(r_tokens, page)
    pool = _pool(facts, after_cold) or 0
    if after_cold is not None and after_cold.kv_available_tokens is not None and after_cold.kv_evictable_tokens is not None:
        older = max(0.0, after_cold.kv_evictable_tokens - r)
        need = align_up(after_cold.kv_available_tokens + older + r, page)
        # Everything evictable at planting (older + R) must go. R may hold a little less than
        # `r` (hybrid models cache in 64-token Mamba chunks), so trust the gauge down to that grain.
        target = max(int(after_cold.kv_evictable_tokens), align_down(r, max(page, RADIX_GRAIN_TOKENS)))
        from_gauges = True
    else:
        need = align_up(pool or r, page)
        target = need
        from_gauges = False
    cap = settings.max_pressure_tokens if settings.max_pressure_tokens is not None else DEFAULT_CAP_POOLS * max(pool, need)
    mamba = after_cold.host_mamba_total_states if after_cold is not None else None
    chunk = chunk_tokens(settings, facts, r_tokens, need, mamba)
    return PressurePlan(need_tokens=need, evict_target=target, chunk_tokens=chunk, cap_tokens=max(0, cap), from_gauges=from_gauges)


def _d(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _grew(then: float | None, now: float | None) -> float | None:
    """Counter delta; a counter absent then but present now was created since (SGLang creates lazily)."""
    if now is None:
        return None
    return now - (then or 0.0)


def turnover(planted: CounterSnapshot | None, now: CounterSnapshot | None) -> float | None:
    """Device-pool allocations since R was planted (everyone's); None when nothing tells."""
    if planted is None or now is None:
        return None
    evicted = _grew(planted.evicted_tokens, now.evicted_tokens)
    free_used = _d(now.kv_available_tokens, planted.kv_available_tokens)
    if evicted is not None and free_used is not None:
        # Signed: slots freed by evicting a whole leaf beyond what an allocation needed are not turnover.
        return max(0.0, evicted + free_used)
    prompt = _grew(planted.prompt_tokens, now.prompt_tokens)
    if prompt is None:
        return max(0.0, evicted) if evicted is not None else None
    cached = sum((now.cached_tokens or {}).values()) - sum((planted.cached_tokens or {}).values())
    return max(0.0, prompt - max(0.0, cached or 0.0))


def eviction_confirmed(planted: CounterSnapshot | None, now: CounterSnapshot | None, plan: PressurePlan) -> bool:
    if planted is None or now is None:
        return False
    evicted = _grew(planted.evicted_tokens, now.evicted_tokens)
    return evicted is not None and evicted >= plan.evict_target


def filler_now(remaining_tokens: float, server_rate_tokens_per_s: float, time_left_s: float, window_s: float = 0.0) -> int:
    """Filler to send now: the part of the remaining turnover the server's own traffic, at its measured
    rate, will not cover in the time left of the passive window (all of it when idle or out of time).

    While traffic is seen, nothing in the window's first half: the rate read over R's cold prefill is a
    few requests' worth, and filler sent on it cannot be taken back (it cost 0.12x the manual method
    where the traffic alone would have done).
    """
    if remaining_tokens <= 0:
        return 0
    if server_rate_tokens_per_s > 0 and time_left_s > window_s / 2:
        return 0
    covered = max(0.0, server_rate_tokens_per_s) * max(0.0, time_left_s)
    return int(math.ceil(max(0.0, remaining_tokens - covered)))


def server_rate(turnover_tokens: float | None, own_tokens: float, elapsed_s: float) -> float:
    """The server's own allocation rate: turnover since the probe's first snapshot minus our requests."""
    if turnover_tokens is None or elapsed_s <= 0:
        return 0.0
    return max(0.0, turnover_tokens - own_tokens) / elapsed_s


def next_chunk(plan: PressurePlan, remaining_tokens: float, synthetic_sent: int, page_size: int) -> int:
    """Size of the next filler request: the remainder (page-aligned up), at most a chunk and the cap."""
    left_in_cap = plan.cap_tokens - synthetic_sent
    # Past the planned turnover but not yet confirmed (refreshed entries, lagging gauges): quarter
    # chunks, since a chunk is now R-sized and a whole one would overshoot the floor by R.
    want = align_up(remaining_tokens if remaining_tokens > 0 else plan.chunk_tokens / 4, page_size or 1)
    return max(0, min(plan.chunk_tokens, want, left_in_cap))


def r_sends(facts: ServerFacts) -> int:
    """How often a probe sends R: cold, rehost, again, plus the prime on write_through_selective."""
    return 4 if facts.write_policy == "write_through_selective" else 3


def estimate_probe_tokens(settings: ProbeSettings, facts: ServerFacts, snapshot: CounterSnapshot | None) -> int:
    """Prompt tokens a probe will send on an idle server: R's sends plus the filler (budget check)."""
    r = clamp_context(settings, facts)
    page = facts.page_size or 1
    if snapshot is not None and snapshot.kv_available_tokens is not None and snapshot.kv_evictable_tokens is not None:
        need = align_up(snapshot.kv_available_tokens + snapshot.kv_evictable_tokens, page)
    else:
        need = align_up(_pool(facts, snapshot) or r, page)
    pool = _pool(facts, snapshot) or need
    cap = settings.max_pressure_tokens if settings.max_pressure_tokens is not None else DEFAULT_CAP_POOLS * max(pool, need)
    return r_sends(facts) * r + min(need, cap)
