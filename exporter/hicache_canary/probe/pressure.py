"""How much eviction pressure a probe needs, and when it has done its job. Pure: no IO, no clock.

SGLang's device radix cache evicts least-recently-used evictable leaves only when an allocation finds
no free slot. Right after R's cold prefill, R is the most recently used entry, so new allocations
first consume the free slots, then evict every entry older than R, then R itself:

    need = kv_available + occupied,   occupied = max_total_num_tokens - kv_available   (page-aligned up)

read right after R's cold request. `occupied` is everything that is not free: the evictable entries,
R itself, and whatever is still *locked*. A live SGLang 0.5.17 under write_through keeps a freshly
inserted R locked (`write_backup` takes `inc_lock_ref`; `writing_check` drops it only when the
scheduler runs again, so on an idle server R sits in `num_used_tokens`, in neither `kv_available` nor
`kv_evictable`, until the next request). The first plan, `kv_available + kv_evictable`, left such an
R out, sent 23,637 tokens against a 40,000-token pool and rehosted R from device
(tests/testdata/sglang/sglang-0.5.17-live/consecutive-probes/). Locked entries other than R are
older than R on an idle server, so they count too; KV held by running requests is over-counted
(it becomes newer than R when those requests finish), which only makes the proof stricter. Without
the gauges (older releases) the bound is the whole device pool, `max_total_num_tokens`.

Eviction is *proven* only from SGLang's `evicted_tokens_total`: its delta since R was planted must
reach `occupied`. Every token evicted since then is either one of the entries that were in the pool
at planting (R among them) or a newer one; LRU takes a newer entry only once R is gone (R, the newest
at planting, is evicted before anything inserted after it, once its write-through lock is released,
which the first filler request does). So `occupied` tokens evicted cannot all come from the entries
older than R: R is among them. Other entries leaving, however many, never prove it. A host backup of
R is not used as proof either: under write_through R is backed up at insert time, long before it
leaves the device. Filler stops as soon as eviction is proven; while it is not, filler goes on past
the planned turnover in quarter chunks, up to `max_pressure_tokens`, before R is re-sent.

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
from enum import Enum

from hicache_canary.models import CounterSnapshot, ProbeSettings, ServerFacts

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
    """R's length: the asked-for context, within the server's input limit and half its device pool.

    On a hybrid model, one more than a multiple of the Mamba checkpoint grain (max(64, page)). SGLang
    keeps a Mamba state only at each prefill chunk's last 64-token mark, and a returning prompt may
    match at most its length minus one: an R of 16,384 tokens with 2,048-token chunks can come back
    only to 14,336 (live 0.5.17), and with chunks of R's own length or longer only to 0, a host
    "miss" that says nothing about HiCache. With R = k * grain + 1 the last state is R's last-but-one
    token, whatever the chunk size.
    """
    limit = settings.context_tokens
    if facts.max_req_input_len:
        limit = min(limit, facts.max_req_input_len - CONTEXT_MARGIN_TOKENS)
    if facts.max_total_num_tokens:
        limit = min(limit, facts.max_total_num_tokens // 2)
    if facts.hybrid_model:
        grain = checkpoint_grain(facts)
        limit = (limit - 1) // grain * grain + 1 if limit > grain else limit
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
    evict_target: int  # evicted_tokens_total delta that proves R is gone (`occupied` at planting)
    chunk_tokens: int
    cap_tokens: int  # most synthetic filler we may send
    from_gauges: bool  # False: sized from max_total_num_tokens (gauges absent)


def occupied_tokens(facts: ServerFacts, snap: CounterSnapshot | None, r_cached: int) -> float | None:
    """Device slots not free right after R's cold request (evictable, locked, R): None without gauges."""
    if snap is None or snap.kv_available_tokens is None:
        return None
    pool = _pool(facts, snap)
    if pool:
        return max(0.0, pool - snap.kv_available_tokens)
    if snap.kv_evictable_tokens is None:
        return None
    # No pool size: evictable plus what is in use; without `num_used_tokens`, assume R is locked.
    used = snap.num_used_tokens if snap.num_used_tokens is not None else r_cached
    return snap.kv_evictable_tokens + used


def plan_pressure(settings: ProbeSettings, facts: ServerFacts, after_cold: CounterSnapshot | None, r_tokens: int) -> PressurePlan:
    """Size the pressure from the counters read right after R's cold request."""
    page = facts.page_size or 1
    r = cached_len(r_tokens, page)
    pool = _pool(facts, after_cold) or 0
    occupied = occupied_tokens(facts, after_cold, r)
    if after_cold is not None and occupied is not None:
        need = align_up(after_cold.kv_available_tokens + occupied, page)
        target = int(occupied)
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
    """R's own tokens provably left the device (module docstring): evictions since planting >= occupied."""
    if planted is None or now is None:
        return False
    evicted = _grew(planted.evicted_tokens, now.evicted_tokens)
    return evicted is not None and evicted >= plan.evict_target


class Move(str, Enum):
    SEND = "send"  # send `tokens` of filler now
    WAIT = "wait"  # poll the counters again after poll_interval_s
    STOP = "stop"  # pressure is over (`why` says whether R's eviction is proven)


# Why pressure stopped. Only PROVEN means the counters showed R's own tokens leave the device.
PROVEN = "proven"
NO_COUNTER = "no_eviction_counter"
CAP = "max_pressure_tokens"
BUSY = "server_busy"


@dataclass(frozen=True)
class Next:
    move: Move
    tokens: int = 0
    why: str = ""


@dataclass(frozen=True)
class Progress:
    """What the pressure loop knows besides the snapshots: its own sends, the clock, the queue."""

    synthetic_sent: int = 0  # filler tokens sent so far
    server_rate: float = 0.0  # the server's own turnover, tokens/s (0: idle, or not measurable)
    time_left_s: float = 0.0  # of the passive window that began when R was planted
    window_s: float = 0.0  # that window's length
    busy: bool = False  # real users are queueing now
    busy_too_long: bool = False  # ... and the hold already outlasted a second passive window


def next_move(plan: PressurePlan, planted: CounterSnapshot | None, now: CounterSnapshot | None, progress: Progress, page_size: int = 1) -> Next:
    """The pressure loop's one decision: send filler, wait for the server's traffic, or stop.

    Pure, fed by the snapshot at planting and the latest one. Pressure never stops for want of
    proof while the cap allows more: once the planned turnover is spent and R's eviction is still
    unproven (R was locked longer, traffic refreshed older entries), it goes on in quarter chunks.
    """
    if eviction_confirmed(planted, now, plan):
        return Next(Move.STOP, why=PROVEN)
    moved = turnover(planted, now)
    remaining = plan.need_tokens - (moved if moved is not None else progress.synthetic_sent)
    if remaining <= 0 and (now is None or now.evicted_tokens is None):
        # Nothing can prove eviction here (metrics off, or no evicted_tokens_total): the planned
        # turnover is all we can do; the rehost's tier details decide, and without them no `silent`.
        return Next(Move.STOP, why=NO_COUNTER)
    want = remaining if remaining > 0 else plan.chunk_tokens / 4
    if moved is not None:
        want = filler_now(want, progress.server_rate, progress.time_left_s, progress.window_s)
        if want <= 0:
            return Next(Move.WAIT, why="server_traffic")
    if progress.busy:
        # Real users queued up after preflight: filler would only delay them, and their traffic
        # turns the pool over anyway. Hold it, for one more passive window at most.
        return Next(Move.STOP, why=BUSY) if progress.busy_too_long else Next(Move.WAIT, why=BUSY)
    # A request shorter than the radix grain may not be cached at all, so it evicts nothing.
    n = next_chunk(plan, max(want, RADIX_GRAIN_TOKENS), progress.synthetic_sent, page_size)
    if n <= 0:
        return Next(Move.STOP, why=CAP)
    return Next(Move.SEND, tokens=n)


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


def checkpoint_grain(facts: ServerFacts) -> int:
    """Granularity of a hybrid model's Mamba checkpoints: 64 tokens, or the page when larger."""
    return max(RADIX_GRAIN_TOKENS, facts.page_size or 1)


def prime_tail(facts: ServerFacts) -> int:
    """Fresh tokens after R in write_through_selective's prime (canary.send_r says why)."""
    return checkpoint_grain(facts) if facts.hybrid_model else 0


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
    prime = prime_tail(facts) if facts.write_policy == "write_through_selective" else 0
    return r_sends(facts) * r + prime + min(need, cap)
