"""Table tests for verdict.decide: one hand-built probe record per rule, readable ids."""

from __future__ import annotations

import re

import pytest

from hicache_canary.models import (
    CachedTokens,
    Cause,
    CounterSnapshot,
    ErrorReason,
    Phase,
    PressureRecord,
    ProbeRecord,
    ProbeSettings,
    ServerFacts,
    StepRecord,
    Verdict,
)
from hicache_canary.probe.verdict import decide

L = 40_000
R = 39_999  # cacheable: page 1, all but the last token
WT = ServerFacts(enable_hierarchical_cache=True, write_policy="write_through", chunked_prefill_size=4096, hybrid_model=True, max_total_num_tokens=400_000)
WB = ServerFacts(enable_hierarchical_cache=True, write_policy="write_back", chunked_prefill_size=4096, hybrid_model=True, max_total_num_tokens=400_000)


def snap(**kw) -> CounterSnapshot:
    fams = set(kw.pop("fams", ()))
    for k in ("backup_tokens", "load_back_tokens", "cached_tokens", "prefill_effective_tokens", "dropped_tokens"):
        if kw.get(k) is not None:
            fams.add({"backup_tokens": "hicache_backup_tokens_total", "load_back_tokens": "load_back_tokens_total",
                      "cached_tokens": "cached_tokens_total", "prefill_effective_tokens": "prefill_effective_tokens_total",
                      "dropped_tokens": "hicache_dropped_tokens_total"}[k])
    return CounterSnapshot(families=frozenset(fams), **kw)


def record(
    facts=WT,
    *,
    lat=(15.4, 15.5, 0.1),
    rehost=None,
    again=CachedTokens(device=R),
    snaps=None,
    confirmed=True,
    chunks=10,
) -> ProbeRecord:
    """A probe record: snaps = (before cold, after cold/planted, before rehost, after rehost, after again)."""
    s = snaps or [None] * 5
    rec = ProbeRecord(target="t", started_at=0.0, context_tokens=L, server=facts)
    rec.steps = [
        StepRecord(Phase.COLD, latency_s=lat[0], prompt_tokens=L, requests=1, cached=CachedTokens(), before=s[0], after=s[1]),
        StepRecord(Phase.PRESSURE, prompt_tokens=chunks * 4096, requests=chunks, before=s[1], after=s[2]),
        StepRecord(Phase.REHOST, latency_s=lat[1], prompt_tokens=L, requests=1, cached=rehost, before=s[2], after=s[3]),
        StepRecord(Phase.AGAIN, latency_s=lat[2], prompt_tokens=L, requests=1, cached=again, before=s[3], after=s[4]),
    ]
    rec.pressure = PressureRecord(planned_tokens=chunks * 4096, synthetic_tokens=chunks * 4096, chunks=chunks, eviction_confirmed=confirmed)
    return rec


def counters(kv=(0, 0, 0), mamba=(0, 0, 0), dropped=(0, 0), host=(100, 1_000_000), mamba_host=(1, 30), load_back=(0, 0)):
    """Five snapshots with backup counters: kv/mamba at (start, planted, before rehost); load_back over rehost."""
    def mk(i):
        k = kv[min(i, 2)]
        m = mamba[min(i, 2)]
        return snap(
            backup_tokens={"kv": k, "mamba": m},
            dropped_tokens={"host_pressure": dropped[0 if i < 2 else 1]},
            host_used_tokens=host[0], host_total_tokens=host[1],
            host_mamba_used_states=mamba_host[0], host_mamba_total_states=mamba_host[1],
            load_back_tokens={"kv": load_back[0 if i < 3 else 1]},
            evicted_tokens=1000.0 * i,
        )
    return [mk(i) for i in range(5)]


def tiered(host_rehost=0.0, dev_rehost=0.0, dev_again=float(R), source="cached_tokens"):
    """Counter-only snapshots (no per-request details): tier deltas over rehost and again."""
    def mk(h, d):
        if source == "cached_tokens":
            return snap(cached_tokens={"host": h, "device": d}, evicted_tokens=0.0)
        return snap(prefill_effective_tokens={"host_hit": h, "device_hit": d, "input": 0.0}, evicted_tokens=0.0)
    return [mk(0, 0), mk(0, 0), mk(0, 0), mk(host_rehost, dev_rehost), mk(host_rehost, dev_rehost + dev_again)]


CASES = [
    # --- tier details first ---
    pytest.param(record(WB, lat=(15.4, 0.4, 0.1), rehost=CachedTokens(host=R)), Verdict.REUSED, Cause.NONE, "from host", id="details-full-host-hit-reused"),
    pytest.param(record(WB, rehost=CachedTokens(host=int(R * 0.77))), Verdict.REUSED, Cause.NONE, "partial hit", id="details-partial-host-hit-above-threshold-reused-with-fraction"),
    pytest.param(record(WB, rehost=CachedTokens(host=int(R * 0.3))), Verdict.SILENT, Cause.UNKNOWN, "30%", id="details-partial-host-hit-below-threshold-silent"),
    pytest.param(record(rehost=CachedTokens(device=R)), Verdict.NOT_EVICTED, Cause.NONE, "did not evict", id="details-rehost-from-device-not-evicted"),
    pytest.param(record(rehost=CachedTokens(), again=CachedTokens()), Verdict.DEVICE_CACHE_BROKEN, Cause.NONE, "device", id="details-again-missed-device-cache-broken"),
    pytest.param(record(rehost=CachedTokens(host=R), again=CachedTokens(), snaps=[snap(evicted_tokens=v) for v in (0.0, 0, 0, 50_000, 100_000)]), Verdict.REUSED, Cause.NONE, "from host", id="details-again-missed-after-a-busy-server-evicted-R-again-is-void"),
    pytest.param(record(rehost=CachedTokens(), confirmed=False), Verdict.SILENT, Cause.UNKNOWN, "evicted", id="details-prove-eviction-even-if-counters-did-not"),
    # --- suspected causes from counter deltas ---
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, 0, 40_000))), Verdict.SILENT, Cause.CHUNKED_PREFILL_NOT_BACKED_UP, "chunked_prefill_size 4096", id="cause-write-through-long-R-not-backed-up-chunked"),
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 11), dropped=(0, 5000))), Verdict.SILENT, Cause.HOST_POOL_PRESSURE, "dropped", id="cause-dropped-tokens-host-pressure"),
    # 0.5.17 exports no drop or backup counter: a full host pool and a partial host hit say it (live, small host pool).
    pytest.param(record(rehost=CachedTokens(host=int(R * 0.43)), snaps=[snap(host_used_tokens=46_336.0, host_total_tokens=48_001.0, evicted_tokens=1000.0 * i) for i in range(5)]), Verdict.SILENT, Cause.HOST_POOL_PRESSURE, "1665 free", id="cause-0.5.17-host-pool-full-partial-host-hit-host-pressure"),
    pytest.param(record(rehost=CachedTokens(host=int(R * 0.43)), snaps=[snap(host_used_tokens=592_658.0, host_total_tokens=709_577.0, evicted_tokens=1000.0 * i) for i in range(5)]), Verdict.SILENT, Cause.UNKNOWN, "no hicache_backup_tokens_total", id="cause-0.5.17-host-pool-with-room-for-R-is-not-pressure"),
    pytest.param(record(rehost=CachedTokens(), snaps=[snap(host_used_tokens=30_000.0, host_total_tokens=48_001.0, max_total_num_tokens=40_000.0, evicted_tokens=1000.0 * i) for i in range(5)]), Verdict.SILENT, Cause.HOST_POOL_PRESSURE, "holds less than the device pool", id="cause-host-pool-smaller-than-device-plus-R-host-pressure"),
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 11), mamba_host=(30, 30))), Verdict.SILENT, Cause.HOST_POOL_PRESSURE, "Mamba pool was full", id="cause-host-mamba-pool-full-host-pressure"),
    # A full host KV pool is normal under write_through (the report's filled to 592,658/709,577): not a cause alone.
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), host=(990_000, 1_000_000), mamba=(0, 1, 11))), Verdict.SILENT, Cause.LOAD_BACK_SKIPPED, "nothing was loaded back", id="cause-host-kv-pool-full-alone-is-not-pressure"),
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), host=(990, 1000), mamba=(0, 0, 0))), Verdict.SILENT, Cause.MAMBA_STATE_NOT_BACKED_UP, "0 Mamba states", id="cause-mamba-missing-wins-over-a-full-host-kv-pool"),
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), mamba=(0, 0, 0), mamba_host=(30, 30))), Verdict.SILENT, Cause.MAMBA_STATE_NOT_BACKED_UP, "0 Mamba states", id="cause-mamba-missing-wins-over-a-full-mamba-pool"),
    # The probe's own filler: as many contexts after R as the host Mamba pool has states, each backed up.
    pytest.param(record(rehost=CachedTokens(), chunks=30, snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 31), mamba_host=(30, 30))), Verdict.INCONCLUSIVE, Cause.NONE, "context_tokens", id="guard-probe-filled-the-host-mamba-pool-itself-inconclusive"),
    pytest.param(record(rehost=CachedTokens(), chunks=30, snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 31), mamba_host=(4, 4), host=(100, 3_000_000))), Verdict.SILENT, Cause.HOST_POOL_PRESSURE, "holds 75 contexts", id="guard-host-kv-far-outgrows-the-mamba-pool-silent-host-pressure"),
    # The device pool holds only 10 contexts of R's length: R-sized traffic would not fill 30 states before evicting R.
    pytest.param(record(rehost=CachedTokens(), chunks=30, snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 31), mamba_host=(30, 30), host=(100, 3_000_000))), Verdict.INCONCLUSIVE, Cause.NONE, "context_tokens", id="guard-mamba-pool-outgrown-only-on-host-still-inconclusive"),
    pytest.param(record(rehost=CachedTokens(), chunks=30, snaps=counters(kv=(0, R, 2 * R), mamba=(0, 0, 0), mamba_host=(30, 30))), Verdict.SILENT, Cause.MAMBA_STATE_NOT_BACKED_UP, "0 Mamba states", id="guard-void-when-no-mamba-state-was-backed-up"),
    # write_back: 3 filler requests evicted 40 of the server's own small contexts after R, each backing up a state.
    pytest.param(record(WB, rehost=CachedTokens(), chunks=3, snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 41), mamba_host=(30, 30))), Verdict.INCONCLUSIVE, Cause.NONE, "40 Mamba states", id="guard-counts-every-state-backed-up-after-R"),
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), mamba=(0, 0, 0))), Verdict.SILENT, Cause.MAMBA_STATE_NOT_BACKED_UP, "0 Mamba states", id="cause-kv-backed-up-mamba-not-mamba-state"),
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 11))), Verdict.SILENT, Cause.LOAD_BACK_SKIPPED, "nothing was loaded back", id="cause-everything-backed-up-no-load-back"),
    pytest.param(record(rehost=CachedTokens(), snaps=counters(kv=(0, R, 2 * R), mamba=(0, 1, 11), load_back=(0, 500))), Verdict.SILENT, Cause.UNKNOWN, "no known failure", id="cause-load-back-happened-yet-silent-unknown"),
    pytest.param(record(rehost=CachedTokens(), snaps=[snap(evicted_tokens=float(i)) for i in range(5)]), Verdict.SILENT, Cause.UNKNOWN, "no hicache_backup_tokens_total", id="cause-0.5.17-no-backup-counter-unknown"),
    # --- counters second (no per-request details) ---
    pytest.param(record(WB, rehost=None, again=None, snaps=tiered(host_rehost=R)), Verdict.REUSED, Cause.NONE, "cached_tokens_total", id="counters-cached-tokens-host-reused"),
    pytest.param(record(WB, rehost=None, again=None, snaps=tiered(host_rehost=R, source="prefill")), Verdict.REUSED, Cause.NONE, "prefill_effective", id="counters-prefill-effective-host-hit-reused"),
    pytest.param(record(rehost=None, again=None, snaps=tiered()), Verdict.SILENT, Cause.UNKNOWN, "0 of", id="counters-no-host-hit-evicted-silent"),
    # Issue 14: the counter window held more host hits than R's cacheable tokens (R's full length, or
    # another request's hit): said "loaded 40000 of 39999 tokens"; R cannot load more than R.
    pytest.param(record(WB, rehost=None, again=CachedTokens(device=R), snaps=tiered(host_rehost=L + 5000)), Verdict.REUSED, Cause.NONE,
                 f"rehost loaded {R} of {R} tokens (100%) from host", id="counters-host-count-above-R-is-capped-at-R"),
    pytest.param(record(rehost=None, again=None, snaps=tiered(), confirmed=False), Verdict.NOT_EVICTED, Cause.NONE, "not confirmed", id="counters-no-host-hit-eviction-unconfirmed-not-evicted"),
    pytest.param(record(rehost=None, again=None, snaps=tiered(dev_rehost=R)), Verdict.NOT_EVICTED, Cause.NONE, "on device", id="counters-device-hit-on-rehost-not-evicted"),
    pytest.param(record(rehost=None, again=None, snaps=tiered(dev_again=0)), Verdict.DEVICE_CACHE_BROKEN, Cause.NONE, "third send", id="counters-again-no-device-hit-broken"),
    # --- latency last ---
    pytest.param(record(rehost=None, again=None), Verdict.SILENT, Cause.UNKNOWN, "latency only", id="latency-long-cold-rehost-like-cold-silent"),
    pytest.param(record(WB, lat=(15.4, 0.4, 0.1), rehost=None, again=None), Verdict.REUSED, Cause.NONE, "latency only", id="latency-long-cold-rehost-fast-reused"),
    pytest.param(record(rehost=None, again=None, lat=(15.4, 7.0, 0.1)), Verdict.INCONCLUSIVE, Cause.NONE, "between", id="latency-ratio-in-the-middle-inconclusive"),
    pytest.param(record(rehost=None, again=None, lat=(0.084, 0.167, 0.031)), Verdict.INCONCLUSIVE, Cause.NONE, "cannot tell", id="latency-short-cold-never-silent-0.5.17-live"),
    pytest.param(record(rehost=None, again=None, lat=(15.4, 15.5, 15.3)), Verdict.INCONCLUSIVE, Cause.NONE, "cannot tell", id="latency-again-as-slow-as-cold-prefill-cost-invisible"),
    pytest.param(record(rehost=None, again=None, confirmed=False), Verdict.NOT_EVICTED, Cause.NONE, "not confirmed", id="latency-eviction-unconfirmed-not-evicted-never-silent"),
]


@pytest.mark.parametrize("rec, verdict, cause, phrase", CASES)
def test_decide(rec: ProbeRecord, verdict: Verdict, cause: Cause, phrase: str) -> None:
    d = decide(rec)
    assert (d.verdict, d.cause) == (verdict, cause), d.evidence
    assert phrase in d.evidence
    assert d.evidence.count("\n") == 0
    # never more of R than R, never above 100%
    for got, of in re.findall(r"(\d+) of (\d+) tokens", d.evidence):
        assert int(got) <= int(of), d.evidence
    assert all(int(p) <= 100 for p in re.findall(r"(\d+)%", d.evidence)), d.evidence
    assert d.host_fraction is None or 0.0 <= d.host_fraction <= 1.0


def test_partial_hit_reports_fraction_and_threshold_is_a_setting() -> None:
    rec = record(WB, rehost=CachedTokens(host=int(R * 0.6)))
    assert "60%" in decide(rec).evidence
    assert decide(rec).host_fraction == pytest.approx(0.6, abs=0.001)
    strict = ProbeSettings(target="t", host_hit_threshold=0.9)
    assert decide(rec, strict).verdict == Verdict.SILENT


def test_min_cold_latency_is_a_setting() -> None:
    rec = record(rehost=None, again=None, lat=(0.8, 0.79, 0.01))
    assert decide(rec).verdict == Verdict.INCONCLUSIVE
    assert decide(rec, ProbeSettings(target="t", min_cold_latency_s=0.5)).verdict == Verdict.SILENT


@pytest.mark.parametrize(
    "mutate, verdict",
    [
        pytest.param(lambda r: setattr(r, "reason", ErrorReason.TIMEOUT), Verdict.ERROR, id="error-reason-wins"),
        pytest.param(lambda r: setattr(r, "server", ServerFacts(enable_hierarchical_cache=False)), Verdict.HICACHE_DISABLED, id="hicache-off"),
        pytest.param(lambda r: setattr(r, "verdict", Verdict.SKIPPED_BUSY), Verdict.SKIPPED_BUSY, id="skipped-busy-passes-through"),
        pytest.param(lambda r: r.steps.pop(), Verdict.ERROR, id="missing-again-step-is-an-internal-error"),
    ],
)
def test_preflight_outcomes(mutate, verdict) -> None:
    rec = record(rehost=CachedTokens(host=R))
    mutate(rec)
    assert decide(rec).verdict == verdict


def test_ratio_is_reported() -> None:
    d = decide(record(WB, lat=(15.4, 0.4, 0.1), rehost=CachedTokens(host=R)))
    assert d.rehost_cold_ratio == pytest.approx(0.4 / 15.4)
