"""Per-target probe loops: one asyncio task per target, one probe in flight per target.

Decisions (when to probe next, whether a new `silent` needs an early confirming probe, whether the
token budget allows a probe) are pure functions at the top of this file. The loop runs the probe
function it is given (canary.run_probe in production, a fake in unit tests), folds each record into
cumulative stats, and publishes an immutable `TargetSnapshot` per target, swapped under a lock,
which is all the collector ever reads: a scrape never waits for a probe.

Between probes a second, cheap task per target watches for restarts (watch.py: GET /metrics every
`watch_interval`, never /generate). A restart moves the next probe up to `restart_probe_delay` from
now; the probe itself still goes through the one loop, so one-in-flight, the busy gate and the
token budget hold for it as for any other. The watch also keeps `up` fresh between probes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .config import Target
from .history import MAX_EVIDENCE, ResultHistory, record_to_dict
from .shown import shown_text
from .models import CounterSnapshot, ErrorReason, Phase, ProbeRecord, ServerFacts, Verdict
from .probe_work import DOWN_REASONS, ProbeFunctions, contact, crash_record, watch_read
from .probe_worker import ProbeProcess, WorkerFailed
from .watch import WatchState, after_probe, delay_after_restart, observe, watch_period

log = logging.getLogger("hicache_canary.scheduler")

ProbeFn = Callable[..., Awaitable[ProbeRecord]]  # (client, ProbeSettings, *, progress=...) -> record
ClientFactory = Callable[[Target], Any]  # -> an object with `async aclose()`
EstimateFn = Callable[[Any, Target], Awaitable[int]]  # tokens the next probe will send; may raise
WatchFn = Callable[[Any], Awaitable[str]]  # client -> SGLang's /metrics text; raises like SGLangClient

# Listed, not derived from Phase: steps such as Phase.PRIME time R too but are never a latency label.
LATENCY_PHASES = (Phase.COLD, Phase.REHOST, Phase.AGAIN)
# Seconds; from a device hit (~0.1 s) to a cold 40K prefill (~15 s) and slow servers beyond.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
SKIPS = (Verdict.SKIPPED_BUSY, Verdict.SKIPPED_BUDGET)
BUDGET_WINDOW_S = 3600.0
# The preflight (estimate: /server_info and /metrics) begins this long before the probe's start
# slot, so the probe proper starts on the slot even when those reads are slow.
PREFLIGHT_ALLOWANCE_S = 0.3


# ---------------------------------------------------------------- pure decisions


def start_offset(index: int, count: int, interval: float, spread_cap: float = 30.0) -> float:
    """Spread the first probes so targets don't all hit their servers (and our CPU) at once."""
    if count <= 1:
        return 0.0
    return index * min(interval, spread_cap) / count


def next_start(last_start: float | None, now: float, spacing: float) -> float:
    """When the next probe may start: `spacing` after the previous start of any target.

    Many targets may share a GPU host, a network link and this exporter's CPU; with a fixed interval
    and a 10% jitter their probes drift into each other by chance, so starts are also spaced apart
    across the whole exporter (on top of `max_concurrent_probes`, which caps how many run at once).
    """
    if last_start is None or spacing <= 0:
        return now
    return max(now, last_start + spacing)


def watch_phase(period: float, rng: random.Random) -> float:
    """First restart-watch poll of a target: anywhere in one period, so 200 targets' polls (and
    their parsing in the probe worker) are spread over the period rather than arriving together."""
    return period * rng.uniform(0.0, 1.0)


def needs_confirmation(verdict: Verdict | None, streak: int) -> bool:
    """A `silent` that starts a new streak is re-probed early instead of after a whole interval.

    HiCacheSilent pages only on two silent verdicts in a row (one odd probe must not wake anyone);
    confirming the first one at once brings the second within `confirm_after` instead of a second
    interval. Only the first of a streak: once confirmed, the regular interval is enough.
    """
    return verdict == Verdict.SILENT and streak == 1


def next_delay(
    verdict: Verdict | None,
    interval: float,
    consecutive_errors: int,
    budget_wait: float | None = None,
    confirm_after: float | None = None,
) -> float:
    """Seconds until the next probe, before jitter.

    `confirm_after`: set when the last verdict needs confirming (`needs_confirmation`); 0 or None
    means no early probe. Never later than the regular interval.
    """
    if verdict == Verdict.SILENT and confirm_after:
        return min(confirm_after, interval)
    if verdict == Verdict.ERROR and consecutive_errors > 0:
        # A blip is re-checked soon; a dead server is left alone, up to 4 intervals.
        return min(interval / 4 * 2 ** (consecutive_errors - 1), interval * 4)
    if verdict == Verdict.SKIPPED_BUSY:
        return min(interval / 4, 300.0)
    if verdict == Verdict.SKIPPED_BUDGET and budget_wait is not None:
        return max(1.0, min(budget_wait, interval))
    return interval


def jittered(delay: float, rng: random.Random, spread: float = 0.1) -> float:
    """Spread probes of many targets apart by shortening waits only, so the worst case is `delay`.

    Detection is promised within one interval (+ for:); a jitter that could lengthen a wait
    would make that 1.1 intervals.
    """
    return delay * rng.uniform(1 - spread, 1.0)


def after_probe_delay(delay: float, rec: ProbeRecord | None, restart_delay: float) -> float:
    """A probe that a restart cut short is retried once the server warmed up, not after backoff."""
    if rec is not None and rec.verdict == Verdict.ERROR and rec.reason == ErrorReason.SERVER_RESTARTED:
        return min(delay, restart_delay)
    return delay


class TokenWindow:
    """Prompt tokens actually sent in a sliding hour (not estimates)."""

    def __init__(self, window_s: float = BUDGET_WINDOW_S):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._events.popleft()

    def add(self, now: float, tokens: int) -> None:
        if tokens > 0:
            self._events.append((now, tokens))

    def used(self, now: float) -> int:
        self._expire(now)
        return sum(t for _, t in self._events)

    def remaining(self, now: float, budget: int) -> int:
        return max(0, budget - self.used(now))

    def wait_for(self, now: float, need: int, budget: int) -> float | None:
        """Seconds until `need` tokens fit in the budget; None if they never will."""
        if need > budget:
            return None
        self._expire(now)
        used = sum(t for _, t in self._events)
        for ts, tokens in self._events:
            if budget - used >= need:
                break
            used -= tokens
            if budget - used >= need:
                return ts + self.window_s - now
        return 0.0


class Trigger(enum.Enum):
    STARTED = "started"
    IN_FLIGHT = "in_flight"
    UNKNOWN = "unknown"


# ---------------------------------------------------------------- published state


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[int, ...] = (0,) * len(LATENCY_BUCKETS)  # cumulative counts per upper bound
    count: int = 0
    sum: float = 0.0

    def observe(self, v: float) -> Histogram:
        b = tuple(c + (1 if v <= ub else 0) for c, ub in zip(self.buckets, LATENCY_BUCKETS))
        return Histogram(b, self.count + 1, self.sum + v)


@dataclass(frozen=True)
class TargetSnapshot:
    """Everything the collector and the API show for one target, never mutated once published."""

    target: Target
    last: ProbeRecord | None = None
    last_measured: ProbeRecord | None = None  # the last probe that timed R at least once
    server: ServerFacts | None = None  # the last /server_info a probe read
    host_used_tokens: float | None = None
    host_total_tokens: float | None = None
    last_conclusive: ProbeRecord | None = None  # the last probe whose verdict is about HiCache itself
    last_conclusive_at: float | None = None
    last_error_reason: ErrorReason | None = None
    # Consecutive conclusive verdicts equal to the last conclusive one (`streak_verdict`). Errors,
    # not_evicted, inconclusive and skips say nothing about HiCache: they neither extend nor break it.
    streak: int = 0
    streak_verdict: Verdict | None = None
    since_conclusive: int = 0  # probes (skips not counted) since the last conclusive verdict
    in_progress: bool = False
    phase: str | None = None
    up: bool | None = None
    budget_remaining: int = 0
    next_probe_at: float | None = None  # wall clock
    watch_errors: int = 0  # restart-watch polls that failed
    restarts_detected: int = 0  # restarts the watch noticed between probes
    consecutive_errors: int = 0
    probes_total: Mapping[Verdict, int] = field(default_factory=lambda: MappingProxyType({}))
    errors_total: Mapping[ErrorReason, int] = field(default_factory=lambda: MappingProxyType({}))
    tokens_canary: int = 0
    tokens_pressure: int = 0
    passive_tokens: int = 0
    latency: Mapping[Phase, Histogram] = field(default_factory=lambda: MappingProxyType({}))


class _Runner:
    """Mutable per-target state, touched only from the event loop."""

    def __init__(self, target: Target, history_limit: int):
        self.target = target
        self.snap = TargetSnapshot(target=target, budget_remaining=target.token_budget_per_hour)
        self.history = ResultHistory(history_limit)
        self.window = TokenWindow()
        self.wake = asyncio.Event()  # a probe was requested (POST /api/probe)
        self.nudge = asyncio.Event()  # wake the loop to re-read `due` (a request, or a restart moved it)
        self.due = 0.0  # event-loop time of the next scheduled probe
        self.busy = False  # a probe requested or running: POST /api/probe answers 409
        self.task: asyncio.Task[None] | None = None
        self.watch_task: asyncio.Task[None] | None = None
        self.watch = WatchState()


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
        self._fns = ProbeFunctions(probe_fn, client_factory, estimate_fn, watch_fn or _metrics_text)
        self._sem = asyncio.Semaphore(max_concurrent)
        self._spacing = probe_spacing
        self._last_start: float | None = None  # event-loop time of the last probe start (reserved)
        self._history_limit = history_limit
        self._secrets = list(secrets or [])
        self._rng = rng or random.Random()
        self._clock = clock
        self._wall = wall
        self._initial_delay = initial_delay
        self._offload = offload
        self._worker: ProbeProcess | None = None
        self._runners: dict[str, _Runner] = {t.name: _Runner(t, history_limit) for t in targets}
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
        if self._offload and self._worker is None:
            self._worker = ProbeProcess(self._fns)  # started by its first call
        elif not self._offload:
            self._fns = self._fns.resolve()
        n = len(self._runners)
        for i, r in enumerate(self._runners.values()):
            self._spawn(r, self._initial_delay(i, n, r.target.interval_s))

    def _spawn(self, r: _Runner, delay: float) -> None:
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
        if self._worker is not None:
            # wait for cancelled probes to finish closing their connections, then end the process
            await self._worker.close()
            self._worker = None
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
        r = _Runner(target, self._history_limit)
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

    async def _loop(self, r: _Runner, delay: float) -> None:
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

    async def _wait_due(self, r: _Runner, loop: asyncio.AbstractEventLoop) -> None:
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

    async def _watch_loop(self, r: _Runner, period: float) -> None:
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
        try:
            if self._worker is not None:
                reading, reachable, failed = await self._worker.call("watch", r.target)
            else:
                reading, reachable, failed = await watch_read(self._fns, r.target)
        except WorkerFailed as exc:
            log.error("target %s: restart watch: %s", name, exc)
            reading, reachable, failed = None, None, True
        restart = False
        if reachable is not None:
            r.watch, restart = observe(r.watch, reading, reachable)
        s = r.snap
        restart = restart and not r.busy  # a probe started meanwhile: it is already the answer
        up = s.up if reachable is None else reachable
        # A quiet poll changes nothing: publishing it anyway would re-render the target's /metrics
        # lines 200 times a minute in a fleet, for nothing.
        if up != s.up or failed or restart:
            self._publish(
                r,
                replace(
                    s,
                    up=up,
                    watch_errors=s.watch_errors + (1 if failed else 0),
                    restarts_detected=s.restarts_detected + (1 if restart else 0),
                ),
            )
        if restart:
            t = r.target
            delay = delay_after_restart(t.restart_probe_delay_s, t.interval_s)
            loop = asyncio.get_running_loop()
            if loop.time() + delay < r.due:
                r.due = loop.time() + delay
                r.nudge.set()
            log.info("target %s: the server restarted; probing it in %.0f s", t.name, max(0.0, r.due - loop.time()))
        return restart

    async def _cycle(self, r: _Runner) -> float | None:
        """One probe (or one skip). Returns the wait until the budget allows one, if it did not."""
        async with self._sem:
            slot = await self._pace()
            self._publish(r, replace(r.snap, in_progress=True, phase="preflight"))
            rec, up, budget_wait = await self._contact(r, slot)
        self._apply(r, rec, up)
        return budget_wait

    async def _pace(self) -> float | None:
        """Take this probe's start slot (`next_start`) and wait until its preflight may begin.

        Returns the slot in wall-clock time (None with no spacing): the probe itself starts there,
        after the preflight reads (probe_work.contact), so starts are spaced exactly.
        """
        if self._spacing <= 0:
            return None
        loop = asyncio.get_running_loop()
        # Never sooner than the allowance either, or the first probe would start when its preflight ends.
        at = max(next_start(self._last_start, loop.time(), self._spacing), loop.time() + min(PREFLIGHT_ALLOWANCE_S, self._spacing / 2))
        self._last_start = at
        preflight_at = at - min(PREFLIGHT_ALLOWANCE_S, self._spacing / 2)
        if preflight_at > loop.time():
            await asyncio.sleep(preflight_at - loop.time())
        return self._wall() + (at - loop.time())

    async def _contact(self, r: _Runner, slot: float | None = None) -> tuple[ProbeRecord, bool | None, float | None]:
        """Everything that talks to the server, here or in the probe worker process."""
        t = r.target
        # Only this target's cycle touches its window while it runs, so reading it here is safe.
        remaining = r.window.remaining(self._clock(), t.token_budget_per_hour)
        started = self._wall()

        def on_phase(name: str) -> None:
            self._set_phase(r, name)

        try:
            if self._worker is not None:
                rec, up, need = await self._worker.call("contact", t, remaining, slot, on_phase=on_phase)
            else:
                rec, up, need = await contact(self._fns, t, remaining, on_phase, slot)
        except WorkerFailed as exc:
            log.error("target %s: %s", t.name, exc)
            return crash_record(t.name, started, "internal error: the probe worker process failed"), None, None
        if rec is not None:
            return rec, up, None
        now = self._clock()
        return self._budget_record(t, need, remaining), up, r.window.wait_for(now, need, t.token_budget_per_hour)

    def _set_phase(self, r: _Runner, name: str) -> None:
        if r.snap.in_progress:
            self._publish(r, replace(r.snap, phase=name))

    def _budget_record(self, t: Target, need: int, remaining: int) -> ProbeRecord:
        now = self._wall()
        return ProbeRecord(
            target=t.name,
            started_at=now,
            finished_at=now,
            context_tokens=t.probe.context_tokens,
            verdict=Verdict.SKIPPED_BUDGET,
            evidence=f"next probe needs about {need} tokens; {remaining} left of {t.token_budget_per_hour} this hour",
        )

    def _apply(self, r: _Runner, rec: ProbeRecord, up: bool | None) -> None:
        s = r.snap
        verdict = rec.verdict or Verdict.ERROR
        if rec.finished_at is None:
            rec.finished_at = self._wall()
        sent = rec.tokens_canary + rec.tokens_pressure
        now = self._clock()
        r.window.add(now, sent)
        probes = dict(s.probes_total)
        probes[verdict] = probes.get(verdict, 0) + 1
        errors = dict(s.errors_total)
        last_error = s.last_error_reason
        consecutive = 0
        if verdict == Verdict.ERROR:
            reason = rec.reason or ErrorReason.INTERNAL
            errors[reason] = errors.get(reason, 0) + 1
            last_error = reason
            consecutive = s.consecutive_errors + 1
            up = reason not in DOWN_REASONS
        elif verdict in SKIPS:
            consecutive = s.consecutive_errors  # a skip is neither a success nor a failure
            if verdict == Verdict.SKIPPED_BUSY:
                up = True
        else:
            up = True
        streak, streak_verdict, since = s.streak, s.streak_verdict, s.since_conclusive
        if verdict.conclusive:
            streak = streak + 1 if verdict == streak_verdict else 1
            streak_verdict = verdict
            since = 0
        elif verdict not in SKIPS:
            since += 1
        latency = dict(s.latency)
        for phase in LATENCY_PHASES:
            step = rec.step(phase)
            if step is not None and step.latency_s is not None:
                latency[phase] = latency.get(phase, Histogram()).observe(step.latency_s)
        measured = any(rec.step(p) is not None and rec.step(p).latency_s is not None for p in LATENCY_PHASES)
        counters = _latest_counters(rec)
        new = replace(
            s,
            last=rec,
            last_measured=rec if measured else s.last_measured,
            server=rec.server or s.server,
            host_used_tokens=counters.host_used_tokens if counters and counters.host_used_tokens is not None else s.host_used_tokens,
            host_total_tokens=counters.host_total_tokens if counters and counters.host_total_tokens is not None else s.host_total_tokens,
            last_conclusive=rec if verdict.conclusive else s.last_conclusive,
            last_conclusive_at=rec.finished_at if verdict.conclusive else s.last_conclusive_at,
            last_error_reason=last_error,
            streak=streak,
            streak_verdict=streak_verdict,
            since_conclusive=since,
            in_progress=False,
            phase=None,
            up=s.up if up is None else up,
            budget_remaining=r.window.remaining(now, r.target.token_budget_per_hour),
            consecutive_errors=consecutive,
            probes_total=MappingProxyType(probes),
            errors_total=MappingProxyType(errors),
            tokens_canary=s.tokens_canary + rec.tokens_canary,
            tokens_pressure=s.tokens_pressure + rec.tokens_pressure,
            passive_tokens=s.passive_tokens + rec.pressure.passive_tokens,
            latency=MappingProxyType(latency),
        )
        r.history.add(record_to_dict(rec, self._secrets))
        if counters is not None:  # a probe that read the server's counters reached it
            r.watch = after_probe(r.watch, counters.prompt_tokens, counters.process_start_time, True)
        self._publish(r, new)
        detail = rec.cause.value if verdict == Verdict.SILENT else (rec.reason.value if rec.reason else "")
        log.info(
            "target %s: %s%s ratio=%s tokens=%d passive=%d",
            r.target.name,
            verdict.value,
            f" ({detail})" if detail else "",
            "-" if rec.rehost_cold_ratio is None else f"{rec.rehost_cold_ratio:.3f}",
            sent,
            rec.pressure.passive_tokens,
        )
        if rec.evidence:
            log.debug("target %s: %s", r.target.name, shown_text(rec.evidence, self._secrets, MAX_EVIDENCE))

    def _publish(self, r: _Runner, snap: TargetSnapshot) -> None:
        r.snap = snap
        with self._lock:
            if r.target.name in self._runners or not self._published:
                self._published = MappingProxyType({**self._published, r.target.name: snap})

    def _publish_all(self) -> None:
        with self._lock:
            self._published = MappingProxyType({n: r.snap for n, r in self._runners.items()})


def _latest_counters(rec: ProbeRecord) -> CounterSnapshot | None:
    for step in reversed(rec.steps):
        for snap in (step.after, step.before):
            if snap is not None:
                return snap
    return None


async def _metrics_text(client: Any) -> str:
    return await client.metrics_text()
