"""Pure decision: one probe record -> verdict, suspected cause and a one-sentence evidence.

No IO, no clock. The rules (also in docs/verdicts.md), in the order they are tried:

0. Outcomes decided before any token was sent pass through: an error reason -> `error`;
   HiCache off -> `hicache_disabled`; a preset `skipped_busy` / `skipped_budget` stays.
1. Per-request tier details (`cached_tokens_details` of R's rehost and again requests):
   - again served from device for less than half of R's cacheable tokens -> `device_cache_broken`
     (R was just prefilled twice; a working radix cache must hit it), unless `evicted_tokens_total`
     grew by R's size around the again request (a busy server evicted it again; the check is void).
   - rehost served from device for at least half of R -> `not_evicted` (pressure too small).
   - rehost host share >= `host_hit_threshold` -> `reused` (a partial hit is reported with its fraction).
   - otherwise R left the device (the details prove it) and came back mostly by prefill -> `silent`.
2. SGLang's counter deltas over the rehost request (`cached_tokens_total{cache_source}`, else
   `prefill_effective_tokens_total{mode}`, else `load_back_tokens_total`): the same thresholds, but
   `silent` additionally needs eviction confirmed by `evicted_tokens_total` (see pressure.py).
3. Latency ratio, only when 1 and 2 are missing: eviction must be confirmed, the cold prefill must
   take at least `min_cold_latency_s` and the again request must be well below cold (ratio < 0.3),
   proving that prefill cost is visible. Then rehost/cold > 0.7 -> `silent`, < 0.3 -> `reused`,
   between -> `inconclusive`. A short cold prefill never yields `silent`: on a live 0.5.17 a full host
   hit was slower than the cold prefill it replaced.
   Without tier evidence, unconfirmed eviction -> `not_evicted`, never `silent`.

Guard against the probe's own filler (hybrid models), tried when no specific cause (chunked R, Mamba
state never backed up) explains the miss: every filler request is a context, and under write_through
each backs up its own host Mamba state (under write_back, each context it evicts does). When as many
states as the host Mamba pool holds (`hicache_host_mamba_total_states`) were backed up after R (or,
without that counter, the probe sent that many filler requests), a host miss is not evidence against
the server -> `inconclusive`, naming what to change
(a larger `context_tokens` / `pressure_chunk_tokens`: fewer, larger contexts) - unless the host KV pool
holds at least twice as many contexts of R's length as the Mamba pool has states, and the device pool
at least as many: then any workload of such contexts loses states long before KV, a real
`host_pool_pressure` read from the gauges alone.

Suspected cause of `silent` (counter deltas over the probe; first match wins, specific evidence first):
- `chunked_prefill_not_backed_up`: write_through(_selective), R longer than `chunked_prefill_size`,
  and the KV backups between R's cold send and the start of pressure are below half of R.
- `mamba_state_not_backed_up`: hybrid model, KV backed up (>= half of R) but the Mamba backups are 0
  or below a quarter of the contexts we inserted (R plus each filler request).
- `host_pool_pressure`: `hicache_dropped_tokens_total{reason="host_pressure"}` grew, or the host
  Mamba pool was full (states) when R was re-sent, or part of R came back from host while the host
  KV pool had less room left than R (what 0.5.17 exports: live, 6,144 of 14,336 from host with
  46,336 of 48,001 used). A full host KV pool alone is not: under write_through it fills up as a
  matter of course (the report's reached 592,658 of 709,577, with 116,919 free, above R's 40,960).
  Also when the host pool is smaller than the device pool plus R (`--hicache-ratio` near 1): the
  turnover that evicts R from the device backs up more than the host can hold beside R.
- `load_back_skipped`: KV and Mamba backed up, no pressure, yet the rehost loaded nothing back.
- `unknown`: none of the above, or the counters needed are missing (0.5.17 has no backup counter).
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import (
    Cause,
    CounterSnapshot,
    ErrorReason,
    Phase,
    ProbeRecord,
    ProbeSettings,
    ServerFacts,
    StepRecord,
    Verdict,
)

DEVICE_SHARE_NOT_EVICTED = 0.5  # rehost device share at/above this: R never left the device
DEVICE_SHARE_AGAIN_OK = 0.5  # again device share below this: the device cache itself is broken
LATENCY_SILENT_RATIO = 0.7
LATENCY_REUSED_RATIO = 0.3
AGAIN_VISIBLE_RATIO = 0.3  # again/cold below this proves prefill cost shows in latency
# R's KV never reached host, or its state never did: the miss is explained whatever filled the Mamba pool.
SPECIFIC_CAUSES = (Cause.CHUNKED_PREFILL_NOT_BACKED_UP, Cause.MAMBA_STATE_NOT_BACKED_UP)
MAMBA_POOL_OUTGROWN = 2  # host KV contexts of R's length per host Mamba state that make the pool the bottleneck
MAMBA_BACKUP_SHARE = 0.25
KV_BACKUP_SHARE = 0.5


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    cause: Cause = Cause.NONE
    reason: ErrorReason | None = None
    evidence: str = ""
    host_fraction: float | None = None
    rehost_cold_ratio: float | None = None


def cacheable_tokens(record: ProbeRecord) -> int:
    """Tokens of R the radix cache can hold: what `again` hit, else R page-aligned down (minus the last)."""
    again = record.step(Phase.AGAIN)
    if again and again.cached and again.cached.total > 0:
        return again.cached.total
    cold = record.step(Phase.COLD)
    length = (cold.prompt_tokens if cold and cold.prompt_tokens else record.context_tokens) or 0
    page = max(1, record.server.page_size if record.server else 1)
    return max(1, ((length - 1) // page) * page)


def _delta(before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return None
    return max(0.0, after - before)


def _child(d: dict[str, float] | None, key: str, known: bool) -> float | None:
    """A labelled child; an absent child of a family this server has counts as 0 (SGLang creates
    children, and some whole families, only on their first increment)."""
    if d is not None and key in d:
        return d[key]
    return 0.0 if known else None


def _sum(d: dict[str, float] | None) -> float | None:
    return None if d is None else sum(d.values())


COUNTER_FAMILIES = {
    "backup_tokens": "hicache_backup_tokens_total",
    "load_back_tokens": "load_back_tokens_total",
    "cached_tokens": "cached_tokens_total",
    "prefill_effective_tokens": "prefill_effective_tokens_total",
    "dropped_tokens": "hicache_dropped_tokens_total",
}


def known_counters(record: ProbeRecord) -> frozenset[str]:
    """Counter fields this server evidently exports: seen in any snapshot of the probe."""
    seen = set()
    for step in record.steps:
        for snap in (step.before, step.after):
            if snap is None:
                continue
            for attr, family in COUNTER_FAMILIES.items():
                if getattr(snap, attr) is not None or family in snap.families:
                    seen.add(attr)
    # hicache_backup_tokens_total appears on its first backup, but came in the same releases as the
    # pre-seeded prefill_effective_tokens_total (0.5.23 has both, 0.5.17 neither): a server with the
    # latter and no backup series has backed up nothing yet.
    if "prefill_effective_tokens" in seen:
        seen.add("backup_tokens")
    return frozenset(seen)


def _labelled_delta(before: CounterSnapshot | None, after: CounterSnapshot | None, attr: str, key: str, known: frozenset[str]) -> float | None:
    if before is None or after is None:
        return None
    k = attr in known
    return _delta(_child(getattr(before, attr), key, k), _child(getattr(after, attr), key, k))


def _has_tier_labels(snap: CounterSnapshot | None) -> bool:
    return bool(snap and snap.cached_tokens and any(k in ("device", "host") for k in snap.cached_tokens))


@dataclass(frozen=True)
class TierCounts:
    device: float | None
    host: float
    source: str


def counter_tiers(step: StepRecord | None, known: frozenset[str]) -> TierCounts | None:
    """Host (and device) cached tokens over one step from SGLang's counters, best family first."""
    if step is None or step.before is None or step.after is None:
        return None
    b, a = step.before, step.after
    if _has_tier_labels(b) or _has_tier_labels(a):
        host = _labelled_delta(b, a, "cached_tokens", "host", known)
        dev = _labelled_delta(b, a, "cached_tokens", "device", known)
        if host is not None:
            return TierCounts(dev, host, "cached_tokens_total{cache_source}")
    if "prefill_effective_tokens" in known:
        host = _labelled_delta(b, a, "prefill_effective_tokens", "host_hit", known)
        dev = _labelled_delta(b, a, "prefill_effective_tokens", "device_hit", known)
        if host is not None:
            return TierCounts(dev, host, "prefill_effective_tokens_total{mode}")
    # load_back_* appears only after its first load-back: trust its absence as 0 only where the same
    # radix collector evidently exists (its backup counter is there).
    if "load_back_tokens" in known or "backup_tokens" in known:
        host = _delta(_sum(b.load_back_tokens) or 0.0, _sum(a.load_back_tokens) or 0.0)
        return TierCounts(None, host or 0.0, "load_back_tokens_total")
    return None


def eviction_confirmed(record: ProbeRecord) -> bool:
    return bool(record.pressure.eviction_confirmed)


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _first_before(record: ProbeRecord) -> CounterSnapshot | None:
    for s in record.steps:
        if s.before is not None:
            return s.before
    return None


def suspect_cause(record: ProbeRecord, rehost_host: float | None = None) -> tuple[Cause, str]:
    """Why a silent probe was silent, from counter deltas; returns the cause and a short clause.

    `rehost_host`: R's tokens the rehost took from host, when tier evidence says.
    """
    facts = record.server or ServerFacts()
    cold, pressure, rehost = (record.step(p) for p in (Phase.COLD, Phase.PRESSURE, Phase.REHOST))
    r = cacheable_tokens(record)
    start = cold.before if cold else None
    planted = (pressure.before if pressure and pressure.before else None) or (cold.after if cold else None)
    end = (rehost.before if rehost else None) or (pressure.after if pressure else None)
    if start is None or end is None:
        return Cause.UNKNOWN, "SGLang counters were not available"
    known = known_counters(record)
    kv_cold = _labelled_delta(start, planted, "backup_tokens", "kv", known)
    kv_all = _labelled_delta(start, end, "backup_tokens", "kv", known)
    mamba_all = _labelled_delta(start, end, "backup_tokens", "mamba", known)
    length = cold.prompt_tokens if cold else record.context_tokens
    if (
        facts.write_policy in ("write_through", "write_through_selective")
        and facts.chunked_prefill_size
        and length > facts.chunked_prefill_size
        and kv_cold is not None
        and kv_cold < KV_BACKUP_SHARE * r
    ):
        return Cause.CHUNKED_PREFILL_NOT_BACKED_UP, (
            f"R ({length} tokens) is longer than chunked_prefill_size {facts.chunked_prefill_size} "
            f"and only {kv_cold:.0f} KV tokens were backed up after its cold prefill"
        )
    contexts = 1 + (record.pressure.chunks or 0)
    if (
        facts.hybrid_model
        and kv_all is not None
        and mamba_all is not None
        and kv_all >= KV_BACKUP_SHARE * r
        and mamba_all < max(1.0, MAMBA_BACKUP_SHARE * contexts)
    ):
        return Cause.MAMBA_STATE_NOT_BACKED_UP, (
            f"{kv_all:.0f} KV tokens but only {mamba_all:.0f} Mamba states were backed up "
            f"for {contexts} inserted contexts"
        )
    dropped = _host_pressure_drops(start, end)
    mamba_full = (
        end.host_mamba_used_states is not None
        and end.host_mamba_total_states
        and end.host_mamba_used_states >= end.host_mamba_total_states
    )
    if (dropped or 0) > 0 or mamba_full:
        what = (
            f"{dropped:.0f} tokens were dropped without host backup (reason host_pressure)" if (dropped or 0) > 0
            else f"the host Mamba pool was full ({end.host_mamba_used_states:.0f}/{end.host_mamba_total_states:.0f} states)"
        )
        return Cause.HOST_POOL_PRESSURE, what
    host_free = None if end.host_total_tokens is None or end.host_used_tokens is None else end.host_total_tokens - end.host_used_tokens
    if rehost_host and host_free is not None and host_free < r:
        # Part of R came back, the rest was gone from a host pool with no room left for R: the host
        # tier evicted it. What 0.5.17 exports (no drop or backup counters) is enough to say so.
        return Cause.HOST_POOL_PRESSURE, (
            f"the host pool was full when R was re-sent ({end.host_used_tokens:.0f} of {end.host_total_tokens:.0f} tokens, "
            f"{host_free:.0f} free, less than R's {r}), and only part of R came back from host"
        )
    device = end.max_total_num_tokens or facts.max_total_num_tokens
    if end.host_total_tokens and device and end.host_total_tokens < device + r:
        # Evicting R from the device takes about a device pool of newer contexts, and each of them is
        # backed up (write_through at insert, write_back at eviction): a host pool smaller than that
        # plus R has pushed R out of host by the time R comes back, for any workload, not just ours.
        return Cause.HOST_POOL_PRESSURE, (
            f"the host pool ({end.host_total_tokens:.0f} tokens) holds less than the device pool ({device:.0f}) plus R ({r}): "
            f"whatever evicts R from the device also pushes it out of host (raise --hicache-ratio or --hicache-size)"
        )
    if kv_all is None or (mamba_all is None and facts.hybrid_model):
        return Cause.UNKNOWN, "this server exports no hicache_backup_tokens_total to tell why"
    load_back = _labelled_delta(rehost.before, rehost.after, "load_back_tokens", "kv", known | {"load_back_tokens"}) if rehost else None
    if load_back is None and rehost is not None and rehost.before and rehost.after:
        load_back = _delta(_sum(rehost.before.load_back_tokens) or 0.0, _sum(rehost.after.load_back_tokens) or 0.0)
    if kv_all >= KV_BACKUP_SHARE * r and (load_back or 0) == 0:
        return Cause.LOAD_BACK_SKIPPED, f"{kv_all:.0f} KV tokens were backed up, nothing was dropped, yet nothing was loaded back"
    return Cause.UNKNOWN, "the counters show no known failure pattern"


def _host_pressure_drops(start: CounterSnapshot, end: CounterSnapshot) -> float | None:
    """Growth of hicache_dropped_tokens_total{reason="host_pressure"} (all reasons if unlabelled)."""
    def value(snap: CounterSnapshot) -> float:
        d = snap.dropped_tokens or {}
        return d.get("host_pressure", 0.0) if any(k for k in d) else sum(d.values())
    if start.dropped_tokens is None and end.dropped_tokens is None:
        return None
    return _delta(value(start), value(end))


def _any_snapshot_value(record: ProbeRecord, attr: str) -> float | None:
    for step in reversed(record.steps):
        for snap in (step.after, step.before):
            if snap is not None and getattr(snap, attr):
                return getattr(snap, attr)
    return None


def own_mamba_pressure(record: ProbeRecord) -> Decision | None:
    """The guard (module docstring): did the probe's own filler push R's state out of the host Mamba pool?

    None when it cannot have; else the decision to give instead of a plain `silent`.
    """
    facts = record.server or ServerFacts()
    states = _any_snapshot_value(record, "host_mamba_total_states")
    contexts = record.pressure.chunks or 0
    if not facts.hybrid_model or not states:
        return None
    pressure, rehost = record.step(Phase.PRESSURE), record.step(Phase.REHOST)
    planted = pressure.before if pressure else None
    end = (rehost.before if rehost else None) or (pressure.after if pressure else None)
    # States backed up after R, whoever's: under write_back the filler's evictions of the server's own
    # small contexts back up one state each, too. Without the counter, our filler requests.
    backed = _labelled_delta(planted, end, "backup_tokens", "mamba", known_counters(record))
    if (backed if backed is not None else contexts) < states:
        return None  # fewer states reached host than it holds: none of R's can have been pushed out
    cold = record.step(Phase.COLD)
    length = (cold.prompt_tokens if cold and cold.prompt_tokens else record.context_tokens) or 1
    host_total = _any_snapshot_value(record, "host_total_tokens")
    held = host_total / length if host_total else 0.0
    device = _any_snapshot_value(record, "max_total_num_tokens") or facts.max_total_num_tokens
    # ... and R-sized traffic that pushes R off the device backs up at least `states` states on the way
    # (write_through backs each context up at insert), so the loss is the server's, not the probe's.
    device_held = device / length if device else float("inf")
    if held >= MAMBA_POOL_OUTGROWN * states and device_held >= states:
        return Decision(
            Verdict.SILENT,
            cause=Cause.HOST_POOL_PRESSURE,
            evidence=(
                f"the host KV pool holds {held:.0f} contexts of R's {length} tokens but the host Mamba pool only "
                f"{states:.0f} states: every context backed up after R pushes a state out, so host KV of R-sized "
                f"contexts is dead memory (size the host Mamba pool up)"
            ),
        )
    return Decision(
        Verdict.INCONCLUSIVE,
        evidence=(
            f"{backed if backed is not None else contexts:.0f} Mamba states were backed up after R (the probe sent "
            f"{contexts} filler requests, the rest is the server's traffic), as many as the host Mamba pool holds "
            f"({states:.0f}), so the probe's pressure may have pushed R's state out of host; raise context_tokens or "
            f"pressure_chunk_tokens so fewer, larger requests evict R"
        ),
    )


def _evicted_between(again: StepRecord, r: int) -> bool:
    """A busy server may evict R again between rehost and again; then a missed again proves nothing."""
    if again.before is None or again.after is None or again.after.evicted_tokens is None:
        return False
    return (again.after.evicted_tokens - (again.before.evicted_tokens or 0.0)) >= r


def decide(record: ProbeRecord, settings: ProbeSettings | None = None) -> Decision:
    """The verdict for a finished (or aborted) probe record; see the module docstring for the rules.

    `settings` supplies `host_hit_threshold` and `min_cold_latency_s` (defaults: ProbeSettings').
    """
    settings = settings or ProbeSettings(target=record.target)
    if record.reason is not None:
        return Decision(Verdict.ERROR, reason=record.reason, evidence=record.evidence or f"probe failed: {record.reason.value}")
    if record.verdict in (Verdict.SKIPPED_BUSY, Verdict.SKIPPED_BUDGET):
        return Decision(record.verdict, evidence=record.evidence)
    if record.server is not None and not record.server.enable_hierarchical_cache:
        return Decision(Verdict.HICACHE_DISABLED, evidence="the server runs without --enable-hierarchical-cache; no tokens were sent")
    cold, rehost, again = (record.step(p) for p in (Phase.COLD, Phase.REHOST, Phase.AGAIN))
    if cold is None or rehost is None or again is None or cold.latency_s is None or rehost.latency_s is None:
        return Decision(Verdict.ERROR, reason=ErrorReason.INTERNAL, evidence="the probe stopped before R was re-sent")
    ratio = rehost.latency_s / cold.latency_s if cold.latency_s > 0 else None
    r = cacheable_tokens(record)
    lat = f"rehost {rehost.latency_s:.2f} s vs cold {cold.latency_s:.2f} s"
    base = dict(rehost_cold_ratio=ratio)

    if rehost.cached is not None:
        again_dev = again.cached.device if again.cached is not None and not _evicted_between(again, r) else None
        return _from_shares(record, settings, r, rehost.cached.device, rehost.cached.host, again_dev, "per-request cached tokens", lat, base, True)
    known = known_counters(record)
    tiers, again_tiers = counter_tiers(rehost, known), counter_tiers(again, known)
    if tiers is not None:
        again_dev = again_tiers.device if again_tiers and not _evicted_between(again, r) else None
        return _from_shares(record, settings, r, tiers.device, tiers.host, again_dev, tiers.source, lat, base, False)
    return _from_latency(record, settings, cold, rehost, again, ratio, lat, base)


def _from_shares(record, settings, r, dev, host, again_dev, source, lat, base, details: bool) -> Decision:
    # Counter deltas cover every request in the window (a busy server's own host hits land there
    # too) and R's cacheable part may be a page short of its length: R cannot have loaded more than R.
    host = min(host, float(r))
    host_frac = host / r if r else 0.0
    base = dict(base, host_fraction=host_frac)
    if again_dev is not None and again_dev < DEVICE_SHARE_AGAIN_OK * r:
        return Decision(
            Verdict.DEVICE_CACHE_BROKEN,
            evidence=f"R's third send hit only {again_dev:.0f} of {r} tokens on device ({source}), so the device prefix cache itself is not reusing R",
            **base,
        )
    if dev is not None and dev >= DEVICE_SHARE_NOT_EVICTED * r:
        return Decision(
            Verdict.NOT_EVICTED,
            evidence=f"rehost still hit {dev:.0f} of {r} tokens on device ({source}): pressure of {record.pressure.synthetic_tokens + record.pressure.passive_tokens} tokens did not evict R",
            **base,
        )
    threshold = settings.host_hit_threshold
    if host_frac >= threshold:
        partial = "" if host_frac >= 0.999 else f" (a partial hit, threshold {_pct(threshold)})"
        return Decision(
            Verdict.REUSED,
            evidence=f"rehost loaded {host:.0f} of {r} tokens ({_pct(host_frac)}) from host{partial} ({source}); {lat}",
            **base,
        )
    if not details and not eviction_confirmed(record):
        return Decision(
            Verdict.NOT_EVICTED,
            evidence=f"eviction of R was not confirmed by evicted_tokens_total and {source} shows {host:.0f} host tokens; no verdict on HiCache",
            **base,
        )
    cause, why = suspect_cause(record, host)
    guard = None if cause in SPECIFIC_CAUSES else own_mamba_pressure(record)
    if guard is not None:
        return Decision(guard.verdict, cause=guard.cause, evidence=f"rehost took {host:.0f} of {r} tokens from host ({source}); {guard.evidence}", **base)
    return Decision(
        Verdict.SILENT,
        cause=cause,
        evidence=f"R was evicted but rehost took only {host:.0f} of {r} tokens ({_pct(host_frac)}) from host ({source}); {lat}; {why}",
        **base,
    )


def _from_latency(record, settings, cold, rehost, again, ratio, lat, base) -> Decision:
    min_cold = settings.min_cold_latency_s
    if not eviction_confirmed(record):
        return Decision(Verdict.NOT_EVICTED, evidence=f"no tier details or host counters, and eviction of R was not confirmed; {lat}", **base)
    again_ratio = (again.latency_s / cold.latency_s) if again.latency_s is not None and cold.latency_s else None
    if cold.latency_s < min_cold or again_ratio is None or again_ratio >= AGAIN_VISIBLE_RATIO:
        return Decision(
            Verdict.INCONCLUSIVE,
            evidence=(
                f"only latency is available and it cannot tell: cold {cold.latency_s:.2f} s (needs >= {min_cold:.1f} s), "
                f"again {again.latency_s if again.latency_s is not None else float('nan'):.2f} s"
            ),
            **base,
        )
    if ratio > LATENCY_SILENT_RATIO:
        cause, why = suspect_cause(record)
        guard = None if cause in SPECIFIC_CAUSES else own_mamba_pressure(record)
        if guard is not None:
            return Decision(guard.verdict, cause=guard.cause, evidence=f"latency only: {lat}; {guard.evidence}", **base)
        return Decision(Verdict.SILENT, cause=cause, evidence=f"latency only: {lat} (ratio {ratio:.2f} > {LATENCY_SILENT_RATIO}); {why}", **base)
    if ratio < LATENCY_REUSED_RATIO:
        return Decision(Verdict.REUSED, evidence=f"latency only: {lat} (ratio {ratio:.2f} < {LATENCY_REUSED_RATIO})", **base)
    return Decision(Verdict.INCONCLUSIVE, evidence=f"latency only: {lat} (ratio {ratio:.2f}, between {LATENCY_REUSED_RATIO} and {LATENCY_SILENT_RATIO})", **base)

