"""Where a target's probes and watch polls run: in this process (tests, fakes) or in the probe
worker process (probe_worker.py, the exporter). The scheduler's loop calls the same two methods
either way and gets values back, never an exception from the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hicache_canary.settings.config import Target
from hicache_canary.service.probe_work import ContactResult, ProbeFunctions, WatchResult, contact, crash_record, watch_read
from hicache_canary.service.probe_worker import ProbeProcess, WorkerFailed

log = logging.getLogger("hicache_canary.service.scheduler")


class ProbeChannel:
    def __init__(self, fns: ProbeFunctions, offload: bool):
        self._fns = fns
        self._offload = offload
        self._worker: ProbeProcess | None = None

    def start(self) -> None:
        if self._offload and self._worker is None:
            self._worker = ProbeProcess(self._fns)  # started by its first call
        elif not self._offload:
            self._fns = self._fns.resolve()

    async def close(self) -> None:
        """Wait for cancelled probes to finish closing their connections, then end the worker."""
        if self._worker is not None:
            await self._worker.close()
            self._worker = None

    async def contact(self, t: Target, remaining: int, slot: float | None,
                      on_phase: Callable[[str], None]) -> ContactResult:
        """probe_work.contact; a failed worker becomes an internal-error record."""
        started = time.time()
        try:
            if self._worker is not None:
                return await self._worker.call("contact", t, remaining, slot, on_phase=on_phase)
            return await contact(self._fns, t, remaining, on_phase, slot)
        except WorkerFailed as exc:
            log.error("target %s: %s", t.name, exc)
            return crash_record(t.name, started, "internal error: the probe worker process failed"), None, 0

    async def watch(self, t: Target) -> WatchResult:
        """probe_work.watch_read; a failed worker is a failed poll that cannot tell `up`."""
        try:
            if self._worker is not None:
                return await self._worker.call("watch", t)
            return await watch_read(self._fns, t)
        except WorkerFailed as exc:
            log.error("target %s: restart watch: %s", t.name, exc)
            return None, None, True
