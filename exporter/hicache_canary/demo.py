"""`hicache-canary demo`: the field report's experiment on a machine without SGLang.

Starts two simulators on free 127.0.0.1 ports, both a hybrid (GDN/Mamba) model sized like the
report's server scaled down 10x (device pool 40,000 tokens, host pool 70,958 tokens, chunked
prefill 4096): one under the default `write_through` (with the simulator's default hybrid failure,
the Mamba state that never reaches host), one under `write_back`. Probes both with a live display,
prints the two tables side by side with their verdicts, and stops the simulators on the way out,
also on Ctrl-C or an error. R is 8192 tokens (longer than chunked_prefill_size, as in the report).

Simulated latencies run at DEMO_TIME_SCALE of the calibrated ones (40K cold = 15.4 s at scale 1)
so the demo takes well under 30 s; ratios are what matter and are unaffected.

With --target, probes that server instead (exit 3 only when the probe itself ended in error).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from .models import ProbeRecord, Verdict
from .probe_cli import _usage_error, add_probe_options, load_key, positive_float, probe_once, settings_from_args, target_url
from .shown import display_url

DEMO_TIME_SCALE = 0.2
DEMO_CONTEXT_TOKENS = 8192
SCALED_REPORT_FLAGS = (
    "--enable-hierarchical-cache", "--hybrid-model", "--enable-metrics", "--enable-cache-report",
    "--max-total-tokens", "40000", "--hicache-host-tokens", "70958", "--chunked-prefill-size", "4096",
)
POLICIES = ("write_through", "write_back")
START_TIMEOUT_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.error = _usage_error(p.prog)  # type: ignore[method-assign]
    p.add_argument("--target", type=target_url, default=None, help="probe this SGLang server instead of two simulators")
    add_probe_options(p)
    p.set_defaults(poll_interval=0.2)
    # --context-tokens keeps its own default here: the demo's R is sized for the scaled-down server.
    p.add_argument("--time-scale", type=positive_float, default=DEMO_TIME_SCALE,
                   help=f"simulators' latency scale (default {DEMO_TIME_SCALE}; 1 = calibrated to the report)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Simulator:
    """One `hicache-canary sim` child process; its log goes to a temp file shown if it fails."""

    def __init__(self, policy: str, time_scale: float):
        self.policy = policy
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        argv = [sys.executable, "-m", "hicache_canary", "sim", "--host", "127.0.0.1", "--port", str(self.port),
                "--hicache-write-policy", policy, "--time-scale", str(time_scale), *SCALED_REPORT_FLAGS]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.policy} simulator exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # polling a child's readiness against a deadline
        raise RuntimeError(f"the {self.policy} simulator did not answer /health within {START_TIMEOUT_S:.0f} s: {self.tail()}")

    def tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def _probe(runner: asyncio.Runner, url: str, label: str, args: argparse.Namespace, key: str | None) -> ProbeRecord:
    from .render import ProgressLine

    settings = settings_from_args(args, label)
    return runner.run(probe_once(url, settings, key, ProgressLine(sys.stderr, label=label)))


def run(args: argparse.Namespace) -> int:
    # One event loop, built before anything is printed: a Ctrl-C that lands while a loop is being
    # constructed leaves a half-built loop whose __del__ prints a traceback at exit.
    with asyncio.Runner() as runner:
        runner.get_loop()
        return _run(runner, args)


def _run(runner: asyncio.Runner, args: argparse.Namespace) -> int:
    from .render import render_table, side_by_side

    if args.target:
        rec = _probe(runner, args.target, display_url(args.target), args, load_key(args))
        print(render_table(rec))
        return 3 if rec.verdict == Verdict.ERROR else 0
    if args.context_tokens is None:
        args.context_tokens = DEMO_CONTEXT_TOKENS
    sims: list[Simulator] = []
    try:
        sys.stderr.write(
            f"starting two simulated SGLang servers (hybrid model, device pool 40,000 / host pool 70,958 tokens, "
            f"the field report's server scaled down 10x) at time scale {args.time_scale} of the calibrated latencies\n"
        )
        sims = [Simulator(policy, args.time_scale) for policy in POLICIES]
        deadline = time.monotonic() + START_TIMEOUT_S
        for sim in sims:
            sim.wait_ready(deadline)
            sys.stderr.write(f"{sim.policy} simulator at {sim.url}\n")
        records = [_probe(runner, sim.url, sim.policy, args, None) for sim in sims]
    except RuntimeError as exc:
        sys.stderr.write(f"hicache-canary demo: error: {exc}\n")
        return 3
    finally:
        for sim in sims:
            sim.stop()
    tables = [render_table(rec, width=60) for rec in records]
    print(side_by_side(*tables))
    verdicts = ", ".join(f"{rec.target}: {rec.verdict.value if rec.verdict else '?'}" for rec in records)
    print(f"\n{verdicts}. Same server, same model; only --hicache-write-policy differs.")
    return 0
