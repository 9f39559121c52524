"""The Grafana dashboards and provisioning files, checked without a Grafana server.

Three kinds of check:
- Grafana's schema: every dashboard decodes into grafana-foundation-sdk's models (generated from
  Grafana 11.6's schema, the version compose.yaml runs), every key we wrote survives the round trip
  (an unknown or misplaced key is dropped, so it shows), and every value has the schema's type or
  enum value.
- PromQL: every panel and annotation query parses (promtool, on a rules file made of them), uses
  `$__rate_interval` for every range, only reads counters through a range, and only names series that
  exist: the exporter's contract table in README.md or SGLang's real /metrics (0.5.23 and 0.5.17).
- House rules: unique uids, a description on every panel, datasources only through `${datasource}`,
  units, the `$target` variable everywhere, no `sglang_` prefix.
"""

from __future__ import annotations

import copy
import enum
import json
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

import procs
from dashboard_queries import (
    DASHBOARDS,
    REPO,
    iter_annotation_queries,
    iter_panel_queries,
    iter_panels,
    load,
    metric_names,
    render_query,
)
from fixtures import SGLANG

FIXTURES = SGLANG / "sglang-0.5.23"
FIXTURES_0517 = SGLANG / "sglang-0.5.17-live"
PROMETHEUS_BUILTIN = {"ALERTS", "ALERTS_FOR_STATE", "up"}
# Prometheus annotation fields Grafana's prometheus plugin reads from the annotation itself; the
# generic AnnotationQuery schema leaves datasource-specific keys open, so the SDK does not model them.
ANNOTATION_PLUGIN_KEYS = {"step", "titleFormat", "textFormat", "tagKeys", "useValueForTime"}


def all_dashboards() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, load(p)) for p in DASHBOARDS]


def all_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return iter_panel_queries(dash) + iter_annotation_queries(dash)


@pytest.fixture(scope="module")
def dashboards() -> list[tuple[str, dict[str, Any]]]:
    found = all_dashboards()
    assert {n for n, _ in found} >= {"hicache-canary.json", "sglang-overview.json"}
    return found


# ---------------------------------------------------------------- generated files are in sync


def test_committed_dashboards_are_what_the_generator_writes():
    sys.path.insert(0, str(REPO / "grafana"))
    try:
        import build_dashboards
    finally:
        sys.path.pop(0)
    for name, text in build_dashboards.render().items():
        committed = (REPO / "grafana" / "dashboards" / name).read_text()
        assert committed == text, f"{name} is stale: run `python grafana/build_dashboards.py`"


# ---------------------------------------------------------------- Grafana's schema


def _sdk():
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.models import dashboard as model

    plugins.register_default_plugins()
    return model


def _lost_keys(original: Any, roundtrip: Any, path: str = "") -> list[str]:
    """Keys present in `original` that are missing or changed in `roundtrip` (additions are fine)."""
    lost: list[str] = []
    if isinstance(original, dict):
        if not isinstance(roundtrip, dict):
            return [f"{path}: became {type(roundtrip).__name__}"]
        for k, v in original.items():
            here = f"{path}.{k}" if path else k
            if k not in roundtrip:
                if v is None:  # an explicit null is the same as leaving the key out
                    continue
                if not (k in ANNOTATION_PLUGIN_KEYS and ".annotations.list[" in f".{path}"):
                    lost.append(f"{here}: not in Grafana's schema")
                continue
            lost += _lost_keys(v, roundtrip[k], here)
    elif isinstance(original, list):
        if not isinstance(roundtrip, list) or len(roundtrip) != len(original):
            return [f"{path}: list changed"]
        for i, (a, b) in enumerate(zip(original, roundtrip)):
            lost += _lost_keys(a, b, f"{path}[{i}]")
    elif original != roundtrip and not (original is None and roundtrip is None):
        lost.append(f"{path}: {original!r} became {roundtrip!r}")
    return lost


def _type_errors(obj: Any, path: str = "dashboard") -> list[str]:
    """Values whose type the schema does not allow, found by walking the decoded model objects."""
    errors: list[str] = []
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            errors += _type_errors(item, f"{path}[{i}]")
        return errors
    if not type(obj).__module__.startswith("grafana_foundation_sdk."):
        return errors
    hints = typing.get_type_hints(type(obj))
    for name, hint in hints.items():
        value = getattr(obj, name, None)
        if not _matches(value, hint):
            errors.append(f"{path}.{name}: {value!r} is not {hint}")
        errors += _type_errors(value, f"{path}.{name}")
    return errors


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is typing.Any or hint is object:
        return True
    if origin is typing.Union:
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint) or (typing.Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {e.value for e in hint}
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        # Model classes stay objects after from_json; anything else (e.g. a raw dict) is a mismatch
        # only when the schema names a concrete primitive.
        if hint.__module__.startswith("grafana_foundation_sdk."):
            return isinstance(value, hint) or hint.__name__ == "Dataquery" or isinstance(value, dict)
        return isinstance(value, hint)
    return True


def schema_problems(dash: dict[str, Any]) -> list[str]:
    model = _sdk()
    decoded = model.Dashboard.from_json(copy.deepcopy(dash))
    roundtrip = json.loads(json.dumps(decoded.to_json(), default=lambda o: o.to_json() if hasattr(o, "to_json") else o.value))
    return _lost_keys(dash, roundtrip) + _type_errors(decoded)


def test_dashboards_fit_grafanas_schema(dashboards):
    for name, dash in dashboards:
        assert schema_problems(dash) == [], name


def test_schema_check_catches_unknown_keys_and_bad_values(dashboards):
    _, dash = dashboards[0]
    broken = copy.deepcopy(dash)
    panel = next(p for p in broken["panels"] if p["type"] == "timeseries")
    panel["fieldConfig"]["defaults"]["unitt"] = "s"  # a typo Grafana would silently ignore
    panel["options"]["tooltip"]["mode"] = "everything"  # not a TooltipDisplayMode
    broken["graphTooltip"] = 7  # not a DashboardCursorSync
    problems = "\n".join(schema_problems(broken))
    assert "unitt: not in Grafana's schema" in problems
    assert "'everything'" in problems
    assert "graph_tooltip: 7" in problems


# ---------------------------------------------------------------- house rules


def test_uids_unique_and_pinned(dashboards):
    uids = [d["uid"] for _, d in dashboards]
    assert len(set(uids)) == len(uids) and all(uids)
    assert {"hicache-canary", "sglang-overview"} <= set(uids)
    for name, dash in dashboards:
        assert dash["id"] is None, name  # provisioning assigns ids; a fixed one collides on import
        ids = [p["id"] for p in iter_panels(dash)]
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"


def test_every_panel_has_title_and_description(dashboards):
    for name, dash in dashboards:
        for p in iter_panels(dash):
            if p["type"] == "row":
                assert p["title"], name
                continue
            assert p.get("title"), f"{name}: panel {p['id']} has no title"
            assert len(p.get("description", "")) > 30, f"{name}: {p['title']!r} has no real description"


def test_every_panel_has_a_unit(dashboards):
    for name, dash in dashboards:
        for p in iter_panels(dash):
            if p["type"] == "row":
                continue
            assert p["fieldConfig"]["defaults"].get("unit"), f"{name}: {p['title']!r} has no unit"


def _datasource_refs(node: Any, path: str = "") -> list[tuple[str, Any]]:
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "datasource":
                found.append((f"{path}.{k}", v))
            found += _datasource_refs(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _datasource_refs(v, f"{path}[{i}]")
    return found


def test_every_datasource_reference_goes_through_the_variable(dashboards):
    for name, dash in dashboards:
        refs = _datasource_refs(dash)
        assert len(refs) > 10, name
        for path, ref in refs:
            uid = ref.get("uid") if isinstance(ref, dict) else ref
            assert uid == "${datasource}", f"{name}{path} = {ref!r}"
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for p in iter_panels(dash):
            if p["type"] != "row":
                assert p.get("datasource") == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
                assert all("datasource" in t for t in p["targets"]), p["title"]


def test_target_variable_and_every_query_filters_by_it(dashboards):
    for name, dash in dashboards:
        target = {v["name"]: v for v in dash["templating"]["list"]}["target"]
        assert target["type"] == "query" and target["multi"] and target["includeAll"]
        if name == "hicache-canary.json":
            assert target["query"]["query"] == "label_values(hicache_canary_verdict, target)"
        for title, expr in all_queries(dash):
            selectors = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr)
            assert selectors, f"{name}: {title}: {expr}"
            for metric, matchers in selectors:
                assert 'target=~"$target"' in matchers, f"{name}: {title}: {metric} is not filtered by $target"


def test_ranges_use_rate_interval_and_counters_are_only_read_through_ranges(dashboards):
    for name, dash in dashboards:
        for title, expr in all_queries(dash):
            for rng in re.findall(r"\[([^\]]*)\]", expr):
                assert rng == "$__rate_interval", f"{name}: {title}: range [{rng}]"
            for m in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*(?:_total|_bucket|_sum|_count))\b(\{[^}]*\})?", expr):
                after = expr[m.end():].lstrip()
                # A counter read raw gives a lifetime total: dashboards show rates (rate-based ratios only).
                assert after.startswith("[$__rate_interval]"), f"{name}: {title}: {m.group(1)} read without rate()"
            for fn in re.finditer(r"\b(rate|irate|increase)\(", expr):
                assert "[$__rate_interval]" in expr[fn.end():], f"{name}: {title}: {fn.group(1)} without a range"


def test_no_router_style_sglang_prefix(dashboards):
    for name, dash in dashboards:
        text = json.dumps(dash)
        assert not re.search(r"\bsglang_[a-z]", text), f"{name} uses sglang_ (only sgl-router renames sglang: that way)"


def _readme_metric_names() -> set[str]:
    """Series names from README.md's exported-metrics table (histograms expand to their series)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exported metrics", 1)[1]
    names: set[str] = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        prev = None
        for raw in re.findall(r"`([^`]+)`", cells[0]):
            if raw.startswith("...") and prev:
                words = raw.lstrip(".").strip("_").split("_")
                raw = "_".join(prev.split("_")[: -len(words)] + words)
            names.add(raw)
            if cells[1] == "histogram":
                names |= {raw + s for s in ("_bucket", "_sum", "_count")}
            prev = raw
    return names


def _fixture_metric_names() -> set[str]:
    names: set[str] = set()
    # Both generations a panel reads: 0.5.23 (SGLang's own collectors) and 0.5.17 (live servers).
    for f in [*FIXTURES.glob("metrics_*.txt"), *FIXTURES_0517.glob("**/sglang_metrics_*.txt")]:
        text = f.read_text()
        names |= set(re.findall(r"^(sglang:[a-zA-Z0-9_:]+)", text, re.M))
        # SGLang's own HELP text names families that appear on first increment only (the dropped
        # counter is documented beside evicted_tokens_total and seeded by the simulator).
        names |= set(re.findall(r"\b(sglang:[a-z0-9_]+_total)\b", text))
    return names


def test_metric_names_exist_in_the_contract_or_sglangs_real_output(dashboards):
    readme, fixture = _readme_metric_names(), _fixture_metric_names()
    assert "hicache_canary_verdict" in readme and "hicache_canary_host_pool_total_tokens" in readme
    assert "hicache_canary_phase_latency_seconds_bucket" in readme
    assert "sglang:hicache_host_used_tokens" in fixture and "sglang:time_to_first_token_seconds_bucket" in fixture
    known = readme | fixture | PROMETHEUS_BUILTIN
    for name, dash in dashboards:
        used = set()
        for title, expr in all_queries(dash):
            names = metric_names(expr)
            assert names, f"{name}: {title}: no series in {expr}"
            unknown = names - known
            assert not unknown, f"{name}: {title}: {sorted(unknown)} are neither in README.md nor in SGLang 0.5.23's or 0.5.17's /metrics"
            used |= names
        var_query = {v["name"]: v for v in dash["templating"]["list"]}["target"]["query"]["query"]
        assert metric_names(var_query.replace("label_values(", "(").split(",")[0] + ")") <= known


def test_verdict_and_cause_mappings_cover_the_contracts_closed_sets(dashboards):
    readme = (REPO / "README.md").read_text()

    def closed_set(label: str) -> set[str]:
        m = re.search(rf"`{label}` ∈ ([a-z_, ]+)", readme)
        assert m, label
        return {v.strip() for v in m.group(1).split(",")}

    dash = dict(dashboards)["hicache-canary.json"]
    by_title = {p["title"]: p for p in iter_panels(dash)}
    for title, label in (("Current verdict", "verdict"), ("Verdict over time", "verdict"), ("Suspected cause", "cause")):
        panel = by_title[title]
        mapped = {o["text"] for o in panel["fieldConfig"]["defaults"]["mappings"][0]["options"].values()}
        assert mapped == closed_set(label), title
        expr = panel["targets"][0]["expr"]
        assert {v for v in re.findall(rf'{label}="([a-z_]+)"', expr)} == closed_set(label), title


def test_the_hicache_dashboard_has_the_panels_the_issue_asks_for(dashboards):
    dash = dict(dashboards)["hicache-canary.json"]
    exprs = "\n".join(e for _, e in iter_panel_queries(dash))
    for needle in (
        "hicache_canary_verdict", "hicache_canary_suspected_cause", "hicache_canary_last_phase_latency_seconds",
        "hicache_canary_rehost_cold_ratio", "hicache_canary_last_cached_tokens", "sglang:hicache_host_used_tokens",
        "sglang:hicache_host_total_tokens", "sglang:hicache_backup_tokens_total", "sglang:load_back_tokens_total",
        "sglang:evicted_tokens_total", "sglang:hicache_dropped_tokens_total", 'mode="host_hit"',
        "sglang:time_to_first_token_seconds_bucket", "sglang:num_queue_reqs", "hicache_canary_server_info",
    ):
        assert needle in exprs, needle
    # Radix-cache counters repeat per TP rank: max over ranks, never a sum over tp_rank.
    for m in re.finditer(r"(sglang:(?:hicache_backup|load_back|evicted|hicache_dropped)_tokens_total)", exprs):
        line = exprs[: m.start()].rsplit("\n", 1)[-1]
        assert "max by (" in line, m.group(1)
    types = {p["type"] for p in iter_panels(dash)}
    assert {"state-timeline", "stat", "table", "timeseries"} <= types
    assert iter_annotation_queries(dash) and "ALERTS{" in iter_annotation_queries(dash)[0][1]


# ---------------------------------------------------------------- PromQL parses


def test_every_query_parses_with_promtool(dashboards, tmp_path):
    promtool = procs.require_binary("promtool")
    rules = []
    for name, dash in dashboards:
        for i, (title, expr) in enumerate(all_queries(dash)):
            rules.append({"record": f"dashboard:{Path(name).stem.replace('-', '_')}:q{i}", "expr": render_query(expr, target="sglang-0")})
    path = tmp_path / "panel-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules)} rules found" in r.stdout + r.stderr


def test_render_query_leaves_no_grafana_variables(dashboards):
    for _, dash in dashboards:
        for _, expr in all_queries(dash):
            out = render_query(expr, target="sglang-0", rate_interval="1m")
            assert "$" not in out and 'target=~"sglang-0"' in out and "[1m]" in out or "[" not in expr


def test_iter_panel_queries_finds_every_target(dashboards):
    for _, dash in dashboards:
        n_targets = sum(len(p.get("targets", [])) for p in iter_panels(dash))
        queries = iter_panel_queries(dash)
        assert len(queries) == n_targets > 10
        assert all(isinstance(t, str) and t and isinstance(e, str) for t, e in queries)


# ---------------------------------------------------------------- provisioning


def test_datasource_provisioning_pins_uid_and_matches_the_scrape_interval():
    doc = yaml.safe_load((REPO / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert doc["apiVersion"] == 1
    by_type = {d["type"]: d for d in doc["datasources"]}
    prom = by_type["prometheus"]
    assert prom["uid"] == "prometheus" and prom["url"] == "http://prometheus:9090" and prom["isDefault"]
    assert by_type["alertmanager"]["url"] == "http://alertmanager:9093"
    # The dashboards' datasource variable defaults to this uid.
    for _, dash in all_dashboards():
        assert {v["name"]: v for v in dash["templating"]["list"]}["datasource"]["current"]["value"] == prom["uid"]
    # $__rate_interval is 4x timeInterval: it must equal the scrape interval or rates go blank.
    prom_yml = REPO / "prometheus" / "prometheus.yml"
    scrape = yaml.safe_load(prom_yml.read_text())["global"]["scrape_interval"]
    assert prom["jsonData"]["timeInterval"] == scrape


def test_dashboard_provider_points_where_compose_mounts_the_dashboards():
    doc = yaml.safe_load((REPO / "grafana/provisioning/dashboards/hicache-canary.yml").read_text())
    (provider,) = doc["providers"]
    assert provider["folder"] == "HiCache" and provider["type"] == "file"
    path = provider["options"]["path"]
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.split(":")[0] == "./grafana/dashboards" and m.split(":")[1] == path for m in mounts), mounts


def test_docs_list_every_panel(dashboards):
    docs = " ".join((REPO / "docs" / "dashboards.md").read_text().split())  # ignore line wrapping
    for name, dash in dashboards:
        for p in iter_panels(dash):
            if p["type"] != "row":
                assert p["title"] in docs, f"docs/dashboards.md does not describe {name}: {p['title']!r}"
