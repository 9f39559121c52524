"""The `/metrics` collector: every family built at scrape time from the scheduler's snapshots.

`collect()` only reads immutable snapshots (no IO, no await, no lock held while building), so a
scrape is fast while a probe runs and while a target is down. Names and labels follow the
"Exported metrics" table in README.md exactly; label values come only from closed sets
(models.Verdict, Cause, ErrorReason, Phase, Tier, the write policies) plus the configured target
name and SGLang's version and speculative algorithm, which must look like one (`server_info_labels`). Per-target
counters and histograms are emitted with zeros from the first scrape so `rate()` and
`absent()` behave.

Alerting state is conclusive-only: `last_conclusive_verdict` is the last verdict about HiCache
itself (reused, silent, device_cache_broken, hicache_disabled), `verdict_streak` counts the
consecutive conclusive verdicts equal to it, and `suspected_cause` is that probe's cause. A probe
cut short by a restart (error), one that could not evict R (not_evicted), an undecided one
(inconclusive) or a skip changes none of them, so HiCacheSilent neither resolves nor re-pages on
it; `consecutive_errors` and `probes_since_conclusive` say how long that has lasted. Examples
(a silent server whose last probe was cut short):

    hicache_canary_verdict{target="sglang-0",verdict="error"} 1
    hicache_canary_last_conclusive_verdict{target="sglang-0",verdict="silent"} 1
    hicache_canary_verdict_streak{target="sglang-0"} 2
    hicache_canary_rehost_cold_ratio{target="sglang-0"} 0.98
    hicache_canary_tokens_sent_total{target="sglang-0",kind="pressure"} 65536
    hicache_canary_server_info{target="sglang-0",version="0.5.23",write_policy="write_through",hicache="true",hybrid="true",speculative_algorithm="EAGLE"} 1
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

import time

from hicache_canary import __version__
from hicache_canary.service.config_reload import ReloadStatus
from hicache_canary.models import Cause, ErrorReason, Phase, ProbeRecord, ServerFacts, Tier, Verdict
from hicache_canary.shown import server_token
from hicache_canary.service.target_state import LATENCY_BUCKETS, LATENCY_PHASES, Histogram, TargetSnapshot

P = "hicache_canary_"
T = ["target"]
CONCLUSIVE = [v.value for v in Verdict if v.conclusive]


def _families() -> dict[str, Metric]:
    """Fresh, empty families (name -> family), in README order."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    return {
        "verdict": g(P + "verdict", "1 for the last probe's verdict, 0 for the others", labels=T + ["verdict"]),
        "conclusive": g(P + "last_conclusive_verdict", "1 for the last verdict about HiCache itself, 0 for the other conclusive verdicts", labels=T + ["verdict"]),
        "cause": g(P + "suspected_cause", "1 for the suspected cause of the last conclusive verdict if it was silent (none otherwise)", labels=T + ["cause"]),
        "reason": g(P + "last_error_reason", "1 for the reason of the last error verdict", labels=T + ["reason"]),
        "streak": g(P + "verdict_streak", "consecutive conclusive verdicts equal to the last conclusive one (other verdicts neither extend nor break it)", labels=T),
        "errors_in_row": g(P + "consecutive_errors", "probes in a row that ended in error (skips neither extend nor break the run)", labels=T),
        "since_conclusive": g(P + "probes_since_conclusive", "probes since the last conclusive verdict (skips not counted)", labels=T),
        "phase_latency": g(P + "last_phase_latency_seconds", "latency of R's request in the last probe", labels=T + ["phase"]),
        "ratio": g(P + "rehost_cold_ratio", "rehost latency / cold latency of the last probe that got that far", labels=T),
        "cached_ratio": g(P + "rehost_cached_ratio", "share of R's prompt served from each tier on rehost", labels=T + ["tier"]),
        "cached_tokens": g(P + "last_cached_tokens", "cached tokens reported by SGLang for R in each phase, by tier", labels=T + ["phase", "tier"]),
        "growth": g(P + "host_pool_growth_tokens", "change of sglang:hicache_host_used_tokens from before cold to after rehost", labels=T),
        "last_ts": g(P + "last_probe_timestamp_seconds", "when the last probe (any verdict) finished", labels=T),
        "conclusive_ts": g(P + "last_conclusive_probe_timestamp_seconds", "when the last probe with a verdict about HiCache finished", labels=T),
        "duration": g(P + "last_probe_duration_seconds", "wall time of the last probe", labels=T),
        "in_progress": g(P + "probe_in_progress", "1 while a probe runs", labels=T),
        "interval": g(P + "probe_interval_seconds", "the configured probe interval (staleness alerts scale with it)", labels=T),
        "up": g(P + "target_up", "1 when the last contact with the server (restart watch, preflight or probe) succeeded", labels=T),
        "probes": c(P + "probes_total", "probes by verdict", labels=T + ["verdict"]),
        "errors": c(P + "probe_errors_total", "probes that ended in error, by reason", labels=T + ["reason"]),
        "latency_hist": HistogramMetricFamily(P + "phase_latency_seconds", "R's latency per phase over all probes", labels=T + ["phase"]),
        "tokens": c(P + "tokens_sent_total", "prompt tokens the canary sent", labels=T + ["kind"]),
        "passive": c(P + "passive_pressure_tokens_total", "device-pool turnover credited to the server's own traffic instead of filler", labels=T),
        "watch_errors": c(P + "watch_errors_total", "restart-watch polls of the server's /metrics that failed", labels=T),
        "restarts": c(P + "restarts_detected_total", "server restarts the watch noticed between probes", labels=T),
        "budget": g(P + "budget_remaining_tokens", "what is left of the target's hourly token budget", labels=T),
        "server_info": g(
            P + "server_info",
            "configuration read from /server_info (config lint)",
            labels=T + ["version", "write_policy", "hicache", "hybrid", "speculative_algorithm"],
        ),
        "host_used": g(P + "host_pool_used_tokens", "SGLang's host pool used tokens at the end of the last probe", labels=T),
        "host_total": g(P + "host_pool_total_tokens", "SGLang's host pool size in tokens at the end of the last probe", labels=T),
        "reload": g(P + "config_last_reload_successful", "1 when the last config load (start or SIGHUP) succeeded"),
        "reload_at": g(P + "config_last_reload_success_timestamp_seconds", "when the config in use was loaded"),
        "build": g(P + "build_info", "1; the exporter's version", labels=["version"]),
    }


def _one_hot(fam: GaugeMetricFamily, name: str, values: list[str], current: str | None) -> None:
    for v in values:
        fam.add_metric([name, v], 1.0 if v == current else 0.0)


def _bool(v: bool) -> str:
    return "true" if v else "false"


# What SGLang's own server_args accept; any other policy a server reports becomes "other".
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def server_info_labels(f: ServerFacts) -> list[str]:
    """version, write_policy, hicache, hybrid, speculative_algorithm: bounded whatever the server sent.

    One series per target whatever the values, so the risk is their size and characters, not their
    number: version and speculative_algorithm must look like a name (shown.server_token: at most 64
    of [0-9A-Za-z.+_-], else "unrecognised"; a new algorithm such as DFLASH keeps its name);
    write_policy is a closed set.
    """
    policy = f.write_policy if f.write_policy in WRITE_POLICIES else ("unknown" if f.write_policy is None else "other")
    spec = server_token(f.speculative_algorithm) or "none"
    return [server_token(f.version) or "unknown", policy, _bool(f.enable_hierarchical_cache), _bool(f.hybrid_model), spec]


def _measured(fams: dict[str, Metric], name: str, rec: ProbeRecord) -> None:
    """Series from the last probe that timed R: latencies, ratios, tiers, host growth."""
    for phase in LATENCY_PHASES:
        step = rec.step(phase)
        if step is None:
            continue
        if step.latency_s is not None:
            fams["phase_latency"].add_metric([name, phase.value], step.latency_s)
        if step.cached is not None:
            for tier in Tier:
                fams["cached_tokens"].add_metric([name, phase.value, tier.value], float(getattr(step.cached, tier.value)))
    if rec.rehost_cold_ratio is not None:
        fams["ratio"].add_metric([name], rec.rehost_cold_ratio)
    rehost = rec.step(Phase.REHOST)
    if rehost is not None and rehost.cached is not None and rehost.prompt_tokens > 0:
        for tier in Tier:
            fams["cached_ratio"].add_metric([name, tier.value], getattr(rehost.cached, tier.value) / rehost.prompt_tokens)
    cold = rec.step(Phase.COLD)
    before = cold.before.host_used_tokens if cold and cold.before else None
    after = rehost.after.host_used_tokens if rehost and rehost.after else None
    if before is not None and after is not None:
        fams["growth"].add_metric([name], after - before)


def _histogram(fam: HistogramMetricFamily, labels: list[str], h: Histogram) -> None:
    buckets = [(_le(ub), float(n)) for ub, n in zip(LATENCY_BUCKETS, h.buckets)] + [("+Inf", float(h.count))]
    fam.add_metric(labels, buckets, sum_value=h.sum)


def _le(v: float) -> str:
    return repr(float(v))


class CanaryCollector(Collector):
    """Reads `snapshots()` (name -> TargetSnapshot) on every scrape; never does IO."""

    def __init__(self, snapshots: Callable[[], Mapping[str, TargetSnapshot]],
                 config_status: Callable[[], ReloadStatus] | None = None):
        self._snapshots = snapshots
        if config_status is None:
            loaded = ReloadStatus(True, time.time())  # no reloads: the config loaded once, now
            config_status = lambda: loaded  # noqa: E731
        self.config_status = config_status

    def describe(self) -> Iterator[Metric]:
        # Names only: registering must not touch scheduler state (client_python's advice).
        return iter(_families().values())

    def collect(self) -> Iterator[Metric]:
        fams = _families()
        for name, s in sorted(self._snapshots().items()):
            self._target(fams, name, s)
        self._globals(fams, self.config_status())
        return iter(fams.values())

    def target_families(self, name: str, s: TargetSnapshot) -> list[Metric]:
        """Every family with only target `name`'s samples (exposition.py renders targets one by one)."""
        fams = _families()
        self._target(fams, name, s)
        return list(fams.values())

    def global_families(self, status: ReloadStatus) -> list[Metric]:
        """Every family with only the samples that belong to no target (config, build)."""
        fams = _families()
        self._globals(fams, status)
        return list(fams.values())

    @staticmethod
    def _globals(fams: dict[str, Metric], status: ReloadStatus) -> None:
        fams["reload"].add_metric([], 1.0 if status.ok else 0.0)
        fams["reload_at"].add_metric([], status.success_at)
        fams["build"].add_metric([__version__], 1.0)

    def _target(self, fams: dict[str, Metric], name: str, s: TargetSnapshot) -> None:
        last = s.last
        verdict = last.verdict.value if last and last.verdict else None
        _one_hot(fams["verdict"], name, [v.value for v in Verdict], verdict)
        conclusive = s.last_conclusive
        _one_hot(fams["conclusive"], name, CONCLUSIVE, conclusive.verdict.value if conclusive and conclusive.verdict else None)
        # The cause of the last conclusive probe, so an error probe after a silent one keeps the
        # page's `cause` label (a changed label would resolve the page and open a new one).
        cause = (conclusive.cause if conclusive and conclusive.verdict == Verdict.SILENT else Cause.NONE).value if last else None
        _one_hot(fams["cause"], name, [c.value for c in Cause], cause)
        _one_hot(fams["reason"], name, [r.value for r in ErrorReason], s.last_error_reason.value if s.last_error_reason else None)
        fams["streak"].add_metric([name], float(s.streak))
        fams["errors_in_row"].add_metric([name], float(s.consecutive_errors))
        fams["since_conclusive"].add_metric([name], float(s.since_conclusive))
        if s.last_measured is not None:
            _measured(fams, name, s.last_measured)
        if last is not None and last.finished_at is not None:
            fams["last_ts"].add_metric([name], last.finished_at)
            fams["duration"].add_metric([name], max(0.0, last.finished_at - last.started_at))
        if s.last_conclusive_at is not None:
            fams["conclusive_ts"].add_metric([name], s.last_conclusive_at)
        fams["in_progress"].add_metric([name], 1.0 if s.in_progress else 0.0)
        fams["interval"].add_metric([name], float(s.target.interval_s))
        if s.up is not None:
            fams["up"].add_metric([name], 1.0 if s.up else 0.0)
        for v in Verdict:
            fams["probes"].add_metric([name, v.value], float(s.probes_total.get(v, 0)))
        for r in ErrorReason:
            fams["errors"].add_metric([name, r.value], float(s.errors_total.get(r, 0)))
        for phase in LATENCY_PHASES:
            _histogram(fams["latency_hist"], [name, phase.value], s.latency.get(phase, Histogram()))
        fams["tokens"].add_metric([name, "canary"], float(s.tokens_canary))
        fams["tokens"].add_metric([name, "pressure"], float(s.tokens_pressure))
        fams["passive"].add_metric([name], float(s.passive_tokens))
        fams["watch_errors"].add_metric([name], float(s.watch_errors))
        fams["restarts"].add_metric([name], float(s.restarts_detected))
        fams["budget"].add_metric([name], float(s.budget_remaining))
        if s.server is not None:
            fams["server_info"].add_metric([name, *server_info_labels(s.server)], 1.0)
        if s.host_used_tokens is not None:
            fams["host_used"].add_metric([name], s.host_used_tokens)
        if s.host_total_tokens is not None:
            fams["host_total"].add_metric([name], s.host_total_tokens)
