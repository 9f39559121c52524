"""One target inside the scheduler: its mutable loop state (the published part is its
`TargetSnapshot`), and what a request for a probe of it can answer."""

from __future__ import annotations

import asyncio
import enum

from hicache_canary.service.budget import TokenWindow
from hicache_canary.settings.config import Target
from hicache_canary.service.history import ResultHistory
from hicache_canary.service.target_state import fresh
from hicache_canary.service.watch import WatchState


class Trigger(enum.Enum):
    STARTED = "started"
    IN_FLIGHT = "in_flight"
    UNKNOWN = "unknown"


class Runner:
    """Mutable per-target state, touched only from the event loop."""

    def __init__(self, target: Target, history_limit: int):
        self.target = target
        self.snap = fresh(target)
        self.history = ResultHistory(history_limit)
        self.window = TokenWindow()
        self.wake = asyncio.Event()  # a probe was requested (POST /api/probe)
        self.nudge = asyncio.Event()  # wake the loop to re-read `due` (a request, or a restart moved it)
        self.due = 0.0  # event-loop time of the next scheduled probe
        self.busy = False  # a probe requested or running: POST /api/probe answers 409
        self.task: asyncio.Task[None] | None = None
        self.watch_task: asyncio.Task[None] | None = None
        self.watch = WatchState()
