"""Server-rendered status page: per target the verdict, suspected cause, evidence, for a verdict
that says nothing about HiCache one line on why and what to do next (next_step.py), the last probe
table and an inline SVG chart of recent probes (cold vs rehost latency).

No JavaScript and no external assets: the CSS is inlined from static/status.css, so the page works
offline and under a `default-src 'none'` Content-Security-Policy. Every string from a probe or a
config is HTML-escaped (a target name or an evidence sentence must never become markup).
"""

from __future__ import annotations

import datetime as dt
from html import escape
from importlib import resources
from typing import Any

from hicache_canary import __version__
from hicache_canary.service.history import record_to_dict
from hicache_canary.models import Verdict
from hicache_canary.service.next_step import explain
from hicache_canary.service.target_state import TargetSnapshot

CSS = resources.files("hicache_canary").joinpath("static/status.css").read_text()
W, H, PAD = 340, 150, 28


def _ts(t: float | None) -> str:
    if t is None:
        return "never"
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _sec(v: Any) -> str:
    return "-" if v is None else f"{float(v):.3f} s"


def chart(history: list[dict[str, Any]]) -> str:
    """Polyline of cold and rehost latency over the recent probes that measured them."""
    pts = []
    for e in history:
        lat = {s["phase"]: s["latency_seconds"] for s in e.get("steps", [])}
        if lat.get("cold") is not None and lat.get("rehost") is not None:
            pts.append((lat["cold"], lat["rehost"], e.get("verdict") or ""))
    if not pts:
        return '<p class="empty">no measured probes yet</p>'
    top = max(max(c, r) for c, r, _ in pts) or 1.0
    n = len(pts)

    def xy(i: int, v: float) -> str:
        x = PAD + (i * (W - PAD - 8) / max(1, n - 1) if n > 1 else (W - PAD) / 2)
        y = H - PAD + 8 - (v / top) * (H - PAD - 8)
        return f"{x:.1f},{y:.1f}"

    cold = " ".join(xy(i, c) for i, (c, _, _) in enumerate(pts))
    rehost = " ".join(xy(i, r) for i, (_, r, _) in enumerate(pts))
    dots = "".join(
        f'<circle cx="{xy(i, c).split(",")[0]}" cy="{xy(i, c).split(",")[1]}" r="3" fill="#1565c0"/>'
        f'<circle cx="{xy(i, r).split(",")[0]}" cy="{xy(i, r).split(",")[1]}" r="3" fill="#e65100"><title>{escape(v)}</title></circle>'
        for i, (c, r, v) in enumerate(pts)
    )
    base = H - PAD + 8
    return (
        f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="cold vs rehost latency">'
        f'<rect x="0" y="0" width="{W}" height="{H}" fill="#fbfcfd" stroke="#e6e9ed"/>'
        f'<line x1="{PAD}" y1="{base}" x2="{W - 4}" y2="{base}" stroke="#9aa3ad"/>'
        f'<line x1="{PAD}" y1="8" x2="{PAD}" y2="{base}" stroke="#9aa3ad"/>'
        f'<text x="2" y="16" font-size="10" fill="#5b6570">{top:.2g}s</text>'
        f'<text x="2" y="{base}" font-size="10" fill="#5b6570">0</text>'
        f'<text x="{PAD}" y="{H - 4}" font-size="10" fill="#5b6570">last {n} measured probes, oldest left</text>'
        f'<polyline points="{cold}" fill="none" stroke="#1565c0" stroke-width="2"/>'
        f'<polyline points="{rehost}" fill="none" stroke="#e65100" stroke-width="2"/>'
        f"{dots}</svg>"
    )


def _table(rec: dict[str, Any]) -> str:
    rows = []
    for s in rec["steps"]:
        c = s.get("cached") or {}
        rows.append(
            "<tr>"
            f"<td>{escape(s['phase'])}</td><td>{_sec(s['latency_seconds'])}</td><td>{s['prompt_tokens']}</td>"
            f"<td>{c.get('device', '-')}</td><td>{c.get('host', '-')}</td>"
            f"<td>{'-' if s['host_used_tokens_after'] is None else int(s['host_used_tokens_after'])}</td>"
            "</tr>"
        )
    if not rows:
        return '<p class="empty">no requests in the last probe</p>'
    head = "<tr><th>phase</th><th>latency</th><th>prompt tokens</th><th>device hit</th><th>host hit</th><th>host pool used after</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _conclusive(s: TargetSnapshot) -> str:
    """The last verdict about HiCache, and how many probes since have said nothing (what
    HiCacheCanaryInconclusive counts: it fires from 3)."""
    n = s.since_conclusive
    since = f"{n} inconclusive probe{'s' if n != 1 else ''} since" if n else ""
    if s.streak_verdict:
        return f"{s.streak_verdict.value} x{s.streak}" + (f" ({since})" if since else "")
    return f"none yet ({n} inconclusive probe{'s' if n != 1 else ''} so far)" if n else "none yet"


def _target(s: TargetSnapshot, history: list[dict[str, Any]], secrets: list[str]) -> str:
    t = s.target
    last = record_to_dict(s.last, secrets) if s.last else None
    measured = record_to_dict(s.last_measured, secrets) if s.last_measured else None
    verdict = (last or {}).get("verdict") or "none"
    state = "probing now" + (f" ({escape(s.phase)})" if s.phase else "") if s.in_progress else "idle"
    facts = [
        # what HiCacheSilent pages on: the last conclusive verdict, which an error probe does not change
        ("last conclusive verdict", _conclusive(s)),
        ("suspected cause", s.last_conclusive.cause.value if s.last_conclusive and s.streak_verdict == Verdict.SILENT else "none"),
        ("rehost / cold", "-" if not measured or measured["rehost_cold_ratio"] is None else f"{measured['rehost_cold_ratio']:.3f}"),
        ("host share on rehost", "-" if not measured or measured["host_fraction"] is None else f"{measured['host_fraction']:.0%}"),
        ("last probe", _ts((last or {}).get("finished_at"))),
        ("last conclusive", _ts(s.last_conclusive_at)),
        ("state", state),
        ("server up", {True: "yes", False: "no", None: "not contacted yet"}[s.up]),
        ("budget left this hour", f"{s.budget_remaining} tokens"),
        ("interval", f"{t.interval_s:g} s"),
    ]
    if last and last.get("reason"):
        facts.insert(1, ("error reason", last["reason"]))
    srv = (measured or last or {}).get("server")
    if srv:
        facts.append(("server", f"SGLang {srv['version'] or '?'}, {srv['write_policy'] or '?'}, hybrid={srv['hybrid']}"))
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in facts)
    evidence = escape((last or {}).get("evidence") or "no probe has finished yet")
    why = explain(s.last) if s.last else None
    return (
        f'<section class="target" id="t-{escape(t.name)}">'
        f'<h2>{escape(t.name)} <span class="badge v-{escape(verdict)}">{escape(verdict)}</span>'
        f'<span class="url">{escape(t.url)}</span></h2>'
        f'<p class="evidence">{evidence}</p>'
        + (f'<p class="next">{escape(why)}</p>' if why else "")
        + f'<div class="grid"><div><dl>{dl}</dl>{_table(measured) if measured else ""}</div>'
        f'<div><div class="chart-title">recent probes: R latency</div>{chart(history)}'
        f'<div class="legend"><span class="cold">&#9632; cold</span><span class="rehost">&#9632; rehost</span></div></div></div>'
        "</section>"
    )


def render_status_page(targets: list[tuple[TargetSnapshot, list[dict[str, Any]]]], secrets: list[str]) -> str:
    body = "".join(_target(s, h, secrets) for s, h in targets) or '<p class="empty">no targets configured</p>'
    now = dt.datetime.now(tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        '<meta http-equiv="refresh" content="30"><title>hicache-canary</title>'
        f"<style>{CSS}</style></head><body>"
        f"<h1>hicache-canary</h1><div class=\"sub\">HiCache reuse canaries &middot; {escape(now)} &middot; "
        f'v{escape(__version__)} &middot; <a href="/metrics">metrics</a> &middot; <a href="/api/targets">api</a></div>'
        f"{body}</body></html>"
    )
