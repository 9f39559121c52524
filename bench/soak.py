"""Soak: 1,000 probes through the real exporter process against a fast simulator, faults mixed in.

The exporter (`hicache-canary serve`) and the simulator (`hicache-canary sim`, write_back, tiny pools
and time scale so a probe costs a dozen cheap HTTP calls) run as their own processes on 127.0.0.1.
Probes are started one after another with `POST /api/probe/<target>` (the scheduler's interval is
an hour, so every probe is one we asked for); each is awaited on `hicache_canary_probes_total` and
its record read once from `/api/targets/<target>`. Before
some probes a fault is switched on in the simulator (`/_sim/faults`: 5xx, 429, malformed JSON, a
reply slower than the request timeout, metric families missing) or the simulator restarts
(`/_sim/restart`), and switched off after.

Measured on the exporter process and its probe worker, summed: RSS (`VmRSS` in /proc/<pid>/status),
open file descriptors (entries of /proc/<pid>/fd) and the number of series on `/metrics` (label cardinality). A table at
the start (after one warm-up probe), at 25/50/75/100 %, and the slope per 100 probes from 25 % on
(the first quarter includes imports and caches warming up). Exit 1 when a resource kept growing:
file descriptors up by more than 5, series up at all, RSS up by more than 10 MB from 25 % to the end,
or a probe without a fault did not end `reused`.

    python bench/soak.py               # 1,000 probes, a few minutes on 2 cores
    python bench/soak.py --probes 30   # smoke run
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TOKEN = "soak-probe-token"
SIM_FLAGS = ("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--hicache-write-policy", "write_back",
             "--max-total-tokens", "2000", "--hicache-host-tokens", "4000", "--chunked-prefill-size", "8192",
             "--time-scale", "0.0005")
REQUEST_TIMEOUT_S = 0.3
# One fault every few probes, cycling; None is a clean probe. Each fault: (name, switch or "restart", verdict, reason)
FAULTS = [
    ("5xx", {"rate_5xx": 1.0}, "error", "http_5xx"),
    ("malformed_json", {"malformed_json": True}, "error", "bad_response"),
    ("slow_past_timeout", {"slow_s": 0.5}, "error", "timeout"),
    ("429", {"rate_429": 1.0}, "error", "rate_limited"),
    ("metrics_missing", {"metrics_missing": True}, "reused", None),
    ("restart", "restart", "reused", None),
]
CLEAR = {"down_after": None, "rate_5xx": 0.0, "rate_429": 0.0, "slow_s": 0.0, "malformed_json": False, "metrics_missing": False}
FAULT_EVERY = 3  # probe i gets a fault when i % FAULT_EVERY == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        self._fh = open(log, "wb")
        self.popen = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                      cwd=REPO, start_new_session=True)

    def wait_http(self, url: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise SystemExit(f"{self.popen.args[3]} exited:\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise SystemExit(f"{url} not ready after {timeout}s")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._fh.close()


@dataclass(frozen=True)
class Sample:
    probes: int
    elapsed_s: float
    rss_mb: float
    fds: int
    series: int


def tree(pid: int) -> list[int]:
    """The exporter and its children (the probe worker process)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def measure(pid: int, exporter: str, probes: int, t0: float) -> Sample:
    rss_kb = fds = 0
    for p in tree(pid):
        rss_kb += next(int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines() if line.startswith("VmRSS:"))
        fds += len(os.listdir(f"/proc/{p}/fd"))
    text = httpx.get(exporter + "/metrics", timeout=10).text
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return Sample(probes, time.monotonic() - t0, rss_kb / 1024, fds, series)


def slope(samples: list[Sample], attr: str) -> float:
    """Least-squares growth of `attr` per 100 probes."""
    xs = [s.probes for s in samples]
    ys = [getattr(s, attr) for s in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


class Soak:
    def __init__(self, sim: str, exporter: str):
        self.sim, self.exporter = sim, exporter
        self.http = httpx.Client(timeout=10)

    def probes_done(self) -> float:
        """Probes finished so far, from /metrics: cheap to poll (the exporter caches its rendering),
        unlike /api/targets, which serializes the whole history and would compete with the probe."""
        text = self.http.get(self.exporter + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("hicache_canary_probes_total{"))

    def probe(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        before = self.probes_done()
        while True:
            r = self.http.post(self.exporter + "/api/probe/sim", headers={"Authorization": f"Bearer {TOKEN}"})
            if r.status_code == 202:
                break
            if r.status_code != 409 or time.monotonic() > deadline:
                raise SystemExit(f"POST /api/probe/sim: {r.status_code} {r.text}")
            time.sleep(0.03)
        while time.monotonic() < deadline:
            if self.probes_done() > before:
                return self.http.get(self.exporter + "/api/targets/sim").json()["last"]
            time.sleep(0.03)
        raise SystemExit(f"a probe did not finish within {timeout}s")

    def fault(self, switch) -> None:
        if switch == "restart":
            self.http.post(self.sim + "/_sim/restart", json={"args": []}).raise_for_status()
        else:
            self.http.post(self.sim + "/_sim/faults", json=switch).raise_for_status()

    def clear(self) -> None:
        self.http.post(self.sim + "/_sim/faults", json=CLEAR).raise_for_status()


def run(n: int) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="hicache-soak-"))
    py = [sys.executable, "-m", "hicache_canary"]
    sim_port, exp_port = free_port(), free_port()
    sim_url, exp_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{exp_port}"
    (tmp / "exporter.yml").write_text(
        "probe_api_token_env: SOAK_TOKEN\nhistory_limit: 100\ntargets:\n"
        f"  - {{name: sim, url: '{sim_url}', interval: 1h, context_tokens: 512, pressure_chunk_tokens: 4096,\n"
        f"     request_timeout: {REQUEST_TIMEOUT_S}s, poll_interval: 10ms, passive_wait: 0, token_budget_per_hour: 1000000000}}\n"
    )
    sim = Child([*py, "sim", "--host", "127.0.0.1", "--port", str(sim_port), *SIM_FLAGS], tmp / "sim.log")
    exporter = Child([*py, "serve", "--config", str(tmp / "exporter.yml"), "--host", "127.0.0.1", "--port", str(exp_port),
                      "--log-level", "warning"], tmp / "exporter.log", env={"SOAK_TOKEN": TOKEN})
    try:
        sim.wait_http(sim_url + "/health")
        exporter.wait_http(exp_url + "/healthz")
        soak = Soak(sim_url, exp_url)
        pid = exporter.popen.pid
        t0 = time.monotonic()
        soak.probe()  # warm-up: imports, first scrape, first history entry
        checkpoints = {max(1, round(n * q)) for q in (0.25, 0.5, 0.75, 1.0)}
        every = max(1, n // 40)
        samples = [measure(pid, exp_url, 0, t0)]
        marks = [samples[0]]
        verdicts: Counter[str] = Counter()
        wrong: list[str] = []
        for i in range(1, n + 1):
            f = FAULTS[(i // FAULT_EVERY) % len(FAULTS)] if i % FAULT_EVERY == 1 else None
            if f is not None:
                soak.fault(f[1])
            rec = soak.probe()
            if f is not None and f[1] != "restart":
                soak.clear()
            verdicts[rec["verdict"] + (f" ({rec['reason']})" if rec["reason"] else "")] += 1
            ok = {(f[2], f[3]) if f else ("reused", None)}
            if f is not None and f[1] == "restart":
                # Seen about once in 100 restarts: the probe right after one still reads counters going
                # back and says so. Conservative (an error, never a wrong verdict); cause not yet found.
                ok.add(("error", "server_restarted"))
            if (rec["verdict"], rec["reason"]) not in ok:
                wrong.append(f"probe {i} ({f[0] if f else 'no fault'}): {rec['verdict']} {rec['reason']}: {rec['evidence']}")
            if i % every == 0 or i in checkpoints:
                samples.append(measure(pid, exp_url, i, t0))
                if i in checkpoints:
                    marks.append(samples[-1])
        return report(n, marks, samples, verdicts, wrong, time.monotonic() - t0)
    finally:
        exporter.stop()
        sim.stop()


def report(n: int, marks: list[Sample], samples: list[Sample], verdicts: Counter, wrong: list[str], wall: float) -> int:
    print(f"soak: {n} probes through the exporter process in {wall:.0f} s ({wall / max(n, 1) * 1000:.0f} ms/probe)")
    print(f"{'point':>6} {'probes':>7} {'elapsed s':>10} {'RSS MB':>8} {'fds':>5} {'series':>7}")
    names = ["start", "25%", "50%", "75%", "100%"]
    for name, s in zip(names, marks):
        print(f"{name:>6} {s.probes:>7} {s.elapsed_s:>10.1f} {s.rss_mb:>8.1f} {s.fds:>5} {s.series:>7}")
    tail = [s for s in samples if s.probes >= n * 0.25] or samples
    print(f"{'slope':>6} {'/100':>7} {'':>10} {slope(tail, 'rss_mb'):>+8.2f} {slope(tail, 'fds'):>+5.2f} {slope(tail, 'series'):>+7.2f}"
          "   (least squares from 25 %, per 100 probes)")
    print("verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items(), key=lambda kv: -kv[1])))
    q, end = marks[1] if len(marks) > 1 else marks[0], marks[-1]
    problems = []
    if end.fds - q.fds > 5:
        problems.append(f"open file descriptors grew from {q.fds} to {end.fds}")
    if max(s.series for s in samples) > max(s.series for s in samples[:2]):
        problems.append(f"series grew from {samples[1].series} to {max(s.series for s in samples)}")
    if end.rss_mb - q.rss_mb > 10:
        problems.append(f"RSS grew by {end.rss_mb - q.rss_mb:.1f} MB from 25 %")
    problems += wrong[:10]
    for p in problems:
        print("FAIL: " + p)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=1000, help="probes to run (default 1000)")
    args = ap.parse_args(argv)
    if args.probes < 1:
        ap.error("--probes must be at least 1")
    return run(args.probes)


if __name__ == "__main__":
    sys.exit(main())
