"""The part of a probe cycle that talks to SGLang, as plain functions of their inputs.

The scheduler runs these in its own process (tests, fakes) or hands them to the probe worker
process (probe_worker.py), which runs the very same functions; whatever crosses between the two
is picklable data: a Target in, a ProbeRecord (or a watch reading) and phase names out.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hicache_canary.service.budget import allows
from hicache_canary.settings.config import Target
from hicache_canary.models import ErrorReason, Phase, ProbeRecord, Verdict
from hicache_canary.service.watch import WatchReading, read_metrics

log = logging.getLogger("hicache_canary.service.scheduler")

# Reasons that mean we did not reach a working server (the rest are answers from it).
# Reasons that mean we did not reach a working server (the rest are answers from it). An HTTP 5xx is
# an answer: the server is up (target_up 1) and says it failed; the probe's error reason tells which.
DOWN_REASONS = (ErrorReason.CONNECT_FAILED, ErrorReason.CONNECTION_LOST, ErrorReason.TIMEOUT, ErrorReason.SERVER_RESTARTED)


@dataclass(frozen=True)
class ProbeFunctions:
    """What talks to SGLang: canary.run_probe and SGLangClient in production, fakes in tests.

    Each may be given as `"module:name"` instead of the function: the exporter passes names, so
    only the probe worker imports the canary, httpx and the SGLang parsers (~7 MB the serving
    process does not need); `resolve()` imports them where they run.
    """

    probe_fn: Callable[..., Awaitable[ProbeRecord]] | str | None  # (client, ProbeSettings, *, progress=...) -> record
    client_factory: Callable[[Target], Any] | str  # -> an object with `async aclose()`
    estimate_fn: Callable[[Any, Target], Awaitable[int]] | str | None  # tokens the next probe will send; may raise
    watch_fn: Callable[[Any], Awaitable[str]] | str  # client -> SGLang's /metrics text; raises like SGLangClient

    def resolve(self) -> ProbeFunctions:
        def load(ref: Any) -> Any:
            if not isinstance(ref, str):
                return ref
            module, _, name = ref.partition(":")
            return getattr(importlib.import_module(module), name)

        return ProbeFunctions(load(self.probe_fn), load(self.client_factory), load(self.estimate_fn), load(self.watch_fn))


WatchResult = tuple[WatchReading | None, bool | None, bool]  # (reading, reachable (None: cannot tell), failed)
ContactResult = tuple[ProbeRecord | None, bool | None, int]  # (record, or None when over budget; up; tokens needed)


async def watch_read(fns: ProbeFunctions, t: Target) -> WatchResult:
    """One restart-watch poll (`fns` resolved)."""
    assert callable(fns.client_factory) and callable(fns.watch_fn)
    client = fns.client_factory(t)
    try:
        text = await fns.watch_fn(client)
        return read_metrics(text), True, False
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # SGLangError: its reason says whether the server answered at all
        reason = getattr(exc, "reason", None)
        log.debug("target %s: restart watch: %s", t.name, type(exc).__name__)
        if not isinstance(reason, ErrorReason):
            return None, None, True  # not an answer from the server: a bug of ours, not its state
        return None, reason not in DOWN_REASONS, True
    finally:
        await close_client(client)


async def contact(fns: ProbeFunctions, t: Target, remaining: int, on_phase: Callable[[str], None],
                  not_before: float | None = None) -> ContactResult:
    """Estimate the probe's tokens; run it if `remaining` (of the hour's budget) covers them.

    `not_before` (wall clock): the probe's start slot (scheduler.next_start). The estimate's two
    reads come first and take a varying few ms to a few hundred under load; waiting for the slot
    after them is what keeps probe starts exactly `probe_spacing` apart.
    """
    up: bool | None = None
    assert callable(fns.client_factory) and not isinstance(fns.estimate_fn, str)
    client = fns.client_factory(t)
    try:
        need = 3 * t.probe.context_tokens  # R's three sends at least, if the server can't tell us more
        if fns.estimate_fn is not None:
            try:
                need = max(1, int(await fns.estimate_fn(client, t)))
                up = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the probe itself will report what is wrong
                log.debug("target %s: estimate failed (%s)", t.name, type(exc).__name__)
        if not allows(need, remaining):
            return None, up, need
        if not_before is not None and not_before > time.time():
            await asyncio.sleep(not_before - time.time())
        return await _probe(fns, client, t, on_phase), up, need
    finally:
        await close_client(client)


async def _probe(fns: ProbeFunctions, client: Any, t: Target, on_phase: Callable[[str], None]) -> ProbeRecord:
    def progress(event: Any) -> None:
        # canary.ProgressEvent (or a bare Phase from a fake): only the phase name is kept
        phase = getattr(event, "phase", event)
        name = phase.value if isinstance(phase, Phase) else str(phase)
        if name != "done":
            on_phase(name)

    started = time.time()
    try:
        assert callable(fns.probe_fn)
        return await fns.probe_fn(client, t.probe, progress=progress)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the canary promises not to raise; if it does, say so as a value
        log.error("target %s: probe crashed: %s", t.name, type(exc).__name__)
        return crash_record(t.name, started, f"internal error in the probe ({type(exc).__name__})")


def crash_record(target: str, started: float, evidence: str) -> ProbeRecord:
    return ProbeRecord(target=target, started_at=started, finished_at=time.time(), verdict=Verdict.ERROR,
                       reason=ErrorReason.INTERNAL, evidence=evidence)


async def close_client(client: Any) -> None:
    close = getattr(client, "aclose", None)
    if close is not None:
        try:
            await asyncio.shield(close())
        except asyncio.CancelledError:
            raise
        except Exception:  # closing a broken connection must not hide the probe's result
            pass
