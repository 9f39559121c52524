"""Optional discovery of SGLang containers on this node through the Docker Engine API.

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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .config import NAME_RE, Settings, Target, validate_url

log = logging.getLogger("hicache_canary.discovery")
ANY_ADDR = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Found:
    name: str
    url: str
    container: str  # short id, for log lines


def _label_filter(selector: str) -> str:
    return selector.strip()


def _name(container: dict[str, Any], name_label: str) -> str | None:
    labels = container.get("Labels") or {}
    raw = labels.get(name_label) or next(iter(container.get("Names") or []), "").lstrip("/")
    name = re.sub(r"[^a-z0-9_.-]", "-", raw.lower())[:63]
    return name if NAME_RE.match(name) else None


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
        found.append(Found(name, url, cid))
    return found, skipped


class DockerDiscovery:
    def __init__(self, settings: Settings, scheduler: Any):
        assert settings.docker is not None
        self.cfg = settings.docker
        self.settings = settings
        self.scheduler = scheduler
        self.static = {t.name for t in settings.targets}
        self.managed: dict[str, str] = {}  # discovered name -> url
        self.last_error: str | None = None

    def list_containers(self) -> list[dict[str, Any]]:
        import docker

        client = docker.DockerClient(base_url=self.cfg.socket, timeout=10)
        try:
            return client.api.containers(filters={"label": [_label_filter(self.cfg.label)], "status": "running"})
        finally:
            client.close()

    async def refresh(self) -> list[Target]:
        """One listing, applied to the scheduler; returns the discovered targets now managed."""
        try:
            containers = await asyncio.to_thread(self.list_containers)
        except Exception as exc:  # docker.errors.*, requests errors, OSError on the socket
            msg = f"cannot list containers at {self.cfg.socket}: {type(exc).__name__}"
            if msg != self.last_error:
                log.warning("%s; keeping %d discovered target(s)", msg, len(self.managed))
            self.last_error = msg
            return [t for t in self.scheduler.targets() if t.name in self.managed]
        self.last_error = None
        found, skipped = targets_from_containers(containers, self.cfg.url_label, self.cfg.name_label, self.cfg.port)
        for line in skipped:
            log.warning("discovery: %s", line)
        wanted = {f.name: f for f in found if f.name not in self.static}
        for name in list(self.managed):
            if name not in wanted or wanted[name].url != self.managed[name]:
                log.info("discovery: target %s gone or moved; removing", name)
                await self.scheduler.remove_target(name)
                del self.managed[name]
        for name, f in wanted.items():
            if name not in self.managed:
                log.info("discovery: new target %s at %s (container %s)", name, f.url, f.container)
                self.scheduler.add_target(self.settings.target_from_defaults(name, f.url, "docker"))
                self.managed[name] = f.url
        return [t for t in self.scheduler.targets() if t.name in self.managed]

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.cfg.refresh)
