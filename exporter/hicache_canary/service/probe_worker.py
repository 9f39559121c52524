"""A child process for everything that talks to SGLang, so a scrape never waits for a probe.

Parsing SGLang's /metrics costs 50-150 ms of pure Python per poll and a probe polls every second;
on a thread of the serving process it competes with /metrics for the interpreter lock, and a
scrape then waits for it a millisecond at a time (p99 17-23 ms with one probe running). In a
process of its own it competes only for a CPU core. The serving process keeps the schedule, the
token budgets, the bookkeeping and /metrics; the worker runs probe_work.contact and
probe_work.watch_read with the same functions the scheduler was given, and sends back the records
and each phase as it starts.

Protocol on the child's stdin/stdout: length-prefixed pickles (both ends are this package, the
pipes private to the pair). The child ignores SIGINT and SIGTERM (it is in the exporter's process
group): it stops when the exporter says so, cancelling what runs so connections close and SGLang
aborts the requests, or when its stdin closes because the exporter died.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import signal
import struct
import sys
from collections.abc import Callable
from typing import Any

from hicache_canary.service.probe_work import ProbeFunctions, contact, watch_read

log = logging.getLogger("hicache_canary.service.probe_worker")
_LEN = struct.Struct("!I")


class WorkerFailed(Exception):
    """The worker process died (it is started again for the next call) or a call failed inside it."""


async def _read(reader: asyncio.StreamReader) -> Any:
    head = await reader.readexactly(_LEN.size)
    return pickle.loads(await reader.readexactly(_LEN.unpack(head)[0]))


def _frame(msg: Any) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


class ProbeProcess:
    """The exporter's end: `await call("contact", target, remaining, on_phase=...)`."""

    def __init__(self, fns: ProbeFunctions, log_level: int | None = None):
        self._init = _frame(("init", fns, log_level if log_level is not None else logging.getLogger().level))
        self._proc: asyncio.subprocess.Process | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, tuple[asyncio.Future[Any], Callable[[str], None] | None]] = {}
        self._ids = itertools.count(1)
        self._starting: asyncio.Lock | None = None

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            # The reader ends when the pipe does: the process is gone even if not yet reaped.
            if self._proc is None or self._reader_task is None or self._reader_task.done():
                if self._proc is not None and self._proc.returncode is None:
                    self._proc.kill()  # a half-dead worker (its pipe closed): make sure it is gone
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "hicache_canary.service.probe_worker",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=2**26)
                assert self._proc.stdin is not None
                self._proc.stdin.write(self._init)
                self._reader_task = asyncio.get_running_loop().create_task(self._dispatch(self._proc), name="probe-worker-reader")
                log.info("probe worker process started (pid %d)", self._proc.pid)
            return self._proc

    async def _dispatch(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        try:
            while True:
                kind, job, value = await _read(proc.stdout)
                fut, on_phase = self._pending.get(job, (None, None))
                if kind == "phase":
                    if on_phase is not None:
                        on_phase(value)
                    continue
                self._pending.pop(job, None)
                if fut is None or fut.done():
                    continue
                if kind == "result":
                    fut.set_result(value)
                else:
                    fut.set_exception(WorkerFailed(f"probe worker: {value}"))
        except (asyncio.IncompleteReadError, ConnectionError, pickle.UnpicklingError, EOFError):
            pass
        finally:
            # Whatever was in flight will never get an answer from this process.
            for fut, _ in self._pending.values():
                if not fut.done():
                    fut.set_exception(WorkerFailed("the probe worker process exited"))
            self._pending.clear()

    async def call(self, kind: str, *args: Any, on_phase: Callable[[str], None] | None = None) -> Any:
        proc = await self._ensure()
        job = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[job] = (fut, on_phase)
        try:
            assert proc.stdin is not None
            proc.stdin.write(_frame(("call", job, (kind, args))))
            return await fut
        except asyncio.CancelledError:
            self._pending.pop(job, None)
            self._send(proc, ("cancel", job, None))
            raise
        except (ConnectionError, RuntimeError) as exc:
            self._pending.pop(job, None)
            raise WorkerFailed(f"cannot reach the probe worker: {type(exc).__name__}") from None

    def _send(self, proc: asyncio.subprocess.Process, msg: Any) -> None:
        try:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.write(_frame(msg))
        except (ConnectionError, RuntimeError):
            pass

    async def close(self, timeout: float = 10.0) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            self._send(proc, ("stop", 0, None))
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self._proc = None


# ---------------------------------------------------------------- the child


async def _child(proto_fd: int) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(0, "rb", buffering=0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(proto_fd, "wb", buffering=0))
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    kind, fns, level = await _read(reader)
    assert kind == "init" and isinstance(fns, ProbeFunctions)
    fns = fns.resolve()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, level))
    tasks: dict[int, asyncio.Task[None]] = {}

    def send(msg: Any) -> None:
        writer.write(_frame(msg))

    async def run(job: int, what: str, args: tuple[Any, ...]) -> None:
        try:
            if what == "contact":
                t, remaining, not_before = args
                value: Any = await contact(fns, t, remaining, lambda name: send(("phase", job, name)), not_before)
            elif what == "watch":
                value = await watch_read(fns, *args)
            else:
                raise ValueError(f"unknown call {what!r}")
            send(("result", job, value))
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # reported to the caller as a value; the worker carries on
            log.error("probe worker: %s failed: %s", what, type(exc).__name__)
            send(("error", job, f"{what} failed ({type(exc).__name__})"))
        finally:
            tasks.pop(job, None)

    while True:
        try:
            kind, job, payload = await _read(reader)
        except (asyncio.IncompleteReadError, EOFError):
            kind = "stop"  # the exporter is gone
        if kind == "call":
            tasks[job] = loop.create_task(run(job, *payload))
        elif kind == "cancel" and job in tasks:
            tasks[job].cancel()
        elif kind == "stop":
            pending = list(tasks.values())
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)  # connections close: SGLang aborts
            try:
                await writer.drain()
            except ConnectionError:
                pass
            return


def main() -> None:
    # In the exporter's process group: a Ctrl-C or SIGTERM is the exporter's to handle, and it
    # tells us to stop after cancelling its probes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    proto_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the protocol
    asyncio.run(_child(proto_fd))


if __name__ == "__main__":
    main()
