"""Per-target probe loops: one asyncio task per target, one probe in flight per target.

The loop asks probe_timing.py when to probe next, runs the probe through a ProbeChannel (in the
probe worker process in production, in-process with a fake in unit tests), turns a probe over
budget into a skip (budget.py), folds each record into the target's state (target_state.fold) and
publishes the immutable `TargetSnapshot` per target, swapped under a lock, which is all the
collector ever reads: a scrape never waits for a probe.

Between probes a second, cheap task per target watches for restarts (watch.py: GET /metrics every
`watch_interval`, never /generate). A restart moves the next probe up to `restart_probe_delay` from
now; the probe itself still goes through the one loop, so one-in-flight, the busy gate and the
token budget hold for it as for any other. The watch also keeps `up` fresh between probes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from hicache_canary.service.budget import over_budget
from hicache_canary.settings.config import Target
from hicache_canary.service.history import MAX_EVIDENCE, record_to_dict
from hicache_canary.models import ProbeRecord
from hicache_canary.service.probe_channel import ProbeChannel
from hicache_canary.service.probe_timing import after_probe_delay, jittered, needs_confirmation, next_delay, start_offset, start_slot, watch_phase
from hicache_canary.service.probe_work import ProbeFunctions
from hicache_canary.shown import shown_text
from hicache_canary.service.target_runner import Runner, Trigger
from hicache_canary.service.target_state import TargetSnapshot, after_watch, fold, latest_counters, outcome_line
from hicache_canary.service.watch import after_probe, delay_after_restart, observe, watch_period

log = logging.getLogger("hicache_canary.service.scheduler")

ProbeFn = Callable[..., Awaitable[ProbeRecord]]  # (client, ProbeSettings, *, progress=...) -> record
ClientFactory = Callable[[Target], Any]  # -> an object with `async aclose()`
EstimateFn = Callable[[Any, Target], Awaitable[int]]  # tokens the next probe will send; may raise
WatchFn = Callable[[Any], Awaitable[str]]  # client -> SGLang's /metrics text; raises like SGLangClient

class Scheduler:
    def __init__(
        self,
        targets: list[Target] | tuple[Target, ...],
        probe_fn: ProbeFn | str | None,
        client_factory: ClientFactory | str,
        *,
        estimate_fn: EstimateFn | str | None = None,
        watch_fn: WatchFn | str | None = None,
        max_concurrent: int = 4,
        probe_spacing: float = 0.0,
        history_limit: int = 100,
        secrets: list[str] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        initial_delay: Callable[[int, int, float], float] = start_offset,
        offload: bool = False,
    ):
        self._channel = ProbeChannel(ProbeFunctions(probe_fn, client_factory, estimate_fn, watch_fn or _metrics_text), offload)
        self._sem = asyncio.Semaphore(max_concurrent)
        self._spacing = probe_spacing
        self._last_start: float | None = None  # event-loop time of the last probe start (reserved)
        self._history_limit = history_limit
        self._secrets = list(secrets or [])
        self._rng = rng or random.Random()
        self._clock = clock
        self._wall = wall
        self._initial_delay = initial_delay
        self._runners: dict[str, Runner] = {t.name: Runner(t, history_limit) for t in targets}
        self._lock = threading.Lock()
        self._published: Mapping[str, TargetSnapshot] = MappingProxyType({})
        self._started = False
        self._stopping = False
        self._publish_all()

    # ---- reading (any thread)

    def snapshot(self) -> Mapping[str, TargetSnapshot]:
        with self._lock:
            return self._published

    def history(self, name: str) -> list[dict[str, Any]]:
        r = self._runners.get(name)
        return r.history.entries() if r else []

    def busy(self, name: str) -> bool:
        """A probe of `name` was requested or is running (POST /api/probe would answer 409)."""
        r = self._runners.get(name)
        return r is not None and r.busy

    def healthy(self) -> tuple[bool, list[str]]:
        """Exporter health: every target loop alive. Target trouble is a metric, not health."""
        if not self._started:
            return False, ["scheduler not started"]
        dead = [n for n, r in self._runners.items() if r.task is None or r.task.done() or (r.watch_task is not None and r.watch_task.done())]
        return (not dead), [f"probe loop for {n} is not running" for n in dead]

    # ---- control (event loop)

    def start(self) -> None:
        self._started = True
        self._stopping = False
        self._channel.start()
        n = len(self._runners)
        for i, r in enumerate(self._runners.values()):
            self._spawn(r, self._initial_delay(i, n, r.target.interval_s))

    def _spawn(self, r: Runner, delay: float) -> None:
        loop = asyncio.get_running_loop()
        r.task = loop.create_task(self._loop(r, delay), name=f"probe-loop:{r.target.name}")
        period = watch_period(r.target.watch_interval_s, r.target.interval_s)
        if period is not None:
            r.watch_task = loop.create_task(self._watch_loop(r, period), name=f"restart-watch:{r.target.name}")

    async def stop(self) -> None:
        """Cancel every loop; an in-flight probe closes its connections so the server aborts."""
        self._stopping = True
        tasks = [t for r in self._runners.values() for t in (r.task, r.watch_task) if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._channel.close()
        self._started = False

    def trigger(self, name: str) -> Trigger:
        r = self._runners.get(name)
        if r is None:
            return Trigger.UNKNOWN
        if r.busy:
            return Trigger.IN_FLIGHT
        r.busy = True
        r.wake.set()
        r.nudge.set()
        return Trigger.STARTED

    def add_target(self, target: Target) -> None:
        if target.name in self._runners:
            return
        r = Runner(target, self._history_limit)
        self._runners[target.name] = r
        if target.api_key:
            self._secrets.append(target.api_key.get_secret_value())
        if self._started:
            self._spawn(r, 0.0)
        self._publish(r, r.snap)

    async def remove_target(self, name: str) -> None:
        r = self._runners.pop(name, None)
        if r is None:
            return
        tasks = [t for t in (r.task, r.watch_task) if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with self._lock:
            self._published = MappingProxyType({k: v for k, v in self._published.items() if k != name})

    def targets(self) -> list[Target]:
        return [r.target for r in self._runners.values()]

    # ---- the loop

    async def _loop(self, r: Runner, delay: float) -> None:
        loop = asyncio.get_running_loop()
        r.due = loop.time() + delay
        while True:
            await self._wait_due(r, loop)
            if self._stopping:
                return
            r.wake.clear()
            r.busy = True
            try:
                budget_wait = await self._cycle(r)
            finally:
                r.busy = False
            s = r.snap
            t = r.target
            verdict = s.last.verdict if s.last else None
            confirm = t.confirm_after_s if needs_confirmation(verdict, s.streak) else None
            delay = jittered(next_delay(verdict, t.interval_s, s.consecutive_errors, budget_wait, confirm), self._rng)
            delay = after_probe_delay(delay, s.last, delay_after_restart(t.restart_probe_delay_s, t.interval_s))
            r.due = loop.time() + delay
            if confirm:
                log.info("target %s: first silent verdict; confirming it in %.0f s", t.name, delay)

    async def _wait_due(self, r: Runner, loop: asyncio.AbstractEventLoop) -> None:
        """Until `r.due` or a request; the watch may move `due` earlier meanwhile (and nudges)."""
        while not r.wake.is_set():
            remaining = r.due - loop.time()
            if remaining <= 0:
                return
            self._publish(r, replace(r.snap, next_probe_at=self._wall() + remaining))
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that
                # arrives as the event fires, and stop() would then wait for a whole interval.
                async with asyncio.timeout(remaining):
                    await r.nudge.wait()
            except TimeoutError:
                pass
            r.nudge.clear()

    # ---- the restart watch

    async def _watch_loop(self, r: Runner, period: float) -> None:
        await asyncio.sleep(watch_phase(period, self._rng))
        while True:
            # While a probe runs it reads /metrics itself, and ends in error if the server restarts.
            if not r.busy:
                try:
                    await self.watch_once(r.target.name)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the watch must outlive anything a server can send
                    log.error("target %s: restart watch failed: %s", r.target.name, type(exc).__name__)
            await asyncio.sleep(period)

    async def watch_once(self, name: str) -> bool:
        """One watch poll of target `name`; True when it found a restart (and moved the probe up)."""
        r = self._runners[name]
        reading, reachable, failed = await self._channel.watch(r.target)
        restart = False
        if reachable is not None:
            r.watch, restart = observe(r.watch, reading, reachable)
        restart = restart and not r.busy  # a probe started meanwhile: it is already the answer
        new = after_watch(r.snap, reachable, failed, restart)
        if new is not None:
            self._publish(r, new)
        if restart:
            t = r.target
            delay = delay_after_restart(t.restart_probe_delay_s, t.interval_s)
            loop = asyncio.get_running_loop()
            if loop.time() + delay < r.due:
                r.due = loop.time() + delay
                r.nudge.set()
            log.info("target %s: the server restarted; probing it in %.0f s", t.name, max(0.0, r.due - loop.time()))
        return restart

    async def _cycle(self, r: Runner) -> float | None:
        """One probe (or one skip). Returns the wait until the budget allows one, if it did not."""
        async with self._sem:
            slot = await self._pace()
            self._publish(r, replace(r.snap, in_progress=True, phase="preflight"))
            rec, up, budget_wait = await self._contact(r, slot)
        self._apply(r, rec, up)
        return budget_wait

    async def _pace(self) -> float | None:
        """Take this probe's start slot (`probe_timing.start_slot`) and wait until its preflight may begin.

        Returns the slot in wall-clock time (None with no spacing): the probe itself starts there,
        after the preflight reads (probe_work.contact), so starts are spaced exactly.
        """
        if self._spacing <= 0:
            return None
        loop = asyncio.get_running_loop()
        at, preflight_at = start_slot(self._last_start, loop.time(), self._spacing)
        self._last_start = at
        if preflight_at > loop.time():
            await asyncio.sleep(preflight_at - loop.time())
        return self._wall() + (at - loop.time())

    async def _contact(self, r: Runner, slot: float | None = None) -> tuple[ProbeRecord, bool | None, float | None]:
        """The probe (or its budget skip), and the wait until the budget allows one if it did not."""
        t = r.target
        # Only this target's cycle touches its window while it runs, so reading it here is safe.
        remaining = r.window.remaining(self._clock(), t.token_budget_per_hour)
        rec, up, need = await self._channel.contact(t, remaining, slot, lambda name: self._set_phase(r, name))
        if rec is not None:
            return rec, up, None
        wait = r.window.wait_for(self._clock(), need, t.token_budget_per_hour)
        return over_budget(t, need, remaining, self._wall()), up, wait

    def _set_phase(self, r: Runner, name: str) -> None:
        if r.snap.in_progress:
            self._publish(r, replace(r.snap, phase=name))

    def _apply(self, r: Runner, rec: ProbeRecord, up: bool | None) -> None:
        if rec.finished_at is None:
            rec = replace(rec, finished_at=self._wall())
        sent = rec.tokens_canary + rec.tokens_pressure
        now = self._clock()
        r.window.add(now, sent)
        new = fold(r.snap, rec, up, r.window.remaining(now, r.target.token_budget_per_hour))
        r.history.add(record_to_dict(rec, self._secrets))
        counters = latest_counters(rec)
        if counters is not None:  # a probe that read the server's counters reached it
            r.watch = after_probe(r.watch, counters.prompt_tokens, counters.process_start_time, True)
        self._publish(r, new)
        log.info("target %s: %s", r.target.name, outcome_line(rec))
        if rec.evidence:
            log.debug("target %s: %s", r.target.name, shown_text(rec.evidence, self._secrets, MAX_EVIDENCE))

    def _publish(self, r: Runner, snap: TargetSnapshot) -> None:
        r.snap = snap
        with self._lock:
            if r.target.name in self._runners or not self._published:
                self._published = MappingProxyType({**self._published, r.target.name: snap})

    def _publish_all(self) -> None:
        with self._lock:
            self._published = MappingProxyType({n: r.snap for n, r in self._runners.items()})


async def _metrics_text(client: Any) -> str:
    return await client.metrics_text()
