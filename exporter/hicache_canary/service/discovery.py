"""Targets that come and go: the shared reconcile loop, and Docker discovery.

`Discovery` is one source of targets (Docker here; Prometheus's own service discovery and file_sd
in prometheus_sd.py). Each refresh lists what the source says now and applies the difference to
the scheduler: new names are added, names gone or moved are removed. A source that cannot answer,
or answers nonsense, raises `DiscoveryError`: its targets stay as they were (the last good list)
and the error is logged once and shown in /api/targets until a refresh succeeds. A statically
configured target, or one another source found first, keeps its name. With `shard: i/N`, only the
names this replica owns are kept (sharding.py).

Docker discovery: SGLang containers on this node, through the Docker Engine API.

Containers carrying the selector label (default `hicache-canary.enable=true`) become targets.
URL: the `hicache-canary.url` label if set; else the host port published for the SGLang port
(default 30000); else the container's own address on its first network with that port. Name: the
`hicache-canary.name` label, else the container name. Each discovered target takes its knobs from
`defaults`; a statically configured target of the same name wins. A Docker engine that cannot be
reached leaves the current targets in place and is retried at the next refresh.

The docker SDK is synchronous, so each listing runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hicache_canary.settings.config import NAME_RE, Settings, Target, validate_url
from hicache_canary.service.sharding import ShardView

log = logging.getLogger("hicache_canary.service.discovery")
ANY_ADDR = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Found:
    name: str
    url: str
    origin: str  # where it came from, for log lines (a container id, a file, a scrape pool)


class DiscoveryError(Exception):
    """The source could not be read or answered something unusable; one line, no traceback."""


def target_name(raw: str) -> str | None:
    """A discovered name as a target name (`10.0.0.5:30000` -> `10.0.0.5-30000`); None if unusable."""
    name = re.sub(r"[^a-z0-9_.-]", "-", raw.lower())[:63]
    return name if NAME_RE.match(name) else None


def _label_filter(selector: str) -> str:
    return selector.strip()


def _name(container: dict[str, Any], name_label: str) -> str | None:
    labels = container.get("Labels") or {}
    raw = labels.get(name_label) or next(iter(container.get("Names") or []), "").lstrip("/")
    return target_name(raw)


def _url(container: dict[str, Any], url_label: str, port: int) -> str | None:
    labels = container.get("Labels") or {}
    if labels.get(url_label):
        return validate_url(labels[url_label])
    for p in container.get("Ports") or []:
        if p.get("PrivatePort") == port and p.get("PublicPort") and p.get("Type", "tcp") == "tcp":
            ip = p.get("IP") or ""
            host = "127.0.0.1" if ip in ANY_ADDR else (f"[{ip}]" if ":" in ip else ip)
            return f"http://{host}:{p['PublicPort']}"
    networks = ((container.get("NetworkSettings") or {}).get("Networks") or {}).values()
    for net in networks:
        if (net or {}).get("IPAddress"):
            return f"http://{net['IPAddress']}:{port}"
    return None


def targets_from_containers(containers: Iterable[dict[str, Any]], url_label: str, name_label: str, port: int) -> tuple[list[Found], list[str]]:
    """Pure: Engine API container list -> (targets, one line per container we had to skip)."""
    found: list[Found] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for c in containers:
        cid = str(c.get("Id", "?"))[:12]
        name = _name(c, name_label)
        if name is None:
            skipped.append(f"container {cid}: no usable name (set the {name_label} label to [a-z0-9_.-])")
            continue
        try:
            url = _url(c, url_label, port)
        except ValueError as exc:
            skipped.append(f"container {cid} ({name}): {url_label} label {exc}")
            continue
        if url is None:
            skipped.append(f"container {cid} ({name}): no {url_label} label, no published port {port} and no network address")
            continue
        if name in seen:
            skipped.append(f"container {cid} ({name}): another container already uses this name")
            continue
        seen.add(name)
        found.append(Found(name, url, f"container {cid}"))
    return found, skipped


class Discovery:
    """One source of targets, reconciled into the scheduler every `refresh_s` seconds."""

    source = "?"
    settings_attr = ""  # the Settings attribute that holds this source's config
    refresh_s = 60.0

    def __init__(self, settings: Settings, scheduler: Any, shard: ShardView | None = None):
        self.cfg = getattr(settings, self.settings_attr)
        assert self.cfg is not None, f"discovery.{self.source} is not enabled"
        self.refresh_s = self.cfg.refresh
        self.settings = settings
        self.scheduler = scheduler
        self.shard = shard
        self.static = {t.name for t in settings.targets}
        self.managed: dict[str, str] = {}  # discovered name -> url
        self.last_error: str | None = None
        self.partial_error: str | None = None  # set by list_found when it answered only in part
        self.last_success: float | None = None  # wall clock

    async def list_found(self) -> list[Found]:
        """What the source says now; raises DiscoveryError when it cannot say."""
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """For /api/targets: is this source answering, and how many targets it gave us."""
        return {"source": self.source, "targets": len(self.managed), "last_error": self.last_error,
                "last_success_at": self.last_success}

    async def refresh(self) -> list[Target]:
        """One listing, applied to the scheduler; returns the discovered targets now managed."""
        try:
            found = await self.list_found()
        except DiscoveryError as exc:
            msg = str(exc)
            if msg != self.last_error:
                log.warning("discovery (%s): %s; keeping the last good list (%d target(s))", self.source, msg, len(self.managed))
            self.last_error = msg
            return self._current()
        error = self.partial_error  # e.g. one bad file_sd file among good ones: applied, and reported
        if error != self.last_error:
            if error:
                log.warning("discovery (%s): %s; keeping the last good targets of what failed", self.source, error)
            else:
                log.info("discovery (%s): answering again", self.source)
        self.last_error = error
        self.last_success = time.time()
        wanted = {f.name: f for f in found if f.name not in self.static}
        if self.shard is not None:
            mine = self.shard.keep(self.source, wanted)
            wanted = {n: f for n, f in wanted.items() if n in mine}
        for name in list(self.managed):
            if name not in wanted or wanted[name].url != self.managed[name]:
                log.info("discovery (%s): target %s gone or moved; removing", self.source, name)
                await self.scheduler.remove_target(name)
                del self.managed[name]
        taken = {t.name for t in self.scheduler.targets()}
        for name, f in wanted.items():
            if name in self.managed:
                continue
            if name in taken:
                log.warning("discovery (%s): %s from %s: another source already has a target of that name", self.source, name, f.origin)
                continue
            log.info("discovery (%s): new target %s at %s (%s)", self.source, name, f.url, f.origin)
            self.scheduler.add_target(self.settings.target_from_defaults(name, f.url, self.source))
            self.managed[name] = f.url
        return self._current()

    def _current(self) -> list[Target]:
        return [t for t in self.scheduler.targets() if t.name in self.managed]

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug of ours must not end discovery (healthz would then fail)
                log.error("discovery (%s): refresh failed: %s", self.source, type(exc).__name__)
            await asyncio.sleep(self.refresh_s)


class DockerDiscovery(Discovery):
    source = settings_attr = "docker"

    def list_containers(self) -> list[dict[str, Any]]:
        import docker

        client = docker.DockerClient(base_url=self.cfg.socket, timeout=10)
        try:
            return client.api.containers(filters={"label": [_label_filter(self.cfg.label)], "status": "running"})
        finally:
            client.close()

    async def list_found(self) -> list[Found]:
        try:
            containers = await asyncio.to_thread(self.list_containers)
        except Exception as exc:  # docker.errors.*, requests errors, OSError on the socket
            raise DiscoveryError(f"cannot list containers at {self.cfg.socket}: {type(exc).__name__}") from None
        found, skipped = targets_from_containers(containers, self.cfg.url_label, self.cfg.name_label, self.cfg.port)
        for line in skipped:
            log.warning("discovery: %s", line)
        return found
