"""Scheduler: pure timing/budget decisions as tables, and the loop driven by a fake probe function
(the real canary is exercised end to end in test_serve_e2e.py)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from hicache_canary.settings.config import load_settings
from hicache_canary.service.history import ResultHistory, record_to_dict
from hicache_canary.models import CachedTokens, ErrorReason, Phase, ProbeRecord, StepRecord, Verdict
from hicache_canary.probe.sglang_client import SGLangError
from hicache_canary.service.budget import TokenWindow
from hicache_canary.service.probe_timing import after_probe_delay, jittered, needs_confirmation, next_delay, next_start, start_offset
from hicache_canary.service.scheduler import Scheduler, Trigger

HOUR = 3600.0


async def until(cond, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def targets(n: int = 1, **env):
    base = {"HICACHE_CANARY_TARGET_URL": "http://127.0.0.1:9"}
    s = load_settings(None, {**base, **env})
    t = s.targets[0]
    from dataclasses import replace

    return [replace(t, name=f"t{i}", probe=replace(t.probe, target=f"t{i}")) for i in range(n)]


def record(settings, verdict: Verdict, tokens: int = 0, reason: ErrorReason | None = None) -> ProbeRecord:
    r = ProbeRecord(target=settings.target, started_at=time.time(), finished_at=time.time(), verdict=verdict, reason=reason)
    if tokens:
        r.steps = [
            StepRecord(Phase.COLD, latency_s=2.0, prompt_tokens=tokens // 3),
            StepRecord(Phase.REHOST, latency_s=0.1, prompt_tokens=tokens // 3, cached=CachedTokens(0, tokens // 3, 0)),
            StepRecord(Phase.AGAIN, latency_s=0.05, prompt_tokens=tokens - 2 * (tokens // 3)),
        ]
    return r


class FakeClient:
    closed = 0

    async def aclose(self):
        FakeClient.closed += 1


class Fake:
    """A probe function that returns scripted verdicts and counts calls."""

    def __init__(self, *verdicts: Verdict, tokens: int = 0, block: bool = False):
        self.script = list(verdicts)
        self.tokens = tokens
        self.calls = 0
        self.block = asyncio.Event() if block else None
        self.started = asyncio.Event()
        self.cancelled = False

    async def __call__(self, client, settings, *, progress=None):
        self.calls += 1
        self.started.set()
        if progress:
            progress(Phase.COLD)
        if self.block is not None:
            try:
                await self.block.wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        verdict = self.script.pop(0) if self.script else Verdict.REUSED
        reason = ErrorReason.CONNECT_FAILED if verdict == Verdict.ERROR else None
        return record(settings, verdict, self.tokens if verdict not in (Verdict.ERROR, Verdict.SKIPPED_BUSY) else 0, reason)


def sched(fake, ts, **kw) -> Scheduler:
    kw.setdefault("initial_delay", lambda i, n, iv: 0.0)
    return Scheduler(ts, fake, lambda t: FakeClient(), rng=random.Random(1), **kw)


# ------------------------------------------------------------------ pure decisions


@pytest.mark.parametrize(
    "verdict,errors,expected",
    [
        pytest.param(Verdict.REUSED, 0, 600, id="conclusive-waits-the-interval"),
        pytest.param(Verdict.ERROR, 1, 150, id="first-error-retries-at-a-quarter"),
        pytest.param(Verdict.ERROR, 2, 300, id="second-error-doubles"),
        pytest.param(Verdict.ERROR, 4, 1200, id="fourth-error-doubles-again"),
        pytest.param(Verdict.ERROR, 9, 2400, id="backoff-capped-at-4-intervals"),
        pytest.param(Verdict.SKIPPED_BUSY, 0, 150, id="busy-retries-sooner"),
        pytest.param(Verdict.SILENT, 3, 600, id="errors-reset-by-a-verdict"),
    ],
)
def test_next_delay(verdict, errors, expected):
    assert next_delay(verdict, 600, errors) == expected


@pytest.mark.parametrize(
    "verdict,streak,expected",
    [
        pytest.param(Verdict.SILENT, 1, True, id="first-silent-of-a-streak-is-confirmed"),
        pytest.param(Verdict.SILENT, 2, False, id="confirmed-silent-waits-the-interval"),
        pytest.param(Verdict.REUSED, 1, False, id="reused-needs-no-confirmation"),
        pytest.param(Verdict.ERROR, 1, False, id="error-after-a-silent-is-not-a-new-silent"),
        pytest.param(None, 0, False, id="no-probe-yet"),
    ],
)
def test_needs_confirmation(verdict, streak, expected):
    assert needs_confirmation(verdict, streak) is expected


@pytest.mark.parametrize(
    "confirm_after,interval,expected",
    [
        pytest.param(60, 900, 60, id="confirm-after-a-minute-not-the-interval"),
        pytest.param(600, 300, 300, id="never-later-than-the-interval"),
        pytest.param(0, 900, 900, id="zero-turns-it-off"),
        pytest.param(None, 900, 900, id="not-asked"),
    ],
)
def test_next_delay_confirms_a_first_silent_early(confirm_after, interval, expected):
    assert next_delay(Verdict.SILENT, interval, 0, confirm_after=confirm_after) == expected


def test_busy_retry_is_capped_at_five_minutes_for_long_intervals():
    assert next_delay(Verdict.SKIPPED_BUSY, 4 * HOUR, 0) == 300


def test_budget_skip_waits_until_tokens_age_out_but_not_past_the_interval():
    assert next_delay(Verdict.SKIPPED_BUDGET, 600, 0, budget_wait=120) == 120
    assert next_delay(Verdict.SKIPPED_BUDGET, 600, 0, budget_wait=3000) == 600
    assert next_delay(Verdict.SKIPPED_BUDGET, 600, 0, budget_wait=None) == 600


def test_start_offsets_spread_targets_apart():
    offs = [start_offset(i, 4, 600) for i in range(4)]
    assert offs == [0, 7.5, 15, 22.5]
    assert start_offset(0, 1, 600) == 0


def test_jitter_only_shortens_a_wait_so_the_worst_case_is_one_interval():
    rng = random.Random(0)
    vals = [jittered(100, rng) for _ in range(200)]
    assert 90 <= min(vals) < 92 and 99 < max(vals) <= 100


def test_token_window_slides():
    w = TokenWindow()
    w.add(0, 600)
    w.add(1000, 300)
    assert w.remaining(1000, 1000) == 100
    assert w.wait_for(1000, 500, 1000) == pytest.approx(2600)  # the 600 must age out (t=3600)
    assert w.wait_for(1000, 50, 1000) == 0
    assert w.wait_for(1000, 5000, 1000) is None  # never fits
    assert w.remaining(3600.5, 1000) == 700


def test_history_keeps_failures_after_they_leave_the_ring():
    h = ResultHistory(limit=3, failure_limit=2)
    for v in [Verdict.ERROR, Verdict.REUSED, Verdict.ERROR, Verdict.REUSED, Verdict.REUSED, Verdict.REUSED, Verdict.REUSED]:
        h.add({"verdict": v.value})
    assert [e["verdict"] for e in h.entries()] == ["error", "error", "reused", "reused", "reused"]


def test_history_entries_scrub_secrets():
    rec = ProbeRecord(target="a", started_at=1, verdict=Verdict.ERROR, evidence="server said: bad key sk-live-42")
    assert "sk-live-42" not in str(record_to_dict(rec, ["sk-live-42"]))


# ------------------------------------------------------------------ the loop


async def test_triggered_probe_runs_and_a_second_trigger_gets_in_flight():
    fake = Fake(block=True)
    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    s = sched(fake, [t], initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        assert s.trigger("nope") is Trigger.UNKNOWN
        assert s.trigger("t0") is Trigger.STARTED
        assert s.trigger("t0") is Trigger.IN_FLIGHT  # requested, not yet running: still one at a time
        await asyncio.wait_for(fake.started.wait(), 5)
        await until(lambda: s.snapshot()["t0"].in_progress, what="in_progress")
        assert s.snapshot()["t0"].phase == "cold"
        assert s.trigger("t0") is Trigger.IN_FLIGHT
        fake.block.set()
        await until(lambda: s.snapshot()["t0"].last is not None, what="record")
        assert fake.calls == 1 and not s.snapshot()["t0"].in_progress
        await until(lambda: s.trigger("t0") is Trigger.STARTED, what="idle again")
    finally:
        fake.block.set()
        await s.stop()


async def test_stop_cancels_the_probe_in_flight_and_closes_the_client():
    fake = Fake(block=True)
    FakeClient.closed = 0
    s = sched(fake, targets(1))
    s.start()
    await asyncio.wait_for(fake.started.wait(), 5)
    await asyncio.wait_for(s.stop(), 5)
    assert fake.cancelled and FakeClient.closed == 1
    assert s.snapshot()["t0"].last is None  # a cancelled probe is not a result
    assert s.healthy()[0] is False


async def test_budget_skips_without_calling_the_probe():
    fake = Fake(tokens=3000)

    async def estimate(client, target):
        return 3000

    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    from dataclasses import replace

    t = replace(t, token_budget_per_hour=7000)
    s = sched(fake, [t], estimate_fn=estimate, initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        for expected in (1, 2):
            assert s.trigger("t0") is Trigger.STARTED
            await until(lambda: fake.calls == expected and s.snapshot()["t0"].last is not None and not s.snapshot()["t0"].in_progress)
            await until(lambda: not s.busy("t0"), what="idle")
        assert s.snapshot()["t0"].budget_remaining == 1000
        assert s.trigger("t0") is Trigger.STARTED
        await until(lambda: s.snapshot()["t0"].last.verdict == Verdict.SKIPPED_BUDGET, what="budget skip")
        snap = s.snapshot()["t0"]
        assert fake.calls == 2  # the third probe sent nothing
        assert snap.probes_total[Verdict.SKIPPED_BUDGET] == 1 and snap.tokens_canary == 6000
        assert "3000" in snap.last.evidence and "1000 left" in snap.last.evidence
        # it will retry when enough tokens age out of the hour, not at the 1h interval plus jitter
        assert snap.next_probe_at is not None
    finally:
        await s.stop()


async def test_errors_back_off_and_mark_the_target_down_then_recover():
    fake = Fake(Verdict.ERROR, Verdict.ERROR, Verdict.REUSED, tokens=300)
    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    s = sched(fake, [t], initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        for n in (1, 2):
            await until(lambda: not s.busy("t0"))
            s.trigger("t0")
            await until(lambda: fake.calls == n and s.snapshot()["t0"].consecutive_errors == n, what=f"error {n}")
            await until(lambda: s.snapshot()["t0"].next_probe_at is not None and not s.snapshot()["t0"].in_progress)
        snap = s.snapshot()["t0"]
        assert snap.up is False and snap.errors_total[ErrorReason.CONNECT_FAILED] == 2
        # second consecutive error: a half interval (x jitter), not the full hour
        await until(lambda: not s.busy("t0"))
        wait = s.snapshot()["t0"].next_probe_at - time.time()
        assert 0.45 * HOUR - 5 < wait < 0.55 * HOUR
        s.trigger("t0")
        await until(lambda: fake.calls == 3 and s.snapshot()["t0"].last.verdict == Verdict.REUSED)
        snap = s.snapshot()["t0"]
        assert snap.up is True and snap.consecutive_errors == 0 and snap.last_error_reason == ErrorReason.CONNECT_FAILED
    finally:
        await s.stop()


async def test_busy_skip_retries_sooner_and_does_not_break_a_streak():
    fake = Fake(Verdict.SILENT, Verdict.SKIPPED_BUSY, Verdict.SILENT, tokens=300)
    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    s = sched(fake, [t], initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        for n in (1, 2, 3):
            await until(lambda: not s.busy("t0"))
            s.trigger("t0")
            await until(lambda: fake.calls == n and s.snapshot()["t0"].probes_total.get(fake_last(n), 0) >= 1)
            await until(lambda: not s.busy("t0"))
            if n == 2:
                wait = s.snapshot()["t0"].next_probe_at - time.time()
                assert 0.2 * 300 < wait <= 300  # busy: min(interval/4, 5 min), not an hour
        snap = s.snapshot()["t0"]
        assert snap.streak == 2 and snap.streak_verdict == Verdict.SILENT
    finally:
        await s.stop()


def fake_last(n: int) -> Verdict:
    return [Verdict.SILENT, Verdict.SKIPPED_BUSY, Verdict.SILENT][n - 1]


async def test_a_crashing_probe_is_an_internal_error_and_the_loop_lives_on():
    calls = 0

    async def boom(client, settings, *, progress=None):
        nonlocal calls
        calls += 1
        raise RuntimeError("secret-ish detail")

    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    s = sched(boom, [t], initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        s.trigger("t0")
        await until(lambda: s.snapshot()["t0"].last is not None)
        last = s.snapshot()["t0"].last
        assert (last.verdict, last.reason) == (Verdict.ERROR, ErrorReason.INTERNAL)
        assert "secret-ish" not in last.evidence
        assert s.healthy() == (True, [])
        await until(lambda: not s.busy("t0"))
        s.trigger("t0")
        await until(lambda: calls == 2)
    finally:
        await s.stop()


async def test_targets_probe_on_their_own_schedules():
    fake = Fake(tokens=30)
    ts = targets(2)
    from dataclasses import replace

    ts = [replace(ts[0], interval_s=0.05), replace(ts[1], interval_s=HOUR)]
    s = sched(fake, ts)
    s.start()
    try:
        await until(lambda: s.snapshot()["t0"].probes_total.get(Verdict.REUSED, 0) >= 4, what="t0 probed repeatedly")
        assert s.snapshot()["t1"].probes_total.get(Verdict.REUSED, 0) == 1  # only its first probe
    finally:
        await s.stop()


async def test_global_concurrency_limit_holds_probes_back():
    fake = Fake(block=True)
    s = sched(fake, targets(3), max_concurrent=1)
    s.start()
    try:
        await asyncio.wait_for(fake.started.wait(), 5)
        await asyncio.sleep(0.05)  # give the other loops a chance to (wrongly) start
        assert fake.calls == 1
        assert sum(v.in_progress for v in s.snapshot().values()) == 1
        fake.block.set()
        await until(lambda: fake.calls == 3)
    finally:
        fake.block.set()
        await s.stop()


async def _drive(s: Scheduler, fake: "Fake", n: int) -> None:
    """Trigger probes until `fake` has been called n times, each finished and published."""
    while fake.calls < n:
        await until(lambda: not s.busy("t0"), what="idle")
        calls = fake.calls
        s.trigger("t0")
        await until(lambda: fake.calls == calls + 1 and not s.busy("t0"), what=f"probe {calls + 1}")


async def test_non_conclusive_probes_neither_extend_nor_break_a_silent_streak():
    script = [Verdict.SILENT, Verdict.ERROR, Verdict.NOT_EVICTED, Verdict.SKIPPED_BUSY, Verdict.INCONCLUSIVE, Verdict.SILENT]
    fake = Fake(*script, tokens=300)
    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    from dataclasses import replace

    s = sched(fake, [replace(t, confirm_after_s=0)], initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        seen = []
        for n in range(1, len(script) + 1):
            await _drive(s, fake, n)
            snap = s.snapshot()["t0"]
            seen.append((snap.last.verdict, snap.streak, snap.streak_verdict, snap.since_conclusive, snap.consecutive_errors))
        assert seen == [
            (Verdict.SILENT, 1, Verdict.SILENT, 0, 0),
            (Verdict.ERROR, 1, Verdict.SILENT, 1, 1),
            (Verdict.NOT_EVICTED, 1, Verdict.SILENT, 2, 0),
            (Verdict.SKIPPED_BUSY, 1, Verdict.SILENT, 2, 0),
            (Verdict.INCONCLUSIVE, 1, Verdict.SILENT, 3, 0),
            (Verdict.SILENT, 2, Verdict.SILENT, 0, 0),
        ]
        assert s.snapshot()["t0"].last_conclusive is s.snapshot()["t0"].last
        await _drive(s, fake, len(script) + 1)  # the script is spent: reused
        snap = s.snapshot()["t0"]
        assert (snap.streak, snap.streak_verdict) == (1, Verdict.REUSED)
    finally:
        await s.stop()


async def test_a_first_silent_is_confirmed_after_confirm_after_then_the_interval_resumes():
    fake = Fake(Verdict.SILENT, Verdict.SILENT, tokens=300)
    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    from dataclasses import replace

    s = sched(fake, [replace(t, confirm_after_s=0.2)])  # first probe at once, then on its own
    s.start()
    try:
        await until(lambda: s.snapshot()["t0"].last is not None and not s.busy("t0"), what="first probe")
        assert s.snapshot()["t0"].streak == 1
        wait = s.snapshot()["t0"].next_probe_at - time.time()
        assert 0 < wait <= 0.25  # 0.2 s +-10%, not the hour
        await until(lambda: s.snapshot()["t0"].streak == 2 and not s.busy("t0"), what="the confirming probe")
        assert fake.calls == 2
        wait = s.snapshot()["t0"].next_probe_at - time.time()
        assert 0.85 * HOUR < wait <= HOUR  # confirmed: back to the interval
    finally:
        await s.stop()


async def test_the_confirming_probe_is_held_to_the_token_budget():
    fake = Fake(Verdict.SILENT, Verdict.SILENT, tokens=3000)

    async def estimate(client, target):
        return 3000

    (t,) = targets(1, HICACHE_CANARY_INTERVAL="1h")
    from dataclasses import replace

    s = sched(fake, [replace(t, confirm_after_s=0.05, token_budget_per_hour=5000)], estimate_fn=estimate)
    s.start()
    try:
        await until(lambda: s.snapshot()["t0"].probes_total.get(Verdict.SKIPPED_BUDGET, 0) == 1, what="confirmation skipped")
        snap = s.snapshot()["t0"]
        assert fake.calls == 1 and snap.tokens_canary == 3000  # the early probe sent nothing
        assert (snap.streak, snap.streak_verdict) == (1, Verdict.SILENT)
    finally:
        await s.stop()


# ------------------------------------------------------------------ the restart watch


@pytest.mark.parametrize(
    "verdict,reason,expected",
    [
        pytest.param(Verdict.ERROR, ErrorReason.SERVER_RESTARTED, 60, id="cut-short-by-a-restart-retries-after-warm-up"),
        pytest.param(Verdict.ERROR, ErrorReason.CONNECT_FAILED, 225, id="other-errors-keep-their-backoff"),
        pytest.param(Verdict.SILENT, None, 225, id="verdicts-keep-their-delay"),
    ],
)
def test_a_probe_cut_short_by_a_restart_is_retried_after_the_restart_delay(verdict, reason, expected):
    rec = ProbeRecord(target="t", started_at=0, verdict=verdict, reason=reason)
    assert after_probe_delay(225, rec, 60) == expected
    assert after_probe_delay(30, rec, 60) == 30  # never later than it would have been


def metrics_text(prompt_tokens: float | None) -> str:
    if prompt_tokens is None:  # a fresh SGLang process: no labelled children yet
        return "# HELP sglang:prompt_tokens_total x\n# TYPE sglang:prompt_tokens_total counter\n"
    return f'sglang:prompt_tokens_total{{engine_type="unified",is_streaming="false",model_name="m"}} {prompt_tokens}\n'


class Server:
    """What the watch's GET /metrics returns: scripted texts, or a connection failure (None)."""

    def __init__(self, *texts: str | None):
        self.texts = list(texts)
        self.reads = 0

    async def __call__(self, client) -> str:
        self.reads += 1
        text = self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]
        if text is None:
            raise SGLangError(ErrorReason.CONNECT_FAILED, "GET /metrics: connection refused")
        return text


def watched(watch_s=0.02, delay_s=0.1, interval="1h", **kw):
    from dataclasses import replace

    (t,) = targets(1, HICACHE_CANARY_INTERVAL=interval)
    return replace(t, watch_interval_s=watch_s, restart_probe_delay_s=delay_s, **kw)


async def test_counters_going_back_bring_the_next_probe_to_restart_probe_delay():
    fake = Fake(Verdict.SILENT, tokens=300)
    server = Server(metrics_text(5000), metrics_text(5000), metrics_text(None), metrics_text(None), metrics_text(40))
    t = watched(confirm_after_s=0)
    s = sched(fake, [t], watch_fn=server, initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        await until(lambda: s.snapshot()["t0"].restarts_detected == 1, what="restart detected")
        detected = time.monotonic()
        assert fake.calls == 0
        wait = s.snapshot()["t0"].next_probe_at - time.time()
        assert 0 < wait <= 0.1  # restart_probe_delay, not the hour
        await until(lambda: fake.calls == 1 and not s.busy("t0"), what="the restart's probe")
        assert 0.08 < time.monotonic() - detected < 1.0
        snap = s.snapshot()["t0"]
        assert snap.restarts_detected == 1 and snap.watch_errors == 0 and snap.up is True
        assert 0.85 * HOUR < snap.next_probe_at - time.time() <= HOUR  # then back to the interval
    finally:
        await s.stop()


async def test_a_server_that_was_unreachable_and_is_back_counts_as_restarted():
    fake = Fake(tokens=300)
    server = Server(metrics_text(10), None, None, metrics_text(10))  # same counters: only "back" tells
    s = sched(fake, [watched()], watch_fn=server, initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        await until(lambda: s.snapshot()["t0"].up is False, what="down seen by the watch, not a probe")
        assert fake.calls == 0 and s.snapshot()["t0"].watch_errors >= 1
        await until(lambda: fake.calls == 1, what="probe after it came back")
        snap = s.snapshot()["t0"]
        assert snap.restarts_detected == 1 and snap.up is True
    finally:
        await s.stop()


async def test_steady_counters_never_move_the_probe():
    fake = Fake(tokens=300)
    server = Server(metrics_text(10), metrics_text(20), metrics_text(30))
    s = sched(fake, [watched()], watch_fn=server, initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        await until(lambda: server.reads >= 6, what="several watch polls")
        snap = s.snapshot()["t0"]
        assert fake.calls == 0 and snap.restarts_detected == 0 and snap.up is True
        assert snap.next_probe_at - time.time() > 0.9 * HOUR
    finally:
        await s.stop()


async def test_the_watch_does_not_poll_while_a_probe_runs_nor_start_a_second_one():
    fake = Fake(block=True)
    server = Server(metrics_text(10))
    s = sched(fake, [watched()], watch_fn=server)  # first probe at once, and it blocks
    s.start()
    try:
        await asyncio.wait_for(fake.started.wait(), 5)
        reads = server.reads
        await asyncio.sleep(0.15)  # several watch periods
        assert server.reads == reads and fake.calls == 1
    finally:
        fake.block.set()
        await s.stop()


async def test_a_restart_never_postpones_a_probe_due_sooner():
    fake = Fake(tokens=300)
    server = Server(metrics_text(10), metrics_text(1))
    t = watched(delay_s=30.0)  # the probe is due in 0.4 s: sooner than the restart delay
    s = sched(fake, [t], watch_fn=server, initial_delay=lambda i, n, iv: 0.4)
    s.start()
    try:
        await until(lambda: s.snapshot()["t0"].restarts_detected == 1, what="restart")
        await until(lambda: fake.calls == 1, timeout=2, what="the scheduled probe, on time")
    finally:
        await s.stop()


async def test_the_restart_probe_is_held_to_the_token_budget():
    fake = Fake(tokens=3000)

    async def estimate(client, target):
        return 3000

    server = Server(metrics_text(10), metrics_text(10), metrics_text(1))
    t = watched(token_budget_per_hour=1000)
    s = sched(fake, [t], watch_fn=server, estimate_fn=estimate, initial_delay=lambda i, n, iv: HOUR)
    s.start()
    try:
        await until(lambda: s.snapshot()["t0"].probes_total.get(Verdict.SKIPPED_BUDGET, 0) == 1, what="budget skip")
        assert fake.calls == 0 and s.snapshot()["t0"].restarts_detected == 1
    finally:
        await s.stop()


async def test_no_watch_when_it_would_not_poll_more_often_than_the_probes():
    fake = Fake(tokens=30)
    server = Server(metrics_text(10))
    for t in (watched(watch_s=0), watched(watch_s=0.05, interval="50ms")):
        s = sched(fake, [t], watch_fn=server, initial_delay=lambda i, n, iv: 0.2)
        s.start()
        try:
            await asyncio.sleep(0.15)  # a watch would poll within one period (<= 0.05 s): none did
        finally:
            await s.stop()
    assert server.reads == 0


# ------------------------------------------------------------------ a fleet: start spacing


def test_next_start_is_spacing_after_the_previous_start():
    assert next_start(None, 100.0, 1.0) == 100.0  # the first probe starts at once
    assert next_start(100.0, 100.2, 1.0) == 101.0  # too soon: wait for the slot
    assert next_start(100.0, 105.0, 1.0) == 105.0  # long enough ago: at once
    assert next_start(100.0, 100.2, 0.0) == 100.2  # spacing 0: off


async def test_probes_of_many_targets_start_spacing_apart_and_the_cap_holds():
    starts: list[float] = []
    running = 0
    peak = 0

    async def probe(client, settings, *, progress=None):
        nonlocal running, peak
        starts.append(time.monotonic())
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.25)  # longer than the spacing: several run at once, up to the cap
        running -= 1
        return record(settings, Verdict.REUSED, 0, None)

    s = sched(probe, targets(6), max_concurrent=2, probe_spacing=0.1)  # all six due at once
    s.start()
    try:
        await until(lambda: len(starts) == 6, timeout=10, what="six probes")
    finally:
        await s.stop()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 0.095, gaps  # never two starts closer than the spacing
    assert peak == 2  # and never more than max_concurrent at once


# ------------------------------------------------------------------ the pure fold


def test_fold_returns_the_next_state_and_leaves_the_record_and_the_old_state_alone():
    from copy import deepcopy

    from hicache_canary.service.target_state import after_watch, fold, fresh

    t = targets(1)[0]
    before = fresh(t)
    rec = ProbeRecord(target=t.name, started_at=10.0, finished_at=30.0, verdict=Verdict.SILENT)
    rec.steps = [StepRecord(Phase.COLD, latency_s=15.0), StepRecord(Phase.REHOST, latency_s=15.5)]
    kept = deepcopy(rec)
    after = fold(before, rec, None, 123)
    assert rec == kept and before == fresh(t)
    assert (after.streak, after.streak_verdict, after.last_conclusive_at, after.up, after.budget_remaining) == (1, Verdict.SILENT, 30.0, True, 123)
    assert after.latency[Phase.COLD].count == 1 and dict(after.probes_total) == {Verdict.SILENT: 1}
    again = fold(after, ProbeRecord(target=t.name, started_at=40.0, finished_at=41.0, verdict=Verdict.ERROR,
                                    reason=ErrorReason.CONNECT_FAILED), True, 123)
    assert (again.streak, again.consecutive_errors, again.up, again.last_conclusive_at) == (1, 1, False, 30.0)
    assert after_watch(again, False, False, False) is None  # a quiet poll publishes nothing
    assert after_watch(again, True, False, True).restarts_detected == 1


@pytest.mark.parametrize("need,remaining,runs", [(100, 100, True), (101, 100, False), (1, 0, False), (0, 0, True)])
def test_the_budget_gate(need, remaining, runs):
    from hicache_canary.service.budget import allows, over_budget

    assert allows(need, remaining) is runs
    t = targets(1)[0]
    skip = over_budget(t, need, remaining, at=50.0)
    assert skip.verdict == Verdict.SKIPPED_BUDGET and skip.started_at == skip.finished_at == 50.0
    assert f"needs about {need} tokens; {remaining} left of {t.token_budget_per_hour} this hour" in skip.evidence
