"""Collector: every README metric, pre-created children, one-hot state sets, values from records."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.gc_collector import GCCollector

from hicache_canary.service.collector import CanaryCollector
from hicache_canary.settings.config import load_settings
from hicache_canary.models import (
    CachedTokens,
    Cause,
    CounterSnapshot,
    ErrorReason,
    Phase,
    ProbeRecord,
    ServerFacts,
    StepRecord,
    Verdict,
)
from hicache_canary.service.config_reload import ReloadStatus
from hicache_canary.service.scheduler import Scheduler
from hicache_canary.service.target_state import fold, fresh

README = Path(__file__).resolve().parents[1] / "README.md"


LOADED = ReloadStatus(ok=True, success_at=1_700_000_000.0)


class Snapshots:
    """The scheduler's published state without its loops: each record is folded in by
    target_state.fold, as the scheduler does, and every change publishes a new mapping."""

    def __init__(self, targets):
        self.published = MappingProxyType({t.name: fresh(t) for t in targets})

    def __call__(self):
        return self.published

    def targets(self):
        return [s.target for s in self.published.values()]

    def add_target(self, t):
        self.published = MappingProxyType({**self.published, t.name: fresh(t)})

    def remove_target(self, name):
        self.published = MappingProxyType({n: s for n, s in self.published.items() if n != name})

    def apply(self, rec: ProbeRecord, up=None):
        s = self.published[rec.target]
        left = max(0, s.budget_remaining - rec.tokens_canary - rec.tokens_pressure)
        self.published = MappingProxyType({**self.published, rec.target: fold(s, rec, up, left)})


def collector(snaps) -> CanaryCollector:
    return CanaryCollector(snaps, lambda: LOADED)


def make():
    env = {"HICACHE_CANARY_TARGET_URL": "http://127.0.0.1:9", "HICACHE_CANARY_TARGET_NAME": "gpu-0"}
    snaps = Snapshots(load_settings(None, env).targets)
    reg = CollectorRegistry()
    reg.register(collector(snaps))
    return snaps, reg


def apply(snaps: Snapshots, rec: ProbeRecord, up=None):
    snaps.apply(rec, up)


def silent_record(started: float = 1000.0) -> ProbeRecord:
    r = ProbeRecord(target="gpu-0", started_at=started, finished_at=started + 20, context_tokens=16384,
                    server=ServerFacts(version="0.5.23", write_policy="write_through", enable_hierarchical_cache=True,
                                       hybrid_model=True, speculative_algorithm="EAGLE"))
    r.steps = [
        StepRecord(Phase.COLD, latency_s=15.4, prompt_tokens=16384, cached=CachedTokens(0, 0, 0),
                   before=CounterSnapshot(host_used_tokens=20221)),
        StepRecord(Phase.PRESSURE, prompt_tokens=40000, requests=5),
        StepRecord(Phase.REHOST, latency_s=15.5, prompt_tokens=16384, cached=CachedTokens(0, 0, 0),
                   after=CounterSnapshot(host_used_tokens=592658, host_total_tokens=709577)),
        StepRecord(Phase.AGAIN, latency_s=0.1, prompt_tokens=16384, cached=CachedTokens(16384, 0, 0)),
    ]
    r.pressure.synthetic_tokens = 40000
    r.pressure.passive_tokens = 1234
    r.verdict, r.cause, r.rehost_cold_ratio = Verdict.SILENT, Cause.MAMBA_STATE_NOT_BACKED_UP, 15.5 / 15.4
    return r


def readme_metrics() -> set[str]:
    table = README.read_text().split("## Exported metrics", 1)[1]
    names = set()
    for cell in re.findall(r"^\| `([^`]+)`(?: / `([^`]+)`)? \|", table, flags=re.M):
        first, second = cell
        names.add(first)
        if second:  # "`..._used_tokens` / `..._total_tokens`" shorthand
            names.add(first.replace("_used_tokens", second[3:]) if second.startswith("...") else second)
    return names


def exposed_names(reg) -> set[str]:
    return {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(generate_latest(reg).decode())}


def test_every_readme_metric_is_exposed_after_a_probe_and_nothing_else():
    sched, reg = make()
    apply(sched, silent_record())
    expected = readme_metrics()
    assert "hicache_canary_host_pool_total_tokens" in expected and len(expected) == 32
    assert exposed_names(reg) == expected


def test_before_any_probe_counters_and_histograms_exist_at_zero_and_no_guesses():
    sched, reg = make()
    g = reg.get_sample_value
    for v in Verdict:
        assert g("hicache_canary_probes_total", {"target": "gpu-0", "verdict": v.value}) == 0
        assert g("hicache_canary_verdict", {"target": "gpu-0", "verdict": v.value}) == 0
    for r in ErrorReason:
        assert g("hicache_canary_probe_errors_total", {"target": "gpu-0", "reason": r.value}) == 0
    for p in ("cold", "rehost", "again"):
        assert g("hicache_canary_phase_latency_seconds_count", {"target": "gpu-0", "phase": p}) == 0
    assert g("hicache_canary_tokens_sent_total", {"target": "gpu-0", "kind": "pressure"}) == 0
    assert g("hicache_canary_passive_pressure_tokens_total", {"target": "gpu-0"}) == 0
    assert g("hicache_canary_watch_errors_total", {"target": "gpu-0"}) == 0
    assert g("hicache_canary_restarts_detected_total", {"target": "gpu-0"}) == 0
    assert g("hicache_canary_probe_in_progress", {"target": "gpu-0"}) == 0
    # HiCacheCanaryStale scales with each target's own interval, so it must be exported.
    assert g("hicache_canary_probe_interval_seconds", {"target": "gpu-0"}) > 0
    # unknown is absent, not 0 or NaN: a ratio or "down" we never measured would be a lie
    assert g("hicache_canary_rehost_cold_ratio", {"target": "gpu-0"}) is None
    assert g("hicache_canary_target_up", {"target": "gpu-0"}) is None
    assert g("hicache_canary_config_last_reload_successful") == 1


def test_silent_probe_values():
    sched, reg = make()
    apply(sched, silent_record())
    g = reg.get_sample_value
    t = {"target": "gpu-0"}
    assert g("hicache_canary_verdict", {**t, "verdict": "silent"}) == 1
    assert sum(g("hicache_canary_verdict", {**t, "verdict": v.value}) for v in Verdict) == 1
    assert g("hicache_canary_suspected_cause", {**t, "cause": "mamba_state_not_backed_up"}) == 1
    assert g("hicache_canary_suspected_cause", {**t, "cause": "none"}) == 0
    assert abs(g("hicache_canary_rehost_cold_ratio", t) - 1.00649) < 1e-4
    assert g("hicache_canary_last_phase_latency_seconds", {**t, "phase": "cold"}) == 15.4
    assert g("hicache_canary_rehost_cached_ratio", {**t, "tier": "host"}) == 0
    assert g("hicache_canary_last_cached_tokens", {**t, "phase": "again", "tier": "device"}) == 16384
    assert g("hicache_canary_host_pool_growth_tokens", t) == 592658 - 20221
    assert g("hicache_canary_host_pool_used_tokens", t) == 592658 and g("hicache_canary_host_pool_total_tokens", t) == 709577
    assert g("hicache_canary_last_probe_duration_seconds", t) == 20
    assert g("hicache_canary_last_conclusive_probe_timestamp_seconds", t) == 1020
    assert g("hicache_canary_tokens_sent_total", {**t, "kind": "canary"}) == 3 * 16384
    assert g("hicache_canary_tokens_sent_total", {**t, "kind": "pressure"}) == 40000
    assert g("hicache_canary_passive_pressure_tokens_total", t) == 1234
    assert g("hicache_canary_phase_latency_seconds_bucket", {**t, "phase": "cold", "le": "10.0"}) == 0
    assert g("hicache_canary_phase_latency_seconds_bucket", {**t, "phase": "cold", "le": "20.0"}) == 1
    assert g("hicache_canary_server_info", {**t, "version": "0.5.23", "write_policy": "write_through", "hicache": "true",
                                            "hybrid": "true", "speculative_algorithm": "EAGLE"}) == 1
    assert g("hicache_canary_target_up", t) == 1


def test_error_after_silent_keeps_the_measurement_and_sets_the_reason():
    sched, reg = make()
    apply(sched, silent_record())
    apply(sched, ProbeRecord(target="gpu-0", started_at=2000, finished_at=2001, verdict=Verdict.ERROR, reason=ErrorReason.TIMEOUT))
    g = reg.get_sample_value
    t = {"target": "gpu-0"}
    assert g("hicache_canary_verdict", {**t, "verdict": "error"}) == 1
    assert g("hicache_canary_last_error_reason", {**t, "reason": "timeout"}) == 1
    assert g("hicache_canary_probe_errors_total", {**t, "reason": "timeout"}) == 1
    # the cause and the alerting state follow the last conclusive probe, not the error
    assert g("hicache_canary_suspected_cause", {**t, "cause": "mamba_state_not_backed_up"}) == 1
    assert g("hicache_canary_suspected_cause", {**t, "cause": "none"}) == 0
    assert g("hicache_canary_last_conclusive_verdict", {**t, "verdict": "silent"}) == 1
    assert g("hicache_canary_verdict_streak", t) == 1
    assert g("hicache_canary_consecutive_errors", t) == 1 and g("hicache_canary_probes_since_conclusive", t) == 1
    assert g("hicache_canary_target_up", t) == 0
    assert abs(g("hicache_canary_rehost_cold_ratio", t) - 1.00649) < 1e-4  # "the last probe that got that far"
    assert g("hicache_canary_last_conclusive_probe_timestamp_seconds", t) == 1020
    assert g("hicache_canary_last_probe_timestamp_seconds", t) == 2001


def test_labels_stay_bounded_over_many_probes():
    sched, reg = make()
    for i in range(300):
        rec = silent_record(started=float(i))
        if i % 3 == 0:
            rec = ProbeRecord(target="gpu-0", started_at=i, finished_at=i + 1, verdict=Verdict.ERROR,
                              reason=list(ErrorReason)[i % len(ErrorReason)], evidence=f"unique text {i}")
        apply(sched, rec)
    samples = [s for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples]
    assert len(samples) < 250
    assert not any("unique text" in v for s in samples for v in s.labels.values())


def test_registers_with_the_standard_collectors_without_clashes():
    sched, alone = make()
    apply(sched, silent_record())
    reg = CollectorRegistry()
    for c in (collector(sched), ProcessCollector(registry=None), PlatformCollector(registry=None)):
        reg.register(c)
    GCCollector(registry=reg)
    text = generate_latest(reg).decode()
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))  # one family per name: no clash between the collectors
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "python_info", "python_gc_collections"} <= set(names)
    ours = [line for line in text.splitlines() if "hicache_canary_" in line]
    # the canary's lines are exactly those it renders alone: the standard collectors change nothing
    assert ours == [line for line in generate_latest(alone).decode().splitlines() if "hicache_canary_" in line]
    assert 'hicache_canary_verdict{target="gpu-0",verdict="silent"} 1.0' in ours


def test_describe_touches_no_state():
    def boom():
        raise AssertionError("describe() must not read snapshots")

    c = CanaryCollector(boom, lambda: LOADED)
    reg = CollectorRegistry(auto_describe=True)
    reg.register(c)  # would call collect() if describe() were missing
    described = list(c.describe())
    assert all(not f.samples for f in described)  # names and types only
    assert {f.name + ("_total" if f.type == "counter" else "") for f in described} == readme_metrics()


def test_fifty_targets_share_families_and_describe_matches_collect():
    sched, reg = make()
    from dataclasses import replace

    base = sched.targets()[0]
    for i in range(50):
        t = replace(base, name=f"t{i}", probe=replace(base.probe, target=f"t{i}"))
        sched.add_target(t)
        rec = silent_record()
        rec.target = t.name
        apply(sched, rec)
    c = collector(sched)
    fams = list(c.collect())
    assert [f.name for f in fams] == [f.name for f in c.describe()]
    verdict = next(f for f in fams if f.name == "hicache_canary_verdict")
    assert len({s.labels["target"] for s in verdict.samples}) == 51 and len(verdict.samples) == 51 * len(Verdict)


def test_alerting_state_counts_only_conclusive_verdicts():
    """silent, error, not_evicted, silent, then reused: what HiCacheSilent reads after each."""
    sched, reg = make()
    g = reg.get_sample_value
    t = {"target": "gpu-0"}
    for v in ("reused", "silent", "device_cache_broken", "hicache_disabled"):
        assert g("hicache_canary_last_conclusive_verdict", {**t, "verdict": v}) == 0  # before any probe: no guess
    assert g("hicache_canary_last_conclusive_verdict", {**t, "verdict": "error"}) is None  # closed set: conclusive only

    def state():
        hot = [v for v in ("reused", "silent", "device_cache_broken", "hicache_disabled")
               if g("hicache_canary_last_conclusive_verdict", {**t, "verdict": v}) == 1]
        cause = [c.value for c in Cause if g("hicache_canary_suspected_cause", {**t, "cause": c.value}) == 1]
        return (hot, g("hicache_canary_verdict_streak", t), cause, g("hicache_canary_probes_since_conclusive", t),
                g("hicache_canary_consecutive_errors", t))

    apply(sched, silent_record(1000))
    assert state() == (["silent"], 1, ["mamba_state_not_backed_up"], 0, 0)
    apply(sched, ProbeRecord(target="gpu-0", started_at=2000, finished_at=2001, verdict=Verdict.ERROR, reason=ErrorReason.SERVER_RESTARTED))
    assert state() == (["silent"], 1, ["mamba_state_not_backed_up"], 1, 1)
    apply(sched, ProbeRecord(target="gpu-0", started_at=3000, finished_at=3005, verdict=Verdict.NOT_EVICTED))
    assert state() == (["silent"], 1, ["mamba_state_not_backed_up"], 2, 0)
    apply(sched, silent_record(4000))
    assert state() == (["silent"], 2, ["mamba_state_not_backed_up"], 0, 0)
    assert g("hicache_canary_last_conclusive_probe_timestamp_seconds", t) == 4020
    reused = ProbeRecord(target="gpu-0", started_at=5000, finished_at=5010, verdict=Verdict.REUSED)
    apply(sched, reused)
    assert state() == (["reused"], 1, ["none"], 0, 0)


async def test_the_restart_watch_shows_down_errors_and_restarts_between_probes():
    from hicache_canary.probe.sglang_client import SGLangError

    texts = ['sglang:prompt_tokens_total{is_streaming="false"} 900\n', None, "", 'sglang:prompt_tokens_total{is_streaming="false"} 20\n']

    async def server(client):
        text = texts.pop(0)
        if text is None:
            raise SGLangError(ErrorReason.CONNECT_FAILED, "GET /metrics: connection refused")
        return text

    env = {"HICACHE_CANARY_TARGET_URL": "http://127.0.0.1:9", "HICACHE_CANARY_TARGET_NAME": "gpu-0"}
    sched = Scheduler(load_settings(None, env).targets, None, lambda t: None, watch_fn=server)
    reg = CollectorRegistry()
    reg.register(collector(sched.snapshot))
    g, t = reg.get_sample_value, {"target": "gpu-0"}
    seen = []
    for _ in range(4):
        await sched.watch_once("gpu-0")
        seen.append((g("hicache_canary_target_up", t), g("hicache_canary_watch_errors_total", t), g("hicache_canary_restarts_detected_total", t)))
    # up; down (an error); back with the children gone: one restart; counters growing again: nothing new
    assert seen == [(1, 0, 0), (0, 1, 0), (1, 1, 1), (1, 1, 1)]
