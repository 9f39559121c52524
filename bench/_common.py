"""Shared plumbing for the benchmarks in bench/: metering, simulators, settings, tables.

Cost is metered client side, per request, from what SGLang answers (`prompt_tokens` and
`cached_tokens_details`): prefill tokens are the prompt tokens no tier served, and simulated
GPU-seconds are the simulator's own latency model (`simulator.engine.request_seconds`, the function
its scheduler sleeps on) evaluated at time scale 1, so a benchmark can run at a tiny time scale and
still report what the probe would have cost the report's GPU. Metering per request (rather than
reading the simulator's busy-time counter) is what lets a benchmark attribute cost to the canary
alone while the server's own background traffic shares the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A fresh checkout runs `python bench/<name>.py` without `pip install -e .` first.
if str(REPO / "exporter") not in sys.path:
    sys.path.insert(0, str(REPO / "exporter"))

import httpx  # noqa: E402

from hicache_canary.models import GenerateResult, ProbeSettings  # noqa: E402
from hicache_canary.probe.sglang_client import SGLangClient  # noqa: E402
from hicache_canary.simulator import launch  # noqa: E402
from hicache_canary.simulator.engine import PREFILL_S_PER_TOKEN, request_seconds  # noqa: E402

__all__ = ["PREFILL_S_PER_TOKEN", "REPO", "Cost", "MeteredClient", "Sent", "SimServer", "in_process_sim",
           "scaled_settings", "sim_config", "table"]


@dataclass(frozen=True)
class Sent:
    """One request as the server answered it."""

    prompt: int
    device: int
    host: int
    completion: int

    @property
    def prefill(self) -> int:
        return max(0, self.prompt - self.device - self.host)

    @property
    def gpu_s(self) -> float:
        return request_seconds(self.prefill, self.host, self.completion)

    @classmethod
    def of(cls, res: GenerateResult) -> Sent:
        d = res.details
        device, host = (d.device, d.host) if d is not None else (res.cached_tokens or 0, 0)
        return cls(res.prompt_tokens, device, host, res.completion_tokens)


@dataclass(frozen=True)
class Cost:
    requests: int = 0
    prompt: int = 0
    prefill: int = 0
    gpu_s: float = 0.0

    @classmethod
    def of(cls, sent: list[Sent]) -> Cost:
        return cls(len(sent), sum(s.prompt for s in sent), sum(s.prefill for s in sent), sum(s.gpu_s for s in sent))

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.requests + other.requests, self.prompt + other.prompt, self.prefill + other.prefill,
                    self.gpu_s + other.gpu_s)

    def per(self, n: int) -> Cost:
        return Cost(round(self.requests / n), round(self.prompt / n), round(self.prefill / n), self.gpu_s / n)


class MeteredClient(SGLangClient):
    """SGLangClient that remembers every generate/completion answer, so callers can price them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[Sent] = []

    async def generate(self, *args, **kwargs) -> GenerateResult:
        res = await super().generate(*args, **kwargs)
        self.sent.append(Sent.of(res))
        return res

    async def completion(self, *args, **kwargs) -> GenerateResult:
        res = await super().completion(*args, **kwargs)
        self.sent.append(Sent.of(res))
        return res

    def mark(self) -> int:
        return len(self.sent)

    def since(self, mark: int) -> list[Sent]:
        return self.sent[mark:]


def scaled_settings(time_scale: float, **kw) -> ProbeSettings:
    """ProbeSettings whose clock-based knobs are the shipped defaults in simulated seconds.

    The canary waits in wall seconds; the simulator runs `time_scale` wall seconds per simulated
    second, so poll interval, passive wait and the cold-latency floor shrink with it. Request
    timeouts stay in wall seconds: they only guard against a hung process.
    """
    base = ProbeSettings(target="sim")
    s = replace(base, poll_interval_s=base.poll_interval_s * time_scale, passive_wait_s=base.passive_wait_s * time_scale,
                min_cold_latency_s=base.min_cold_latency_s * time_scale, timeout_s=60.0)
    for key in ("passive_wait_s", "poll_interval_s", "min_cold_latency_s"):
        if key in kw:  # given in simulated seconds
            kw[key] = kw[key] * time_scale
    return replace(s, **kw)


def sim_config(flags: list[str]):
    """A SimConfig from `hicache-canary sim` launch flags (the simulator's own parser)."""
    from hicache_canary.simulator.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser(prog="hicache-canary sim", add_help=False)
    add_arguments(parser)
    return config_from_args(parser.parse_args(flags))


@contextlib.asynccontextmanager
async def in_process_sim(flags: list[str]) -> AsyncIterator[tuple[MeteredClient, object]]:
    """The simulator app in this event loop, reached through httpx's ASGI transport (no sockets).

    ASGITransport does not run the app's lifespan, so the background load generator is started and
    stopped here by hand. Yields (client, the simulator's state object).
    """
    from hicache_canary.simulator.app import create_app

    app = create_app(sim_config(flags))
    sim = app.state.sim
    sim.start()
    client = MeteredClient("http://sim.invalid", transport=httpx.ASGITransport(app=app))
    try:
        yield client, sim
    finally:
        await client.aclose()
        await sim.stop()


# The simulator child imports this checkout's package too, installed or not.
CHILD_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "exporter"), os.environ.get("PYTHONPATH")]))}


def SimServer(flags: list[str], ready_timeout_s: float = 30.0, **kw) -> launch.SimProcess:  # noqa: N802 (callers' name)
    """`hicache-canary sim` as its own process on 127.0.0.1, answering /health; use as a context manager."""
    return launch.start(flags, timeout_s=ready_timeout_s, env=CHILD_ENV, **kw)


def table(headers: list[str], rows: list[list[object]], right: set[int] | None = None) -> str:
    """A Markdown table (readable in a terminal and pasteable into docs/benchmarks.md)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = right or set()

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def fmt_int(n: float) -> str:
    return f"{round(n):,}"
