"""Issue 13: the shipped rules, alerts and dashboards on the SGLang users actually run (0.5.17).

The real capture of four live SGLang 0.5.17 servers and our exporter (20 scrapes 10 s apart,
tests/testdata/sglang/sglang-0.5.17-live/consecutive-probes/) is replayed into a real Prometheus that
runs prometheus.yml's rule files verbatim (tests/capture_replay.py). Then:
- every panel query of both dashboards draws something over the replayed range (instant panels: at
  the end), or every series it returns carries a `note` label saying why there is no value (e.g. "not
  exported by this SGLang version"): a blank without a stated reason fails (the alert annotation
  query is not a panel: nothing about a target fires in this capture, and it rightly draws nothing);
- every recording rule records something;
- the alerts in pending/firing state are exactly those the capture calls for, among them
  HiCacheHostTierNeverHit for `wt` (evictions, host pool growth, device hits, no host hit: 0.5.17 has
  no hicache_backup_tokens_total).

The same dashboards against 0.5.23-shaped servers: tests/test_e2e_dashboards.py (the simulator
speaks 0.5.23). The same rules on 0.5.23- and 0.5.17-shaped series: prometheus/tests/*.test.yml.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
import yaml

from capture_replay import start_replay
from dashboard_queries import DASHBOARDS, iter_panel_targets, load, render_query
from stack import prom_query, prom_query_range
from test_prometheus_rules import RULE_FILES

RATE_INTERVAL = "1m"  # Grafana's $__rate_interval at the shipped 15 s scrape interval
STEP = 10  # the capture's scrape spacing

# What the capture itself says, for every alert: (alertname, target or None, state).
EXPECTED_ALERTS = {
    # evictions, host pool growth (158,208 -> 159,744), device hits and no host hit in the window
    ("HiCacheHostTierNeverHit", "wt", "pending"),
    # every scheduled probe of wt and wtsmall ended not_evicted (consecutive-probes/README.md)
    ("HiCacheCanaryInconclusive", "wt", "pending"),
    ("HiCacheCanaryInconclusive", "wtsmall", "pending"),
    ("HiCacheWriteThroughOnHybridModel", "wt", "pending"),
    ("HiCacheWriteThroughOnHybridModel", "wtsmall", "pending"),
    ("HiCacheCanaryWatchdog", None, "firing"),
}


@pytest.fixture(scope="module")
def replay():
    r = start_replay()
    yield r
    r.stop()


def _recording_rules() -> list[str]:
    return [rule["record"] for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "record" in rule]


def _wait_rules_evaluated(url: str) -> None:
    """Every rule group has been evaluated at least twice (alerts read the recording rules' output)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        groups = httpx.get(url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        errors = [(r["name"], r["lastError"]) for g in groups for r in g["rules"] if r.get("lastError")]
        assert errors == [], f"rules that fail to evaluate: {errors}"
        if groups and all(not g["lastEvaluation"].startswith("0001") for g in groups):
            time.sleep(2.5)  # one more round at the 1 s interval
            return
        time.sleep(0.2)
    raise TimeoutError("Prometheus did not evaluate the rule groups within 30 s")


def _finite(result: list[dict]) -> bool:
    for series in result:
        values = series.get("values") or [series["value"]]
        if any(math.isfinite(float(v)) for _, v in values):
            return True
    return False


def _stated(result: list[dict]) -> bool:
    return bool(result) and all(series["metric"].get("note") for series in result)


def test_every_panel_draws_or_states_why_on_the_real_0517_capture(replay):
    blank, stated, drawn = [], [], 0
    for path in DASHBOARDS:
        for title, expr, instant in iter_panel_targets(load(path)):
            q = render_query(expr, rate_interval=RATE_INTERVAL)
            if instant:
                result = prom_query(replay.url, q)
            else:
                result = prom_query_range(replay.url, q, replay.start, time.time(), STEP)
            if _finite(result):
                drawn += 1
            elif _stated(result):
                stated.append((path.name, title, sorted({s["metric"]["note"] for s in result})))
            else:
                blank.append((path.name, title, expr))
    print(f"\n0.5.17 replay: {drawn} panel queries draw data, {len(stated)} state why not, {len(blank)} blank")
    for s in stated:
        print("  stated:", s)
    assert blank == [], "panel queries blank on SGLang 0.5.17 without a stated reason:\n" + "\n".join(
        f"{d} / {t}: {e}" for d, t, e in blank)


def test_every_recording_rule_records_on_the_real_0517_capture(replay):
    _wait_rules_evaluated(replay.url)
    records = _recording_rules()
    empty = [name for name in records if not prom_query(replay.url, name)]
    assert empty == [], f"recording rules with no output on SGLang 0.5.17: {empty}"
    # The per-generation rules choose 0.5.17's families: check what they chose, not only that
    # something came out.
    backups = prom_query(replay.url, "target_pool:sglang_hicache_backup_tokens:rate5m")
    assert {(s["metric"]["target"], s["metric"]["pool"]) for s in backups} == {
        (t, "host_pool_growth") for t in ("wt", "wb", "wtsmall")}
    modes = prom_query(replay.url, "target_mode:sglang_prefill_effective_tokens:rate5m")
    assert {(s["metric"]["target"], s["metric"]["mode"]) for s in modes} == {
        (t, m) for t in ("wt", "wb", "wtsmall", "off") for m in ("input", "device_hit", "host_hit")}


def test_alerts_on_the_real_0517_capture_are_exactly_what_it_shows(replay):
    _wait_rules_evaluated(replay.url)
    alerts = {(s["metric"]["alertname"], s["metric"].get("target"), s["metric"]["alertstate"])
              for s in prom_query(replay.url, "ALERTS")}
    assert alerts == EXPECTED_ALERTS
    # HiCacheHostTierNeverHit's value is the hour's device evictions: 156,491 -> 236,405 in the
    # capture, which increase() extrapolates a little towards the edges of its window.
    value = prom_query(replay.url, 'ALERTS_FOR_STATE{alertname="HiCacheHostTierNeverHit"}')
    assert [s["metric"]["target"] for s in value] == ["wt"]
    evicted = prom_query(replay.url, 'target:sglang_evicted_tokens:increase1h{target="wt"}')
    assert evicted and float(evicted[0]["value"][1]) == pytest.approx(236405 - 156491, rel=0.1)
