"""Generate grafana/dashboards/*.json from the panel definitions below.

The JSON files are committed (Grafana provisions them as they are); this script is their source, so a
query lives in one readable place and every panel gets the same datasource, units and description
discipline. tests/test_dashboards.py fails when the committed JSON differs from what this script
writes. Run `python grafana/build_dashboards.py` after editing.

Query conventions (see docs/dashboards.md):
- SGLang names keep the colon (`sglang:`): the `sglang_` form only exists behind sgl-router.
- Radix-cache counters repeat on every TP rank: `max by (..., dp_rank)` over ranks, then sum the DP
  ranks. Scheduler series come from `tp_rank="0"` (other ranks report zeros or nothing).
- Ratios are ratios of rates over `$__rate_interval`, with the denominator guarded by `> 0`.
- Two SGLang metric generations (tests/testdata/sglang): 0.5.23 and 0.5.17. A panel built on a family
  0.5.17 lacks falls back, `or on (target)`, to 0.5.17's nearest equivalent for the targets without
  `sglang:prefill_effective_tokens_total` (0.5.23 pre-creates it); where there is none, the target gets
  a NaN series whose `note` label says "not exported by this SGLang version", so the legend states
  why the line is missing instead of leaving a blank. tests/test_e2e_replay_0517.py replays a live
  0.5.17 capture and fails on a blank without such a note.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
T = 'target=~"$target"'
RI = "[$__rate_interval]"

# Closed sets from README.md "Exported metrics", numbered so one series per target can carry the
# current value and value mappings can name and colour it.
VERDICTS = [
    ("reused", "green"),
    ("silent", "red"),
    ("not_evicted", "yellow"),
    ("inconclusive", "yellow"),
    ("device_cache_broken", "dark-red"),
    ("hicache_disabled", "purple"),
    ("skipped_busy", "text"),
    ("skipped_budget", "text"),
    ("error", "orange"),
]
CAUSES = [
    ("none", "green"),
    ("mamba_state_not_backed_up", "red"),
    ("chunked_prefill_not_backed_up", "red"),
    ("host_pool_pressure", "orange"),
    ("load_back_skipped", "orange"),
    ("unknown", "yellow"),
]


def coded(metric: str, label: str, values: list[tuple[str, str]], first: int) -> str:
    """One series per target whose value is the number of the label value that is currently 1."""
    arms = [f'{i} * ({metric}{{{T},{label}="{v}"}} == 1)' for i, (v, _) in enumerate(values, start=first)]
    return "max by (target) (\n  " + "\n  or ".join(arms) + "\n)"


def code_mappings(values: list[tuple[str, str]], first: int) -> list[dict[str, Any]]:
    return [
        {
            "type": "value",
            "options": {str(i): {"text": v, "color": color, "index": i - first} for i, (v, color) in enumerate(values, start=first)},
        }
    ]


def radix_rate(metric: str, by: str = "") -> str:
    """Rate of a radix-cache counter: identical on every TP rank, so max over ranks, sum over DP."""
    extra = f", {by}" if by else ""
    return f"sum by (target{extra}) (max by (target{extra}, dp_rank) (rate({metric}{{{T}}}{RI})))"


def sched(metric: str, extra_match: str = "") -> str:
    """A scheduler gauge: rank 0 of each DP group reports it."""
    m = f'{T},tp_rank="0"' + (f",{extra_match}" if extra_match else "")
    return f"sum by (target) (max by (target, dp_rank) ({metric}{{{m}}}))"


def none_yet(label: str) -> str:
    """A zero series for targets with HiCache on whose labelled counter has not appeared yet.

    SGLang creates `load_back_tokens_total{pool}` and friends on first increment, and 'never
    happened' is exactly what a silent host tier looks like, so show it as 0 instead of No data.
    """
    base = f'0 * max by (target) (sglang:hicache_host_total_tokens{{{T},tp_rank="0"}})'
    return f'label_replace({base}, "{label}", "(none yet)", "", "")'


# 0.5.23 pre-creates this scheduler counter at 0; 0.5.17 has no such family. (Its presence is all
# that matters; read through a range like every counter.)
NEWER = f"count_over_time(sglang:prefill_effective_tokens_total{{{T}}}{RI})"
NOTE = "{{note}}"


def older_only(expr: str) -> str:
    """expr for the targets of the older metric generation (0.5.17) only."""
    return f"({expr}) unless on (target) {NEWER}"


def not_exported() -> str:
    """A NaN series (nothing drawn) per 0.5.17-generation target, its `note` saying why.

    Only for families with no 0.5.17 equivalent; a family 0.5.17 does export but creates on first
    use (cached_tokens_total{cache_source}) is "none yet", never this.
    """
    base = f'NaN * max by (target) (sglang:num_running_reqs{{{T},tp_rank="0"}})'
    return f'label_replace({older_only(base)}, "note", "not exported by this SGLang version", "", "")'


def host_growth() -> str:
    """Growth rate of the host pool (0 while it holds or shrinks): 0.5.17's only sign of backups."""
    return (f'sum by (target) (max by (target, dp_rank) (clamp_min(deriv(sglang:hicache_host_used_tokens{{{T},tp_rank="0"}}{RI}), 0)))')


def hist_quantiles(metric: str, by: str = "target", fallback: str = "") -> list["Q"]:
    tail = f" or on (target) {fallback}" if fallback else ""
    legend = " " + NOTE if fallback else ""
    return [
        Q(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{T}}}{RI}))){tail}",
          f"{{{{target}}}} p{int(q * 100)}{legend}")
        for q in (0.5, 0.9, 0.99)
    ]


def tier_share(mode: str, cache_source: str) -> str:
    """Share of prefill tokens served by one tier: the scheduler's per-tier counter on 0.5.23; on
    0.5.17 the tokenizer's cached tokens of that tier over its prompt tokens (0 while the tier's
    child has not been created by a first hit)."""
    newer = (f'sum by (target) (rate(sglang:prefill_effective_tokens_total{{{T},tp_rank="0",mode="{mode}"}}{RI}))'
             f' / (sum by (target) (rate(sglang:prefill_effective_tokens_total{{{T},tp_rank="0"}}{RI})) > 0)')
    prompt = f"sum by (target) (rate(sglang:prompt_tokens_total{{{T}}}{RI}))"
    older = (f'(sum by (target) (rate(sglang:cached_tokens_total{{{T},cache_source="{cache_source}"}}{RI})) or on (target) 0 * {prompt})'
             f" / ({prompt} > 0)")
    return f"{newer} or on (target) {older_only(older)}"


@dataclass
class Q:
    expr: str
    legend: str = "{{target}}"
    instant: bool = False
    fmt: str = "time_series"


@dataclass
class P:
    title: str
    description: str
    queries: list[Q]
    kind: str = "timeseries"
    unit: str = "short"
    w: int = 12
    h: int = 8
    mappings: list[dict[str, Any]] = field(default_factory=list)
    thresholds: list[tuple[float | None, str]] = field(default_factory=lambda: [(None, "green")])
    stack: bool = False
    bars: bool = False
    min: float | None = None
    max: float | None = None
    color_mode: str = "palette-classic"
    transformations: list[dict[str, Any]] = field(default_factory=list)
    axis_label: str = ""


@dataclass
class Row:
    title: str


def _field_config(p: P) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "mappings": p.mappings,
        "thresholds": {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in p.thresholds]},
        "color": {"mode": p.color_mode},
    }
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "bars" if p.bars else "line",
            "lineWidth": 1,
            "fillOpacity": 60 if p.bars else (30 if p.stack else 10),
            "showPoints": "auto",
            "spanNulls": False,
            "axisLabel": p.axis_label,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        }
    elif p.kind == "state-timeline":
        defaults["custom"] = {"lineWidth": 0, "fillOpacity": 80}
    elif p.kind == "table":
        defaults["custom"] = {"align": "auto", "cellOptions": {"type": "auto"}}
    return {"defaults": defaults, "overrides": []}


def _options(p: P) -> dict[str, Any]:
    legend = {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []}
    if p.kind == "timeseries":
        return {"legend": legend, "tooltip": {"mode": "multi", "sort": "desc"}}
    if p.kind == "state-timeline":
        return {"showValue": "auto", "rowHeight": 0.9, "mergeValues": True, "alignValue": "left",
                "legend": legend, "tooltip": {"mode": "single", "sort": "none"}}
    if p.kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "orientation": "auto", "textMode": "value_and_name", "colorMode": "background",
                "graphMode": "none", "justifyMode": "auto", "wideLayout": True, "showPercentChange": False}
    if p.kind == "table":
        return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"], "countRows": False}}
    raise ValueError(p.kind)


def _panel(p: P, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = []
    for i, q in enumerate(p.queries):
        t: dict[str, Any] = {"datasource": DS, "expr": q.expr, "legendFormat": q.legend, "refId": chr(ord("A") + i),
                             "format": q.fmt}
        if q.instant:
            t["instant"], t["range"] = True, False
        else:
            t["instant"], t["range"] = False, True
        targets.append(t)
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": p.h, "w": p.w, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": _field_config(p),
        "options": _options(p),
        "transformations": p.transformations,
    }


def _layout(items: list[P | Row]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    x = y = row_h = 0
    pid = 1
    for item in items:
        if isinstance(item, Row):
            if x:
                y, x, row_h = y + row_h, 0, 0
            panels.append({"id": pid, "type": "row", "title": item.title, "collapsed": False, "panels": [],
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
            y += 1
        else:
            if x + item.w > 24:
                y, x, row_h = y + row_h, 0, 0
            panels.append(_panel(item, pid, x, y))
            x += item.w
            row_h = max(row_h, item.h)
        pid += 1
    return panels


def _dashboard(uid: str, title: str, description: str, target_query: str, items: list[P | Row],
               annotations: list[dict[str, Any]], links: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": None,
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["sglang", "hicache", "hicache-canary"],
        "timezone": "browser",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 41,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "links": links,
        "annotations": {"list": annotations},
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {"text": "Prometheus", "value": "prometheus"},
                    "hide": 0,
                    "regex": "",
                },
                {
                    "type": "query",
                    "name": "target",
                    "label": "Target",
                    "description": "SGLang server, by the name given in the exporter config",
                    "datasource": DS,
                    "query": {"query": target_query, "refId": "target"},
                    "refresh": 2,
                    "sort": 1,
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".+",
                    "current": {"text": ["All"], "value": ["$__all"]},
                    "hide": 0,
                    "regex": "",
                },
            ]
        },
        "panels": _layout(items),
    }


ALERT_ANNOTATION = {
    "name": "HiCache alerts",
    "datasource": DS,
    "enable": True,
    "iconColor": "red",
    # The top-level expr/step form: Grafana's schema models `expr`, and the Prometheus plugin moves
    # both into its own target when it loads the dashboard.
    "expr": f'ALERTS{{alertname=~"HiCache.*|SGLang.*",alertstate="firing",{T}}}',
    "step": "60s",
    "titleFormat": "{{alertname}}",
    "textFormat": "{{target}}: {{severity}}",
    "tagKeys": "alertname,severity,target",
}

PCT = [(None, "red"), (0.2, "yellow"), (0.5, "green")]


def hicache_canary() -> dict[str, Any]:
    items: list[P | Row] = [
        Row("Verdict: does the host tier serve evicted prefixes?"),
        P("Current verdict",
          "The last reuse canary's verdict per target. reused: R came back from the host tier after "
          "eviction. silent: the host pool held data but R was prefilled again as if cold (the failure "
          "this project exists for). not_evicted/inconclusive: the probe could not tell. skipped_*: no "
          "probe ran (server busy, token budget spent).",
          [Q(coded("hicache_canary_verdict", "verdict", VERDICTS, 1), instant=True)],
          kind="stat", unit="none", w=6, h=5, mappings=code_mappings(VERDICTS, 1), color_mode="fixed"),
        P("Last conclusive verdict",
          "The last verdict about HiCache itself (reused, silent, device_cache_broken, hicache_disabled). "
          "error, not_evicted, inconclusive and skips never change it, so a probe cut short by a restart "
          "neither clears a silent page nor starts a new one: this is what HiCacheSilent looks at.",
          [Q(coded("hicache_canary_last_conclusive_verdict", "verdict", VERDICTS, 1), instant=True)],
          kind="stat", unit="none", w=6, h=5, mappings=code_mappings(VERDICTS, 1), color_mode="fixed"),
        P("Suspected cause",
          "Why the last conclusive verdict was silent, read from SGLang's counter deltas during that probe "
          "(see docs/runbooks/HiCacheSilent.md); an error probe after it keeps the cause. 'none' when "
          "the last conclusive verdict is not silent.",
          [Q(coded("hicache_canary_suspected_cause", "cause", CAUSES, 0), instant=True)],
          kind="stat", unit="none", w=6, h=5, mappings=code_mappings(CAUSES, 0), color_mode="fixed"),
        P("SGLang reachable",
          "1 when the exporter's last contact with the server (restart watch, preflight or probe) "
          "succeeded. The watch reads /metrics every watch_interval (30s) between probes, so a server "
          "that goes away shows here within that, not a probe interval later.",
          [Q(f"hicache_canary_target_up{{{T}}}", instant=True)],
          kind="stat", unit="none", w=6, h=5, color_mode="thresholds", thresholds=[(None, "red"), (1, "green")],
          mappings=[{"type": "value", "options": {"0": {"text": "down", "color": "red", "index": 0},
                                                  "1": {"text": "up", "color": "green", "index": 1}}}]),
        P("Verdict over time",
          "Each target's verdict as it changed, probe by probe; red stretches are silent host tiers. "
          "Since when is the left edge of the current colour.",
          [Q(coded("hicache_canary_verdict", "verdict", VERDICTS, 1))],
          kind="state-timeline", unit="none", w=16, h=7, mappings=code_mappings(VERDICTS, 1), color_mode="fixed"),
        P("Conclusive verdicts in a row",
          "Consecutive conclusive verdicts equal to the last conclusive verdict "
          "(hicache_canary_verdict_streak). error, not_evicted, inconclusive and skips neither extend "
          "nor break it. HiCacheSilent pages at 2 silent ones, so one odd probe does not wake anyone.",
          [Q(f"hicache_canary_verdict_streak{{{T}}}", instant=True)],
          kind="stat", unit="none", w=8, h=7, color_mode="thresholds"),
        P("Time since last probe",
          "Seconds since the last probe finished (any verdict) and since the last conclusive one "
          "(reused, silent, device_cache_broken, hicache_disabled). Growing without bound: the canary "
          "is stuck or skipping (HiCacheCanaryStale).",
          [Q(f"time() - hicache_canary_last_probe_timestamp_seconds{{{T}}}", "{{target}} any", instant=True),
           Q(f"time() - hicache_canary_last_conclusive_probe_timestamp_seconds{{{T}}}", "{{target}} conclusive", instant=True)],
          kind="stat", unit="s", w=8, h=7, color_mode="thresholds",
          thresholds=[(None, "green"), (3600, "yellow"), (4 * 3600, "red")]),
        P("Last error reason",
          "The bounded reason of the last probe that ended in error (connect_failed, connection_lost, timeout, http_5xx, "
          "unauthorized, target_is_router, ...); it stays after later probes succeed. 'none since the "
          "exporter started' while no probe has failed.",
          [Q(f"hicache_canary_last_error_reason{{{T}}} == 1 or on (target) "
             f'label_replace(0 * max by (target) (hicache_canary_consecutive_errors{{{T}}}), "reason", "none since the exporter started", "", "")',
             "{{target}}: {{reason}}", instant=True)],
          kind="stat", unit="none", w=8, h=5, color_mode="thresholds", thresholds=[(None, "green"), (1, "orange")],
          mappings=[{"type": "value", "options": {"0": {"text": "no error", "color": "green", "index": 0},
                                                  "1": {"text": "last error", "color": "orange", "index": 1}}}]),
        P("Errors in a row and probes since conclusive",
          "Probes in a row that ended in error (hicache_canary_consecutive_errors; HiCacheCanaryFailing "
          "at 3) and probes since the last conclusive verdict (hicache_canary_probes_since_conclusive; "
          "HiCacheCanaryInconclusive at 3). While these grow, the verdicts above are getting old.",
          [Q(f"hicache_canary_consecutive_errors{{{T}}}", "{{target}} errors in a row", instant=True),
           Q(f"hicache_canary_probes_since_conclusive{{{T}}}", "{{target}} since conclusive", instant=True)],
          kind="stat", unit="none", w=8, h=5, color_mode="thresholds",
          thresholds=[(None, "green"), (1, "yellow"), (3, "red")]),
        P("Restarts detected",
          "Server restarts the exporter's watch noticed between probes (back after being unreachable, or "
          "SGLang's counters went down), and failed watch polls. Silent configurations arrive with "
          "restarts: each one brings a probe restart_probe_delay (60s) later.",
          [Q(f"sum by (target) (increase(hicache_canary_restarts_detected_total{{{T}}}{RI}))", "{{target}} restarts"),
           Q(f"sum by (target) (increase(hicache_canary_watch_errors_total{{{T}}}{RI}))", "{{target}} watch errors")],
          unit="short", w=8, h=5, bars=True, axis_label="events"),

        Row("Canary latency: rehost against cold"),
        P("R latency by phase",
          "Latency of the canary context R in the last probe: cold (first prefill), rehost (after "
          "eviction from the device pool; served from host when HiCache works) and again (device hit "
          "baseline). Silent: rehost sits on cold. Reused: rehost drops towards again.",
          [Q(f"hicache_canary_last_phase_latency_seconds{{{T}}}", "{{target}} {{phase}}")],
          unit="s", w=12, axis_label="seconds"),
        P("Rehost / cold latency",
          "Rehost latency divided by cold latency in the last probe: near 100% means the evicted prefix "
          "was prefilled again; far below means it was loaded back. Only meaningful when a cold prefill "
          "takes much longer than a load-back (long contexts, big models).",
          [Q(f"hicache_canary_rehost_cold_ratio{{{T}}}")],
          unit="percentunit", w=12, min=0, color_mode="thresholds",
          thresholds=[(None, "green"), (0.5, "yellow"), (0.8, "red")]),
        P("Rehost served by tier",
          "Share of R's prompt that SGLang reported as cached on rehost, per tier "
          "(meta_info.cached_tokens_details). Host near 100% is the healthy case.",
          [Q(f"hicache_canary_rehost_cached_ratio{{{T}}}", "{{target}} {{tier}}")],
          unit="percentunit", w=12, min=0, max=1, stack=True),
        P("Cached tokens for R by phase and tier",
          "Cached tokens SGLang reported for R in each phase, per tier. Expected when healthy: cold 0, "
          "rehost mostly host, again mostly device.",
          [Q(f"hicache_canary_last_cached_tokens{{{T}}}", "{{target}} {{phase}}/{{tier}}")],
          unit="short", w=12, axis_label="tokens"),

        Row("HiCache tiers (SGLang's own counters, all traffic)"),
        P("Host pool used and total",
          "SGLang's host KV pool (sglang:hicache_host_used_tokens / _total_tokens, rank 0; the exporter's "
          "copy for servers Prometheus does not scrape). A pool that fills while rehost stays cold is the "
          "silent failure.",
          [Q(f"{sched('sglang:hicache_host_used_tokens')} or max by (target) (hicache_canary_host_pool_used_tokens{{{T}}})", "{{target}} used"),
           Q(f"{sched('sglang:hicache_host_total_tokens')} or max by (target) (hicache_canary_host_pool_total_tokens{{{T}}})", "{{target}} total")],
          unit="short", w=12, min=0, axis_label="tokens"),
        P("Host Mamba states used and total",
          "Hybrid models only: host slots for Mamba/SSM states. KV on host is unusable without a state at "
          "its boundary, so a small, full state pool turns the host KV pool into dead memory "
          "(suspected cause host_pool_pressure). SGLang 0.5.17 exports no host Mamba gauges: its "
          "targets are listed as 'not exported by this SGLang version'.",
          [Q(f"{sched('sglang:hicache_host_mamba_used_states')} or on (target) {not_exported()}", "{{target}} used " + NOTE),
           Q(f"{sched('sglang:hicache_host_mamba_total_states')} or on (target) {not_exported()}", "{{target}} total " + NOTE)],
          unit="short", w=12, min=0, axis_label="states"),
        P("Device to host backups by pool",
          "Tokens (slots for pool=mamba) written from device to host per second "
          "(sglang:hicache_backup_tokens_total). KV backups with almost no mamba backups on a hybrid "
          "model is the late-attached Mamba state problem. SGLang 0.5.17 counts no backups: there the "
          "host pool's growth rate stands in (a lower bound: backups that replace evicted host entries "
          "do not show). '(none yet)': no backup since the server started.",
          [Q(f"{radix_rate('sglang:hicache_backup_tokens_total', 'pool')} or on (target) "
             f'label_replace({older_only(host_growth())}, "pool", "host pool growth (this SGLang version counts no backups)", "", "")'
             f" or on (target) {none_yet('pool')}", "{{target}} {{pool}}")],
          unit="short", w=12, axis_label="tokens/s"),
        P("Host to device load-backs by pool",
          "Tokens loaded back from host per second (sglang:load_back_tokens_total). SGLang creates the "
          "series on the first load-back; '(none yet)' means HiCache is on and nothing was ever loaded back.",
          [Q(f"{radix_rate('sglang:load_back_tokens_total', 'pool')} or on(target) {none_yet('pool')}", "{{target}} {{pool}}")],
          unit="short", w=12, axis_label="tokens/s"),
        P("Device evictions and dropped tokens",
          "Device KV slots freed by eviction per second (backed up or not), and device tokens destroyed "
          "without a host copy by reason and pool (sglang:hicache_dropped_tokens_total).",
          [Q(radix_rate("sglang:evicted_tokens_total"), "{{target}} evicted"),
           Q(f"{radix_rate('sglang:hicache_dropped_tokens_total', 'pool, reason')} or on(target) {none_yet('reason')}",
             "{{target}} dropped {{pool}} {{reason}}")],
          unit="short", w=12, axis_label="tokens/s"),
        P("Share of prefill served by tier",
          "Of all prefill tokens over the window, the share served from the host tier and from the device "
          "tier (sglang:prefill_effective_tokens_total, rate-based: sum(rate(hit)) / sum(rate(all modes))). "
          "SGLang 0.5.17 has no such counter: there, cached prompt tokens of the tier over all prompt "
          "tokens (sglang:cached_tokens_total{cache_source} / sglang:prompt_tokens_total). "
          "Host share stuck at 0 while the host pool fills means the host tier is never hit.",
          [Q(tier_share("host_hit", "host"), "{{target}} host"),
           Q(tier_share("device_hit", "device"), "{{target}} device")],
          unit="percentunit", w=12, min=0, max=1),
        P("Cached prompt tokens by tier",
          "Prompt tokens of finished requests that came from cache, per tier (sglang:cached_tokens_total"
          "{cache_source}), next to all prompt tokens. SGLang creates each tier's series on its first "
          "hit: '(none yet)' means no cache hit since the server started. A host line that never "
          "appears is what SGLang issue #33713 reported.",
          [Q(f"sum by (target, cache_source) (rate(sglang:cached_tokens_total{{{T}}}{RI})) or on (target) "
             f'label_replace(0 * sum by (target) (rate(sglang:prompt_tokens_total{{{T}}}{RI})), "cache_source", "(none yet)", "", "")',
             "{{target}} {{cache_source}}"),
           Q(f"sum by (target) (rate(sglang:prompt_tokens_total{{{T}}}{RI}))", "{{target}} all prompt tokens")],
          unit="short", w=12, axis_label="tokens/s"),

        Row("Serving (SGLang)"),
        P("Time to first token",
          "TTFT quantiles over all requests (sglang:time_to_first_token_seconds). Silent host reuse shows "
          "up here as long-context requests paying a full prefill.",
          hist_quantiles("sglang:time_to_first_token_seconds"),
          unit="s", w=12, axis_label="seconds"),
        P("Running and queued requests",
          "Requests running and waiting in the scheduler (rank 0). The canary skips probes "
          "(skipped_busy) while the queue is above the target's busy threshold.",
          [Q(sched("sglang:num_running_reqs"), "{{target}} running"),
           Q(sched("sglang:num_queue_reqs"), "{{target}} queued")],
          unit="short", w=12, min=0, axis_label="requests"),

        Row("The canary itself"),
        P("Server configuration (config lint)",
          "What /server_info says, per target (hicache_canary_server_info). write_through on a hybrid "
          "model is a hint worth a look (HiCacheWriteThroughOnHybridModel), not a diagnosis: only the "
          "canary's verdict says whether this server is silent.",
          [Q(f"hicache_canary_server_info{{{T}}}", "", instant=True, fmt="table")],
          kind="table", unit="none", w=24, h=5,
          transformations=[{"id": "organize", "options": {
              "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True, "instance": True},
              "indexByName": {"target": 0, "version": 1, "hicache": 2, "write_policy": 3, "hybrid": 4,
                              "speculative_algorithm": 5},
              "renameByName": {}}}]),
        P("Probes by verdict",
          "Probes that finished in each window, by verdict (hicache_canary_probes_total).",
          [Q(f"sum by (target, verdict) (increase(hicache_canary_probes_total{{{T}}}{RI}))", "{{target}} {{verdict}}")],
          unit="short", w=8, bars=True, stack=True, axis_label="probes"),
        P("Probe errors by reason",
          "Probes that ended in error, by bounded reason (hicache_canary_probe_errors_total).",
          [Q(f"sum by (target, reason) (increase(hicache_canary_probe_errors_total{{{T}}}{RI}))", "{{target}} {{reason}}")],
          unit="short", w=8, bars=True, stack=True, axis_label="probes"),
        P("Tokens the canary sends",
          "Prompt tokens per second the canary sent (R's three sends, synthetic pressure filler), and "
          "device-pool turnover credited to the server's own traffic instead of filler.",
          [Q(f"sum by (target, kind) (rate(hicache_canary_tokens_sent_total{{{T}}}{RI}))", "{{target}} {{kind}}"),
           Q(f"sum by (target) (rate(hicache_canary_passive_pressure_tokens_total{{{T}}}{RI}))", "{{target}} passive")],
          unit="short", w=8, axis_label="tokens/s"),
        P("Token budget left this hour",
          "What is left of each target's hourly canary token budget; at 0 probes are skipped "
          "(skipped_budget).",
          [Q(f"hicache_canary_budget_remaining_tokens{{{T}}}")],
          unit="short", w=8, min=0, axis_label="tokens"),
        P("Host pool growth during the last probe",
          "Change of sglang:hicache_host_used_tokens from before cold to after rehost. Growth with a "
          "cold-like rehost is the page condition.",
          [Q(f"hicache_canary_host_pool_growth_tokens{{{T}}}")],
          unit="short", w=8, axis_label="tokens"),
        P("Probe duration",
          "Wall time of the last probe, and whether one is running now.",
          [Q(f"hicache_canary_last_probe_duration_seconds{{{T}}}", "{{target}} last probe"),
           Q(f"hicache_canary_probe_in_progress{{{T}}}", "{{target}} in progress")],
          unit="s", w=8, axis_label="seconds"),
    ]
    return _dashboard(
        "hicache-canary", "HiCache canary",
        "Whether SGLang's hierarchical KV cache actually reuses evicted prefixes, per server: the reuse "
        "canary's verdict and cause, rehost against cold latency, and SGLang's own HiCache counters.",
        "label_values(hicache_canary_verdict, target)", items, [ALERT_ANNOTATION],
        [{"title": "SGLang overview", "type": "link", "url": "/d/sglang-overview", "keepTime": True,
          "includeVars": True, "targetBlank": False, "asDropdown": False, "icon": "dashboard", "tags": [], "tooltip": ""}],
    )


def sglang_overview() -> dict[str, Any]:
    items: list[P | Row] = [
        Row("Load"),
        P("Request rate",
          "Requests finished per second (sglang:num_requests_total).",
          [Q(f"sum by (target) (rate(sglang:num_requests_total{{{T}}}{RI}))")],
          unit="reqps", w=8),
        P("Token throughput",
          "Prompt and generated tokens per second (sglang:prompt_tokens_total, "
          "sglang:generation_tokens_total), and the scheduler's own generation throughput gauge.",
          [Q(f"sum by (target) (rate(sglang:prompt_tokens_total{{{T}}}{RI}))", "{{target}} prompt"),
           Q(f"sum by (target) (rate(sglang:generation_tokens_total{{{T}}}{RI}))", "{{target}} generated"),
           Q(sched("sglang:gen_throughput"), "{{target}} gen_throughput gauge")],
          unit="short", w=8, axis_label="tokens/s"),
        P("Running and queued requests",
          "Requests running and waiting in the scheduler (rank 0 of each DP group). "
          "SGLang names them num_running_reqs and num_queue_reqs.",
          [Q(sched("sglang:num_running_reqs"), "{{target}} running"),
           Q(sched("sglang:num_queue_reqs"), "{{target}} queued")],
          unit="short", w=8, min=0, axis_label="requests"),
        Row("Latency"),
        P("Time to first token",
          "TTFT quantiles (sglang:time_to_first_token_seconds).",
          hist_quantiles("sglang:time_to_first_token_seconds"), unit="s", w=8),
        P("End-to-end request latency",
          "Whole-request latency quantiles (sglang:e2e_request_latency_seconds).",
          hist_quantiles("sglang:e2e_request_latency_seconds"), unit="s", w=8),
        P("Inter-token latency",
          "Time between generated tokens, quantiles (sglang:inter_token_latency_seconds). SGLang 0.5.17 "
          "has no such histogram: its targets are listed as 'not exported by this SGLang version'.",
          hist_quantiles("sglang:inter_token_latency_seconds", fallback=not_exported()), unit="s", w=8),
        Row("Memory and cache"),
        P("Device token usage",
          "Share of the device KV pool in use (sglang:token_usage: the max over the full, SWA and "
          "Mamba pools; rank 0).",
          [Q(sched("sglang:token_usage"), "{{target}} all pools"),
           Q(sched("sglang:full_token_usage"), "{{target}} full attention KV")],
          unit="percentunit", w=8, min=0, max=1),
        P("Prefix cache hit rate",
          "Share of prefill tokens served from any cache tier over the window, from counters "
          "(sum(rate(*_hit)) / sum(rate(all modes)) of sglang:prefill_effective_tokens_total; on SGLang "
          "0.5.17, which lacks it, prefill_cache over prefill_cache + prefill_compute of "
          "sglang:realtime_tokens_total), not the per-batch sglang:cache_hit_rate gauge or a lifetime ratio.",
          [Q(f'sum by (target) (rate(sglang:prefill_effective_tokens_total{{{T},tp_rank="0",mode=~".+_hit"}}{RI}))'
             f' / (sum by (target) (rate(sglang:prefill_effective_tokens_total{{{T},tp_rank="0"}}{RI})) > 0)'
             " or on (target) "
             + older_only(f'sum by (target) (rate(sglang:realtime_tokens_total{{{T},tp_rank="0",mode="prefill_cache"}}{RI}))'
                          f' / (sum by (target) (rate(sglang:realtime_tokens_total{{{T},tp_rank="0",mode=~"prefill_cache|prefill_compute"}}{RI})) > 0)'))],
          unit="percentunit", w=8, min=0, max=1),
        P("Host tier (HiCache) pool",
          "Host KV pool used and total (rank 0). Details and the reuse verdict: the HiCache canary dashboard.",
          [Q(sched("sglang:hicache_host_used_tokens"), "{{target}} used"),
           Q(sched("sglang:hicache_host_total_tokens"), "{{target}} total")],
          unit="short", w=8, min=0, axis_label="tokens"),
    ]
    return _dashboard(
        "sglang-overview", "SGLang overview",
        "Serving basics of SGLang servers scraped directly (colon-named sglang: metrics): load, latency, "
        "memory and cache.",
        "label_values(sglang:num_running_reqs, target)", items, [ALERT_ANNOTATION],
        [{"title": "HiCache canary", "type": "link", "url": "/d/hicache-canary", "keepTime": True,
          "includeVars": True, "targetBlank": False, "asDropdown": False, "icon": "dashboard", "tags": [], "tooltip": ""}],
    )


def render() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {
        "hicache-canary.json": json.dumps(hicache_canary(), indent=2) + "\n",
        "sglang-overview.json": json.dumps(sglang_overview(), indent=2) + "\n",
    }


def main() -> int:
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
