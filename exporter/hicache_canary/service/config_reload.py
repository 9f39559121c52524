"""Config reload on SIGHUP, as blackbox_exporter does it: a valid new config replaces the targets,
an invalid one is logged with its problems and the running config stays.

Targets are compared by value: an added target starts, a removed one stops, a changed one restarts
(its state and history start afresh: they were measured with other settings), an unchanged one
keeps its state and its place in the schedule. Only the static `targets` (and the defaults they
inherit) take effect; listen address, discovery, sharding, concurrency, history size and the probe
API token are read once at start (docs/configuration.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_canary.settings.config import ConfigError, Settings, Target, load_settings

log = logging.getLogger("hicache_canary.reload")


@dataclass(frozen=True)
class ReloadStatus:
    """What `hicache_canary_config_last_reload_*` show; replaced, never edited, on each reload."""

    ok: bool
    success_at: float  # wall clock of the last config that loaded (the start, until a reload)


@dataclass(frozen=True)
class TargetChanges:
    added: tuple[Target, ...]
    removed: tuple[str, ...]
    changed: tuple[Target, ...]  # the new version of each


def target_changes(old: Sequence[Target], new: Sequence[Target]) -> TargetChanges:
    before = {t.name: t for t in old}
    after = {t.name: t for t in new}
    return TargetChanges(
        added=tuple(t for n, t in after.items() if n not in before),
        removed=tuple(n for n in before if n not in after),
        changed=tuple(t for n, t in after.items() if n in before and before[n] != t),
    )


class ConfigReloader:
    """Owns the static targets in `scheduler`; discovered targets are the discovery loops' own."""

    def __init__(self, path: str | os.PathLike[str] | None, env: Mapping[str, str], settings: Settings,
                 scheduler: Any, shard: Any):
        self.path = path
        self.env = env
        self.settings = settings
        self.scheduler = scheduler
        self.shard = shard
        self.targets = self._mine(settings)
        self.status = ReloadStatus(True, time.time())

    def _mine(self, settings: Settings) -> list[Target]:
        # Static targets are sharded like discovered ones: every replica may run the same config.
        mine = self.shard.keep("config", [t.name for t in settings.targets])
        return [t for t in settings.targets if t.name in mine]

    async def reload(self) -> bool:
        try:
            new = load_settings(self.path, self.env)
        except ConfigError as exc:
            log.error("config reload failed; still running the previous config: %s", "; ".join(exc.problems))
            self.status = ReloadStatus(False, self.status.success_at)
            return False
        wanted = self._mine(new)
        changes = target_changes(self.targets, wanted)
        for name in changes.removed + tuple(t.name for t in changes.changed):
            await self.scheduler.remove_target(name)
        for t in changes.added + changes.changed:
            self.scheduler.add_target(t)
        self.settings, self.targets = new, wanted
        self.status = ReloadStatus(True, time.time())
        log.info("config reloaded: %d target(s) added, %d removed, %d changed",
                 len(changes.added), len(changes.removed), len(changes.changed))
        return True

    async def run(self) -> None:
        """Reload on every SIGHUP for the app's lifetime (one reload at a time)."""
        loop = asyncio.get_running_loop()
        hup = asyncio.Event()
        try:
            loop.add_signal_handler(signal.SIGHUP, hup.set)
        except (ValueError, RuntimeError, NotImplementedError):
            # Not the main thread (an app under a test client) or no signals here: nothing to wait
            # for, but the task lives on, as /healthz counts an ended background task as a failure.
            log.debug("no SIGHUP handler in this thread: config reload is off")
            await asyncio.Event().wait()
        try:
            while True:
                await hup.wait()
                hup.clear()
                await self.reload()
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
