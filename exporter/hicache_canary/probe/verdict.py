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

The suspected cause of `silent` and the guard against the probe's own filler are in causes.py;
what the record says (R's length, counter deltas, tier counts) in evidence.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_canary.probe.causes import SPECIFIC_CAUSES, own_mamba_pressure, suspect_cause
from hicache_canary.probe.evidence import Decision, cacheable_tokens, counter_tiers, evicted_between, eviction_confirmed, known_counters
from hicache_canary.models import ErrorReason, Phase, ProbeRecord, ProbeSettings, Verdict

__all__ = ["Decision", "decide"]

DEVICE_SHARE_NOT_EVICTED = 0.5  # rehost device share at/above this: R never left the device
DEVICE_SHARE_AGAIN_OK = 0.5  # again device share below this: the device cache itself is broken
LATENCY_SILENT_RATIO = 0.7
LATENCY_REUSED_RATIO = 0.3
AGAIN_VISIBLE_RATIO = 0.3  # again/cold below this proves prefill cost shows in latency


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


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
        again_dev = again.cached.device if again.cached is not None and not evicted_between(again, r) else None
        shares = Shares(r, rehost.cached.device, rehost.cached.host, again_dev, "per-request cached tokens", details=True)
        return _from_shares(record, settings, shares, lat, base)
    known = known_counters(record)
    tiers, again_tiers = counter_tiers(rehost, known), counter_tiers(again, known)
    if tiers is not None:
        again_dev = again_tiers.device if again_tiers and not evicted_between(again, r) else None
        shares = Shares(r, tiers.device, tiers.host, again_dev, tiers.source, details=False)
        return _from_shares(record, settings, shares, lat, base)
    return _from_latency(record, settings, cold, rehost, again, ratio, lat, base)


@dataclass(frozen=True)
class Shares:
    """The tier evidence of R's rehost (and again) request, from one source."""

    r: int  # R's cacheable tokens
    device: float | None  # of R, the rehost took from device (None: the source does not say)
    host: float  # ... and from host
    again_device: float | None  # the again request took from device (None: unknown or void)
    source: str  # where the numbers come from, named in the evidence
    details: bool  # per-request tier details (they prove R left the device) rather than counter deltas


def _from_shares(record: ProbeRecord, settings: ProbeSettings, shares: Shares, lat: str, base: dict) -> Decision:
    r, dev, again_dev, source = shares.r, shares.device, shares.again_device, shares.source
    # Counter deltas cover every request in the window (a busy server's own host hits land there
    # too) and R's cacheable part may be a page short of its length: R cannot have loaded more than R.
    host = min(shares.host, float(r))
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
    if not shares.details and not eviction_confirmed(record):
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

