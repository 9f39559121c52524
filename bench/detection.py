"""How fast a silent server pages, and how fast the page resolves, through real Prometheus and Alertmanager.

    python bench/detection.py            # shipped probe interval 15m scaled 60x to 15 s, 3 servers (~7-9 min)
    python bench/detection.py --quick    # interval scaled 300x to 3 s, 2 servers, fast Alertmanager only (~2 min)

The stack is the end-to-end tests' (tests/e2e_stack.py), all real processes on 127.0.0.1: simulated
SGLang servers (hybrid GDN model, HiCache on), `hicache-canary serve` probing each one every
interval, watching for restarts between probes (the shipped watch_interval 30s and
restart_probe_delay 60s scaled like the interval) and confirming a first `silent` after the shipped
confirm_after (60s) scaled the same way, Prometheus (1 s scrape and evaluation) with the shipped rule files unchanged, and two
Alertmanagers fed by that Prometheus: the shipped config (pager group_wait 10s, group_interval 1m)
and the same with group_interval 2s, each posting to a webhook receiver in this script.

Per server: it starts healthy (write_back) and proves it (one `reused` probe). Then it is restarted in
place with `--hicache-write-policy write_through` (the field report's silent configuration), and we
time until HiCacheSilent's page reaches each pager webhook; then restarted with write_back again,
and we time until the `resolved` notification. The rules' `for:` are not scaled (1m for
HiCacheSilent), so the design target "one probe interval plus the alert's for:" is computed from the
scaled interval and the shipped for:.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO / "tests", REPO / "exporter", REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import yaml  # noqa: E402

from _common import table  # noqa: E402

SHIPPED_INTERVAL_S = 900.0  # config.BUILTIN["interval"] and deploy/hicache-canary.yml: 15m
SHIPPED_CONFIRM_S = 60.0  # config.BUILTIN["confirm_after"]
SHIPPED_WATCH_S = 30.0  # config.BUILTIN["watch_interval"]
SHIPPED_RESTART_DELAY_S = 60.0  # config.BUILTIN["restart_probe_delay"]
FULL = dict(scale=60, servers=3, shipped_am=True)
QUICK = dict(scale=300, servers=2, shipped_am=False)
FAST_AM = "fast"
SHIPPED_AM = "shipped"
PAGER_SECRET = "pager_webhook_url"


def rule_for_seconds(alert: str) -> float:
    from hicache_canary.settings.config import parse_duration

    for path in sorted((REPO / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == alert:
                    return parse_duration(rule.get("for", "0s"), allow_zero=True)
    raise SystemExit(f"detection: alert {alert} not found in prometheus/rules/")


@dataclass
class Timing:
    target: str
    silent_at: float = 0.0
    fixed_at: float = 0.0
    paged: dict[str, float] = field(default_factory=dict)  # alertmanager name -> monotonic
    resolved: dict[str, float] = field(default_factory=dict)
    reused_after_fix: float | None = None
    firing_at: float | None = None  # HiCacheSilent firing in Prometheus (ALERTS), polled


def pager_path(am: str) -> str:
    return f"/{am}/{PAGER_SECRET}"


def first_notification(stack, path: str, target: str, status: str, after: float) -> float | None:
    got = stack.notifications(path, alertname="HiCacheSilent", target=target, status=status, after=after)
    return got[0][1] if got else None


def wait_all(stack, timings: list[Timing], ams: list[str], status: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pending = 0
        for t in timings:
            if status == "firing" and t.firing_at is None and stack.query(
                f'ALERTS{{alertname="HiCacheSilent",alertstate="firing",target="{t.target}"}}'
            ):
                t.firing_at = time.monotonic()
            store = t.paged if status == "firing" else t.resolved
            after = t.silent_at if status == "firing" else t.fixed_at
            for am in ams:
                if am not in store:
                    at = first_notification(stack, pager_path(am), t.target, status, after)
                    if at is None:
                        pending += 1
                    else:
                        store[am] = at
        if not pending:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"detection: {pending} {status} notification(s) did not arrive within {timeout:.0f} s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: interval scaled 300x, 2 servers, fast Alertmanager only")
    args = ap.parse_args(argv)
    for binary in ("prometheus", "prometheus-alertmanager"):
        if shutil.which(binary) is None:
            raise SystemExit(f"detection: {binary} is not installed (scripts/test installs it from Debian)")
    from e2e_stack import SimSpec, start_e2e_stack

    mode = QUICK if args.quick else FULL
    interval = SHIPPED_INTERVAL_S / mode["scale"]
    confirm = SHIPPED_CONFIRM_S / mode["scale"]
    watch = SHIPPED_WATCH_S / mode["scale"]
    restart_delay = SHIPPED_RESTART_DELAY_S / mode["scale"]
    for_s = rule_for_seconds("HiCacheSilent")
    target_s = interval + for_s
    ams = [FAST_AM] + ([SHIPPED_AM] if mode["shipped_am"] else [])
    specs = [SimSpec(f"bench-{i}", ("--hicache-write-policy", "write_back"), interval=f"{interval:g}s") for i in range(mode["servers"])]
    print(f"probe interval {SHIPPED_INTERVAL_S / 60:.0f}m scaled {mode['scale']}x to {interval:g} s, confirm_after "
          f"{SHIPPED_CONFIRM_S:g}s to {confirm:g} s, watch_interval {SHIPPED_WATCH_S:g}s to {watch:g} s, "
          f"restart_probe_delay {SHIPPED_RESTART_DELAY_S:g}s to {restart_delay:g} s; HiCacheSilent for: "
          f"{for_s:g} s (shipped, unscaled); target: interval + for = {target_s:g} s; {len(specs)} servers; "
          f"Alertmanagers: {', '.join(ams)}", flush=True)
    stack = start_e2e_stack(
        specs, am_group_interval=None, extra_alertmanagers={FAST_AM: "2s", **({SHIPPED_AM: None} if mode["shipped_am"] else {})},
        confirm_after=f"{confirm:g}s",
        watch={"watch_interval": f"{watch:g}s", "restart_probe_delay": f"{restart_delay:g}s"},
    )
    try:
        for s in specs:  # healthy first: each server has proved reuse once
            stack.wait_value(f'max_over_time(hicache_canary_verdict{{target="{s.name}",verdict="reused"}}[1h])', lambda v: v == 1,
                             3 * interval + 60, f"{s.name} reused")
        timings = [Timing(s.name) for s in specs]
        for t in timings:
            t.silent_at = stack.restart_sim(t.target, "--hicache-write-policy", "write_through")
        print("servers restarted silent (write_through); waiting for the pages", flush=True)
        wait_all(stack, timings, ams, "firing", 4 * interval + for_s + 120)
        for t in timings:
            t.fixed_at = stack.restart_sim(t.target, "--hicache-write-policy", "write_back")
        print("servers restarted healthy (write_back); waiting for the resolved notifications", flush=True)
        deadline = time.monotonic() + 4 * interval + 60
        for t in timings:
            stack.wait_value(f'hicache_canary_verdict{{target="{t.target}",verdict="reused"}}', lambda v: v == 1,
                             max(1.0, deadline - time.monotonic()), f"{t.target} reused again")
            t.reused_after_fix = time.monotonic() - t.fixed_at  # upper bound: polled in target order
        wait_all(stack, timings, ams, "resolved", 2 * interval + 360)
    finally:
        stack.stop()

    rows = []
    for am in ams:
        for t in timings:
            detect = t.paged[am] - t.silent_at
            resolve = t.resolved[am] - t.fixed_at
            firing = (t.firing_at or t.paged[am]) - t.silent_at
            rows.append([t.target, am, f"{firing:.1f}", f"{(firing - for_s) / interval:.2f}", f"{detect:.1f}",
                         f"{detect / target_s:.2f}", f"{resolve:.1f}", f"{t.reused_after_fix:.1f}"])
    print()
    print(table(["server", "alertmanager", "silent up -> firing in Prometheus (s)", "(firing - for) / interval",
                 "silent up -> page (s)", "page / (interval + for)", "healthy again -> resolved (s)",
                 "healthy again -> reused verdict (s)"], rows))
    for am in ams:
        d = [t.paged[am] - t.silent_at for t in timings]
        r = [t.resolved[am] - t.fixed_at for t in timings]
        print(f"{am}: detection median {statistics.median(d):.1f} s (max {max(d):.1f}), target {target_s:g} s "
              f"({'met' if max(d) <= target_s else 'missed'}); resolution median {statistics.median(r):.1f} s (max {max(r):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
