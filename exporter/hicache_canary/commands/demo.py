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
import sys
import time

from hicache_canary.models import ProbeRecord, Verdict
from hicache_canary.commands.probe_cli import _usage_error, add_probe_options, load_key, positive_float, probe_once, settings_from_args, target_url
from hicache_canary.shown import display_url
from hicache_canary.simulator.launch import START_TIMEOUT_S, SimProcess

DEMO_TIME_SCALE = 0.2
DEMO_CONTEXT_TOKENS = 8192
SCALED_REPORT_FLAGS = (
    "--enable-hierarchical-cache", "--hybrid-model", "--enable-metrics", "--enable-cache-report",
    "--max-total-tokens", "40000", "--hicache-host-tokens", "70958", "--chunked-prefill-size", "4096",
)
POLICIES = ("write_through", "write_back")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.error = _usage_error(p.prog)  # type: ignore[method-assign]
    p.add_argument("--target", type=target_url, default=None, help="probe this SGLang server instead of two simulators")
    add_probe_options(p)
    p.set_defaults(poll_interval=0.2)
    # --context-tokens keeps its own default here: the demo's R is sized for the scaled-down server.
    p.add_argument("--time-scale", type=positive_float, default=DEMO_TIME_SCALE,
                   help=f"simulators' latency scale (default {DEMO_TIME_SCALE}; 1 = calibrated to the report)")


def _probe(runner: asyncio.Runner, url: str, label: str, args: argparse.Namespace, key: str | None) -> ProbeRecord:
    from hicache_canary.commands.render import ProgressLine

    settings = settings_from_args(args, label)
    return runner.run(probe_once(url, settings, key, ProgressLine(sys.stderr, label=label)))


def run(args: argparse.Namespace) -> int:
    # One event loop, built before anything is printed: a Ctrl-C that lands while a loop is being
    # constructed leaves a half-built loop whose __del__ prints a traceback at exit.
    with asyncio.Runner() as runner:
        runner.get_loop()
        return _run(runner, args)


def _run(runner: asyncio.Runner, args: argparse.Namespace) -> int:
    from hicache_canary.commands.render import render_table, side_by_side

    if args.target:
        rec = _probe(runner, args.target, display_url(args.target), args, load_key(args))
        print(render_table(rec))
        return 3 if rec.verdict == Verdict.ERROR else 0
    if args.context_tokens is None:
        args.context_tokens = DEMO_CONTEXT_TOKENS
    sims: list[tuple[str, SimProcess]] = []
    try:
        sys.stderr.write(
            f"starting two simulated SGLang servers (hybrid model, device pool 40,000 / host pool 70,958 tokens, "
            f"the field report's server scaled down 10x) at time scale {args.time_scale} of the calibrated latencies\n"
        )
        for policy in POLICIES:
            flags = ["--hicache-write-policy", policy, *SCALED_REPORT_FLAGS]
            sims.append((policy, SimProcess(flags, time_scale=args.time_scale, name=f"{policy} simulator")))
        deadline = time.monotonic() + START_TIMEOUT_S  # both start at once: one wait covers them
        for policy, sim in sims:
            sim.wait_ready(START_TIMEOUT_S, deadline=deadline)
            sys.stderr.write(f"{policy} simulator at {sim.url}\n")
        records = [_probe(runner, sim.url, policy, args, None) for policy, sim in sims]
    except RuntimeError as exc:  # SimulatorStartError among them
        sys.stderr.write(f"hicache-canary demo: error: {exc}\n")
        return 3
    finally:
        for _, sim in sims:
            sim.stop(timeout_s=5)
    tables = [render_table(rec, width=60) for rec in records]
    print(side_by_side(*tables))
    verdicts = ", ".join(f"{rec.target}: {rec.verdict.value if rec.verdict else '?'}" for rec in records)
    print(f"\n{verdicts}. Same server, same model; only --hicache-write-policy differs.")
    return 0
