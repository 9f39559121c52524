"""Read the PromQL out of a Grafana dashboard, and make it runnable against a real Prometheus.

`iter_panel_queries` walks every panel (rows' nested panels too) and returns (panel title, expr) for
each query target; `iter_annotation_queries` does the same for annotations. `render_query` replaces
the Grafana variables the dashboards use ($target, $__rate_interval, ${datasource}) so the result can
go to Prometheus's /api/v1/query as it is. `metric_names` pulls the series names out of an expr for
the static checks in tests/test_dashboards.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((REPO / "grafana" / "dashboards").glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def iter_panel_queries(dashboard_json: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel_title, expr) for every PromQL query target of every panel, in dashboard order."""
    out: list[tuple[str, str]] = []
    for panel in iter_panels(dashboard_json):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", ""), target["expr"]))
    return out


def iter_panel_targets(dashboard_json: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(panel_title, expr, instant) for every query target: instant ones are drawn at "now" only,
    the others over the dashboard's time range."""
    out: list[tuple[str, str, bool]] = []
    for panel in iter_panels(dashboard_json):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", ""), target["expr"], bool(target.get("instant"))))
    return out


def iter_annotation_queries(dashboard_json: dict[str, Any]) -> list[tuple[str, str]]:
    """(annotation name, expr) for every Prometheus annotation (legacy top-level expr or target.expr)."""
    out = []
    for ann in dashboard_json.get("annotations", {}).get("list", []):
        expr = (ann.get("target") or {}).get("expr") or ann.get("expr")
        if expr:
            out.append((ann.get("name", ""), expr))
    return out


def render_query(expr: str, *, target: str = ".+", rate_interval: str = "1m") -> str:
    """The expr with Grafana's variables replaced as Grafana would for one target (or a regex).

    Dashboards match `target=~"$target"`, so a plain name or a regex both work. rate_interval must
    span at least two scrapes of the Prometheus it runs against (Grafana uses 4x the scrape interval).
    """
    rendered = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)
    rendered = rendered.replace("${target}", target).replace("$target", target)
    return rendered.replace("${datasource}", "prometheus")


_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan",
}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Series names an expr selects (not functions, keywords, label names or label values)."""
    s = _STRINGS.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    s = _GROUPING.sub("", s)
    names = set()
    for m in _IDENT.finditer(s):
        word = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("("):  # a function call
            continue
        if word.lower() in _KEYWORDS or word.startswith("$"):
            continue
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] in ".$"):
            continue  # part of a number (1e3) or a variable
        names.add(word)
    return names
