"""One exporter, 200 targets: /metrics size, scrape latency under 20 scrapers while probes run,
memory, CPU, and how far apart probe starts are.

    python bench/fleet.py                  # ~2 min: 200 targets, 20 s measuring windows
    python bench/fleet.py --targets 50 --seconds 10
    python bench/fleet.py --quick          # smoke run: 20 targets, 3 s windows

Runs `hicache-canary sim --ports` (200 independent simulated servers in one process; write_back,
so every probe is a quick `reused`) and `hicache-canary serve` as its own process with those
servers in a Prometheus file_sd file (discovery.file_sd), `probe_spacing: 1s` and
`max_concurrent_probes: 4`. Probes run during the whole measurement: the first of each target is
due within 30 s of the start, and the spacing lets one start per second. Scrapers send
Prometheus' headers (OpenMetrics, gzip). Memory is the exporter's process tree (the serving
process and its probe worker): RSS summed, and PSS (shared pages counted once, what a container's
memory limit sees). Targets (design.md section 7): scrape p99 < 10 ms, memory < 150 MB, probe
starts a spacing apart (no gap under 0.8 s: the slots are exact, the start stamp may be late by
the worker's wake-up). Exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SimServer, launch
from exporter_overhead import ENV, ProcStats, free_port, get, pct, scrape_storm, wait

SPACING = 1.0
CAP = 4


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def starts(base: str) -> list[float]:
    """Every probe start the exporter remembers (its /api/targets history), sorted."""
    _, text = get(base + "/api/targets")
    out = []
    for t in json.loads(text)["targets"]:
        out += [h["started_at"] for h in t["history"] if h.get("started_at") and h.get("verdict") not in ("skipped_budget",)]
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each measuring window")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between two scrapes of one scraper")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 targets, 3 s windows")
    args = ap.parse_args()
    if args.quick:
        args.targets, args.seconds = 20, 3.0

    tmp = Path(tempfile.mkdtemp(prefix="hicache-fleet-"))
    ports = free_ports(args.targets)
    exp_port = free_port()
    sd = tmp / "sglang.json"
    sd.write_text(json.dumps([{"targets": [f"127.0.0.1:{p}" for p in ports]}]))
    cfg = tmp / "exporter.yml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {exp_port}}}\n"
        "defaults: {interval: 1h, context_tokens: 4096, poll_interval: 0.5s, passive_wait: 1s, watch_interval: 30s}\n"
        f"probe_spacing: {SPACING}s\nmax_concurrent_probes: {CAP}\n"
        f"discovery:\n  file_sd: {{enabled: true, files: ['{sd}'], refresh: 30s}}\n")
    exp = sim = None
    try:
        sim = SimServer(["--time-scale", "0.02", "--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
                         "--enable-metrics", "--max-total-tokens", "40000", "--hicache-host-tokens", "200000"],
                        ready_timeout_s=120, ports=ports, log_path=tmp / "sim.log", name="simulators")
        t_start = time.time()
        exp = subprocess.Popen([sys.executable, "-m", "hicache_canary", "serve", "--config", str(cfg)], env=ENV,
                               stdout=open(os.environ.get("BENCH_EXPORTER_LOG", tmp / "exporter.log"), "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{exp_port}"
        wait(lambda: get(base + "/healthz")[0] == 200, 60, "the exporter")
        wait(lambda: len(json.loads(get(base + "/api/targets")[1])["targets"]) == args.targets, 60, "every target discovered")
        stats = ProcStats(exp.pid)
        wait(lambda: len(starts(base)) >= 5, 120, "the first probes")

        c0, w0 = stats.cpu_s(), time.monotonic()
        lat = asyncio.run(scrape_storm(exp_port, args.seconds, args.every))
        cpu = (stats.cpu_s() - c0) / (time.monotonic() - w0) * 100
        sat = asyncio.run(scrape_storm(exp_port, args.seconds / 2, None))
        c0, w0 = stats.cpu_s(), time.monotonic()
        time.sleep(min(10.0, args.seconds))
        quiet_cpu = (stats.cpu_s() - c0) / (time.monotonic() - w0) * 100
        rss, pss, serving = stats.rss_mb(), stats.pss_mb(), stats.rss_mb(exp.pid)

        _, text = get(base + "/metrics")
        import gzip
        import urllib.request

        req = urllib.request.Request(base + "/metrics", headers={"Accept-Encoding": "gzip", "Accept": "application/openmetrics-text;version=1.0.0"})
        with urllib.request.urlopen(req, timeout=10) as r:
            zipped = len(r.read())
        s = starts(base)
        s = [x for x in s if x >= t_start]
        gaps = [b - a for a, b in zip(s, s[1:])]
        # Slots are exactly SPACING apart; the canary stamps its start when the worker's event loop
        # wakes for the slot, which another probe's parsing can delay by a little: allow a fifth.
        close = sum(g < SPACING * 0.8 for g in gaps)
        same_second = sum(int(a) == int(b) for a, b in zip(s, s[1:]))
        probes_done = sum(1 for _ in s)
        elapsed = time.time() - t_start

        p99 = pct(lat, 0.99)
        print(f"{args.targets} targets (one `sim --ports` process), probe_spacing {SPACING:g} s, max_concurrent_probes {CAP}; "
              f"20 scrapers each every {args.every:g} s for {args.seconds:g} s, then 20 back to back for {args.seconds / 2:g} s\n")
        rows = [
            ("/metrics size", f"{len(text.encode()) / 1e6:.2f} MB ({text.count(chr(10))} lines); gzip {zipped / 1e3:.0f} kB"),
            ("scrape p50 / p99 / max, 20 scrapers", f"{pct(lat, 0.5):.2f} / {p99:.2f} / {max(lat) * 1000:.2f} ms ({len(lat)} scrapes)"),
            ("saturated: scrapes/s, p50 / p99", f"{len(sat) / (args.seconds / 2):.0f}/s, {pct(sat, 0.5):.2f} / {pct(sat, 0.99):.2f} ms"),
            ("memory: RSS (serving + worker) / PSS", f"{rss:.1f} MB ({serving:.1f} + {rss - serving:.1f}) / {pss:.1f} MB"),
            ("CPU while scraped / not scraped", f"{cpu:.1f} % / {quiet_cpu:.1f} % of one core"),
            ("probe starts", f"{probes_done} in {elapsed:.0f} s; min gap {min(gaps) if gaps else float('nan'):.3f} s; "
                             f"gaps under {SPACING * 0.8:g} s: {close}; pairs in the same wall-clock second: {same_second}"),
        ]
        w = max(len(k) for k, _ in rows)
        print(f"| {'measure':<{w}} | value |\n|{'-' * (w + 2)}|-------|")
        for k, v in rows:
            print(f"| {k:<{w}} | {v} |")
        mem_ok, lat_ok, spread_ok = pss < 150, p99 < 10, close == 0 and bool(gaps)
        print(f"\ntargets: scrape p99 {p99:.2f} ms (< 10) {'ok' if lat_ok else 'MISSED'}; memory PSS {pss:.1f} MB (< 150) "
              f"{'ok' if mem_ok else 'MISSED'}; probe starts {SPACING:g} s apart (min gap >= {SPACING * 0.8:g} s) {'ok' if spread_ok else 'MISSED'}")
        return 0 if (mem_ok and lat_ok and spread_ok) else 1
    finally:
        if exp is not None:
            launch.stop_process_group(exp, timeout_s=15)
        if sim is not None:
            sim.stop(timeout_s=15)


if __name__ == "__main__":
    sys.exit(main())
