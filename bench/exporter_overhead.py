"""What the exporter costs while it works: /metrics latency under 20 concurrent scrapers during a
probe, and the exporter's RSS and CPU, idle and while probing.

    python bench/exporter_overhead.py              # ~1 min
    python bench/exporter_overhead.py --seconds 30 # longer measuring windows

Runs `hicache-canary sim` (hybrid, write_back, time scale 0.4 so one probe outlasts the measuring windows)
and `hicache-canary serve` as their own processes on 127.0.0.1. Scrapers are raw asyncio
connections sending Prometheus' own headers (OpenMetrics accept, gzip), so the client adds as
little as possible to what is measured. Memory and CPU are the exporter's process tree (the
serving process and its probe worker); the memory target is held to PSS (pages the two share
counted once, as a container's memory accounting does). Targets (design.md section 7): p99 < 10
ms, memory < 80 MB.
Exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "exporter") + os.pathsep + os.environ.get("PYTHONPATH", "")}
TOKEN = "bench-token-" + os.urandom(6).hex()
SCRAPE = (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/openmetrics-text;version=1.0.0,"
          b"text/plain;version=0.0.4;q=0.5\r\nAccept-Encoding: gzip\r\nUser-Agent: Prometheus/2.53\r\n\r\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, str]:
    import urllib.request

    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def metric(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


class ProcStats:
    """RSS and CPU seconds of one process and its children (the probe worker) from /proc."""

    def __init__(self, pid: int):
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def pids(self) -> list[int]:
        out = [self.pid]
        try:
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
        return out

    def rss_mb(self, pid: int | None = None) -> float:
        if pid is None:
            return sum(self.rss_mb(p) for p in self.pids())
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def pss_mb(self) -> float:
        """Proportional set size of the process tree: pages shared by the two processes (the
        interpreter, shared libraries) counted once, as a container's memory accounting does."""
        total = 0.0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) / 1024
            except OSError:
                pass
        return total

    def cpu_s(self) -> float:
        total = 0.0
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / self.tick
        return total


async def scraper(port: int, until: float, out: list[float], every: float | None, phase: float) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        next_at = time.perf_counter() + phase
        while time.perf_counter() < until:
            if every is not None:  # a Prometheus-like scraper: on its own schedule, not back to back
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                next_at += every
            t0 = time.perf_counter()
            writer.write(SCRAPE)
            head = await reader.readuntil(b"\r\n\r\n")
            lengths = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
            if lengths:
                await reader.readexactly(lengths[0])
            else:  # chunked, as prometheus_client's ASGI app answers
                while (size := int((await reader.readuntil(b"\r\n")).strip(), 16)) > 0:
                    await reader.readexactly(size + 2)
                await reader.readuntil(b"\r\n")
            out.append(time.perf_counter() - t0)
    finally:
        writer.close()


async def scrape_storm(port: int, seconds: float, every: float | None, n: int = 20) -> list[float]:
    """n concurrent scrapers; every=None: back to back (saturation), else each every `every` s."""
    import random

    out: list[float] = []
    until = time.perf_counter() + seconds
    rng = random.Random(7)
    await asyncio.gather(*(scraper(port, until, out, every, rng.uniform(0, every or 0)) for _ in range(n)))
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each measuring window")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between two scrapes of one scraper")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    sim_port, exp_port = free_port(), free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "hicache_canary", "sim", "--host", "127.0.0.1", "--port", str(sim_port), "--time-scale", "0.4",
         "--enable-hierarchical-cache", "--hicache-write-policy", "write_back", "--hybrid-model", "--enable-metrics",
         "--max-total-tokens", "80000", "--hicache-host-tokens", "400000"],
        env=ENV, stdout=open(tmp / "sim.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    cfg = tmp / "exporter.yml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {exp_port}}}\n"
        "defaults: {interval: 1h, context_tokens: 16384, poll_interval: 0.5s, passive_wait: 1s}\n"
        f"targets:\n  - {{name: bench, url: 'http://127.0.0.1:{sim_port}'}}\n")
    exp = None
    try:
        wait(lambda: get(f"http://127.0.0.1:{sim_port}/health")[0] == 200, 60, "the simulator")
        exp = subprocess.Popen([sys.executable, "-m", "hicache_canary", "serve", "--config", str(cfg)],
                               env={**ENV, "HICACHE_CANARY_API_TOKEN": TOKEN},
                               stdout=open(os.environ.get("BENCH_EXPORTER_LOG", tmp / "exporter.log"), "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{exp_port}"
        wait(lambda: get(base + "/healthz")[0] == 200, 60, "the exporter")
        stats = ProcStats(exp.pid)
        # the first probe runs at startup; wait for it, so the idle window is really idle
        wait(lambda: metric(get(base + "/metrics")[1], 'hicache_canary_probes_total{target="bench",verdict="reused"}') == 1,
             240, "the first probe")
        rows = []
        every = args.every

        def window(name: str) -> None:
            c0, t0 = stats.cpu_s(), time.monotonic()
            lat = asyncio.run(scrape_storm(exp_port, args.seconds, every))
            cpu = (stats.cpu_s() - c0) / (time.monotonic() - t0) * 100
            sat = asyncio.run(scrape_storm(exp_port, args.seconds / 2, None))
            rows.append((name, lat, sat, cpu, stats.rss_mb()))

        c0, t0 = stats.cpu_s(), time.monotonic()
        time.sleep(min(5.0, args.seconds))
        idle_cpu = (stats.cpu_s() - c0) / (time.monotonic() - t0) * 100
        window("idle")

        code, _ = get(base + "/api/probe/bench", {"Authorization": f"Bearer {TOKEN}"}, method="POST")
        assert code == 202, f"probe trigger answered {code}"
        wait(lambda: metric(get(base + "/metrics")[1], 'hicache_canary_probe_in_progress{target="bench"}') == 1, 30, "the probe")
        window("during a probe")
        if metric(get(base + "/metrics")[1], 'hicache_canary_probe_in_progress{target="bench"}') != 1:
            print("note: the probe ended before the last window did; use a larger --time-scale", file=sys.stderr)
        wait(lambda: metric(get(base + "/metrics")[1], 'hicache_canary_probes_total{target="bench",verdict="reused"}') == 2,
             240, "the second probe")
        peak = stats.rss_mb()

        print(f"20 scrapers, each every {every:g} s ({20 / every:.0f} scrapes/s; Prometheus' default is every 15 s), "
              f"{args.seconds:g} s per window; then 20 back-to-back scrapers (saturation) for {args.seconds / 2:g} s")
        print(f"{'phase':<16} {'scrapes':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} | {'saturated/s':>11} "
              f"{'p50 ms':>7} {'p99 ms':>7} | {'CPU %':>6} {'RSS MB':>7}")
        for name, lat, sat, cpu, rss in rows:
            print(f"{name:<16} {len(lat):>7} {pct(lat, 0.5):>7.2f} {pct(lat, 0.99):>7.2f} {max(lat) * 1000:>7.2f} | "
                  f"{len(sat) / (args.seconds / 2):>11.0f} {pct(sat, 0.5):>7.2f} {pct(sat, 0.99):>7.2f} | {cpu:>6.1f} {rss:>7.1f}")
        print(f"exporter CPU with no scrapes and no probe: {idle_cpu:.1f} %; RSS after two probes: {peak:.1f} MB "
              f"(serving process {stats.rss_mb(exp.pid):.1f} MB + probe worker {peak - stats.rss_mb(exp.pid):.1f} MB; "
              f"PSS of the two {stats.pss_mb():.1f} MB)")
        p99 = pct(rows[1][1], 0.99)
        pss = stats.pss_mb()
        ok = p99 < 10 and pss < 80
        print(f"targets: /metrics p99 during a probe {p99:.2f} ms (< 10) {'ok' if p99 < 10 else 'MISSED'}; "
              f"memory (PSS of the serving process and its probe worker) {pss:.1f} MB (< 80) {'ok' if pss < 80 else 'MISSED'}")
        _, text = get(base + "/metrics")
        print("\nsample /metrics (non-zero series of the target):")
        for line in text.splitlines():
            if line.startswith("hicache_canary_") and 'target="bench"' in line and not line.endswith(" 0.0") and "_bucket" not in line:
                print("  " + line)
        return 0 if ok else 1
    finally:
        for p in (exp, sim):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
