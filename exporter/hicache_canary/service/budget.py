"""The hourly token budget: tokens sent in a sliding hour, and what a probe over budget becomes.

The probe worker (probe_work.contact) decides *whether* the next probe fits: it estimates the
tokens first and runs the probe only if `remaining` covers them. What follows a "no" is decided
here, without IO: a `skipped_budget` record saying why, and how long until the probe fits.
"""

from __future__ import annotations

from collections import deque

from hicache_canary.settings.config import Target
from hicache_canary.models import ProbeRecord, Verdict

BUDGET_WINDOW_S = 3600.0


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


def allows(need: int, remaining: int) -> bool:
    """The gate: a probe runs only if the tokens it will send fit in what is left this hour.

    `need` is an estimate made before the probe (pressure.estimate_probe_tokens); the window
    counts what was actually sent, so an estimate that ran short costs the next probe, not the budget.
    """
    return need <= remaining


def over_budget(t: Target, need: int, remaining: int, at: float) -> ProbeRecord:
    """The record of a probe not sent because it needs `need` tokens and only `remaining` are left
    (`at`: wall clock)."""
    return ProbeRecord(
        target=t.name,
        started_at=at,
        finished_at=at,
        context_tokens=t.probe.context_tokens,
        verdict=Verdict.SKIPPED_BUDGET,
        evidence=f"next probe needs about {need} tokens; {remaining} left of {t.token_budget_per_hour} this hour",
    )
