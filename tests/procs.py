"""Start real processes on 127.0.0.1 for tests, and always stop them.

Integration tests use these instead of in-process fakes: the simulator, the exporter, Prometheus
and Alertmanager each run as their own process and talk real HTTP.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hicache_canary.simulator.launch import SimProcess, free_port, stop_process_group
from hicache_canary.simulator.launch import start as start_sim

__all__ = ["ARTIFACTS", "REPO", "Proc", "SimProcess", "canary_argv", "free_port", "require_binary", "start_simulator"]

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"


def require_binary(name: str) -> str:
    """Path of a real component; in CI (or under scripts/test) a missing one fails, never skips."""
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("CI") or os.environ.get("HICACHE_CANARY_REQUIRE_REAL"):
        pytest.fail(f"{name} is not installed; scripts/test installs it (CI must not skip)")
    pytest.skip(f"{name} not installed (outside CI only; scripts/test installs it)")  # CI fails above
    raise AssertionError  # unreachable


class Proc:
    """A child process with its output in a log file under test-artifacts/."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None):
        self.name = name
        self.log_path = artifact_log(name)
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd or REPO,
            start_new_session=True,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 30.0, ok=lambda r: r.status_code < 500) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-3000:]}")
            try:
                r = httpx.get(url, timeout=2)
                if ok(r):
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout}s ({last}):\n{self.log()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        stop_process_group(self.popen, sig, timeout)
        self._log.close()
        return self.popen.returncode


def canary_argv(*args: str) -> list[str]:
    """Run the installed package's CLI with this interpreter (works from a venv or not)."""
    return [sys.executable, "-m", "hicache_canary", *args]


def artifact_log(name: str) -> Path:
    """A fresh log path under test-artifacts/ (CI uploads the folder when a test fails)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS / f"{name}-{os.getpid()}-{int(time.time() * 1000)}.log"


def start_simulator(*flags: str, port: int | None = None, name: str = "sim", time_scale: float = 0.001) -> tuple[SimProcess, str]:
    """The simulator answering /health, through the launcher demo and bench use; its log kept as an artifact."""
    sim = start_sim(flags, ports=[port] if port else (), time_scale=time_scale, name=name, log_path=artifact_log(name))
    return sim, sim.url


def wait_for(cond, timeout: float, what: str, every: float = 0.05, proc=None):
    """Poll `cond` until it returns something true (returned) or `timeout` seconds pass (AssertionError
    naming `what`, the last value, and the tail of `proc`'s log when given)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(every)
    tail = f"\n{proc.log()[-3000:]}" if proc is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r}){tail}")
