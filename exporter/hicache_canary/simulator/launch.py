"""Start `hicache-canary sim` as a child process and stop it: the one launcher behind `hicache-canary
demo`, the benchmarks in bench/ and the tests.

The child runs this interpreter (`sys.executable -m hicache_canary sim`) in its own session, so
stopping it signals its whole process group and nothing else. Its output goes to a log file whose
tail is quoted when it fails to start: a simulator that exits or never answers /health raises
`SimulatorStartError` within a bounded time, never hangs its caller.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class SimulatorStartError(RuntimeError):
    """The simulator exited, or did not answer /health in time; the message quotes its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(popen: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """Signal a child started with start_new_session=True (its group is its own, nothing else's);
    SIGKILL the group if it outlives `timeout_s`. Returns the exit code."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, sig)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(5)
    return popen.returncode


class SimProcess:
    """One `hicache-canary sim` process on 127.0.0.1 serving `ports` (one port: `--port`, more: `--ports`).

    `log_path` keeps the log where the caller wants it (tests keep theirs as artifacts); without it
    the log is a temp file removed on `stop()`. `env` adds to this process's environment.
    """

    def __init__(self, flags: Sequence[str] = (), *, ports: Sequence[int] = (), time_scale: float | None = None,
                 name: str = "simulator", log_path: Path | None = None, env: dict[str, str] | None = None):
        self.name = name
        self.ports = list(ports) or [free_port()]
        self.port = self.ports[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self._own_log = log_path is None
        if log_path is None:
            fd, tmp = tempfile.mkstemp(prefix="hicache-sim-", suffix=".log")
            os.close(fd)
            log_path = Path(tmp)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        listen = ["--port", str(self.port)] if len(self.ports) == 1 else ["--ports", ",".join(map(str, self.ports))]
        scale = [] if time_scale is None else ["--time-scale", str(time_scale)]
        argv = [sys.executable, "-m", "hicache_canary", "sim", "--host", "127.0.0.1", *listen, *scale, *flags]
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, *, deadline: float | None = None) -> None:
        """Return once every port answers /health 200; raise SimulatorStartError by the deadline."""
        deadline = deadline if deadline is not None else time.monotonic() + timeout_s
        for port in self.ports:
            url = f"http://127.0.0.1:{port}/health"
            last = "no answer"
            while True:
                if self.popen.poll() is not None:
                    raise SimulatorStartError(f"the {self.name} exited with {self.popen.returncode}: {self.tail()}")
                try:
                    r = httpx.get(url, timeout=1.0)
                    if r.status_code == 200:
                        break
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                if time.monotonic() >= deadline:
                    raise SimulatorStartError(f"the {self.name} did not answer {url} within {timeout_s:g} s "
                                              f"({last}): {self.tail()}")
                time.sleep(0.05)  # polling a child's readiness against a deadline

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 20) -> str:
        """The log's last lines, or 'no output'."""
        text = self.log().strip().splitlines()[-lines:]
        return "\n".join(text) if text else "no output"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Signal the simulator's process group, SIGKILL it if it outlives `timeout_s`; returns its exit code."""
        stop_process_group(self.popen, sig, timeout_s)
        if not self._log.closed:
            self._log.close()
            if self._own_log:
                with contextlib.suppress(OSError):
                    self.log_path.unlink()
        return self.popen.returncode

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(flags: Sequence[str] = (), *, timeout_s: float = START_TIMEOUT_S, **kw) -> SimProcess:
    """A SimProcess that answers /health on every port, or SimulatorStartError (the child stopped)."""
    sim = SimProcess(flags, **kw)
    try:
        sim.wait_ready(timeout_s)
    except BaseException:
        sim.stop()
        raise
    return sim
