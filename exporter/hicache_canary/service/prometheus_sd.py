"""Targets from the service discovery the user already runs: a Prometheus server, or file_sd files.

`PrometheusDiscovery` asks a Prometheus server for its active targets (`GET /api/v1/targets`) and
keeps those whose `job` label is the configured job, so whatever feeds that job (kubernetes_sd,
consul_sd, file_sd, static_configs, the Operator's PodMonitors) feeds the canary unchanged, after
the job's relabelling. The SGLang URL is the target's scrape URL without its path; the name is the
`name_label` label (`instance` by default: `10.0.0.5:30000` -> target `10.0.0.5-30000`).

`FileSDDiscovery` reads Prometheus file_sd files (a list of `{targets: [host:port], labels: {}}`
groups, JSON or YAML; globs allowed as in Prometheus). As in Prometheus, a file that cannot be
read or parsed keeps the groups it had at its last good read; a file that no longer exists (or no
longer matches the glob) takes its targets with it.

Parsing is pure (`targets_from_api`, `targets_from_groups`), tested without a network.
"""

from __future__ import annotations

import glob
import json
import logging
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from hicache_canary.settings.config import Settings, validate_url
from hicache_canary.service.discovery import Discovery, DiscoveryError, Found, target_name
from hicache_canary.service.sharding import ShardView

log = logging.getLogger("hicache_canary.service.discovery")
ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d{1,5})?$")  # host, name or [v6], then :port


def _skip_or_found(raw_name: str | None, url: str, origin: str, seen: set[str], found: list[Found], skipped: list[str]) -> None:
    name = target_name(raw_name) if raw_name else None
    if name is None:
        skipped.append(f"{origin}: no usable name ({raw_name!r})")
    elif name in seen:
        skipped.append(f"{origin}: another target already uses the name {name}")
    else:
        seen.add(name)
        found.append(Found(name, url, origin))


def targets_from_api(body: Any, job: str, name_label: str) -> tuple[list[Found], list[str]]:
    """Pure: a /api/v1/targets answer -> (this job's targets, one line per target skipped).

    Raises DiscoveryError when the answer is not what Prometheus sends (the caller keeps its list).
    """
    if not isinstance(body, dict) or body.get("status") != "success":
        why = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), str) else "no status: success"
        raise DiscoveryError(f"not a successful /api/v1/targets answer ({why[:200]})")
    data = body.get("data")
    active = data.get("activeTargets") if isinstance(data, dict) else None
    if not isinstance(active, list):
        raise DiscoveryError("the /api/v1/targets answer has no data.activeTargets list")
    found: list[Found] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for i, t in enumerate(active):
        labels = t.get("labels") if isinstance(t, dict) else None
        if not isinstance(labels, dict):
            raise DiscoveryError(f"data.activeTargets[{i}] has no labels")
        if labels.get("job") != job:
            continue
        scrape_url = t.get("scrapeUrl")
        origin = f"scrape pool {t.get('scrapePool', '?')}, instance {labels.get('instance', '?')}"
        try:
            parts = urlsplit(scrape_url if isinstance(scrape_url, str) else "")
            url = validate_url(f"{parts.scheme}://{parts.netloc}")
        except ValueError as exc:
            skipped.append(f"{origin}: scrapeUrl {scrape_url!r} {exc}")
            continue
        _skip_or_found(labels.get(name_label), url, origin, seen, found, skipped)
    return found, skipped


def targets_from_groups(doc: Any, where: str, scheme: str, name_label: str) -> tuple[list[Found], list[str]]:
    """Pure: one file_sd document -> (targets, skipped lines). Raises DiscoveryError on a bad shape."""
    if doc is None:
        return [], []
    if not isinstance(doc, list):
        raise DiscoveryError(f"{where}: must be a list of target groups ({{targets: [...], labels: {{...}}}}), not {type(doc).__name__}")
    found: list[Found] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for gi, group in enumerate(doc):
        if not isinstance(group, dict) or set(group) - {"targets", "labels"}:
            raise DiscoveryError(f"{where}: [{gi}] must be a mapping with only targets and labels")
        targets, labels = group.get("targets") or [], group.get("labels") or {}
        if not isinstance(targets, list) or not all(isinstance(a, str) for a in targets):
            raise DiscoveryError(f"{where}: [{gi}].targets must be a list of \"host:port\" strings")
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise DiscoveryError(f"{where}: [{gi}].labels must map label names to strings")
        group_scheme = labels.get("__scheme__", scheme)
        for ti, address in enumerate(targets):
            origin = f"{where} [{gi}].targets[{ti}]"
            try:
                if not ADDRESS_RE.match(address.strip()):
                    raise ValueError("is not host:port")
                url = validate_url(f"{group_scheme}://{address.strip()}")
            except ValueError as exc:
                skipped.append(f"{origin}: {address!r} {exc}")
                continue
            # As in Prometheus, `instance` defaults to the address.
            raw = labels.get(name_label) or (address.strip() if name_label == "instance" else None)
            _skip_or_found(raw, url, origin, seen, found, skipped)
    return found, skipped


def _log_skipped(skipped: list[str], already: set[str]) -> set[str]:
    """Log each skipped line once (not at every refresh); returns the lines now current."""
    now = set(skipped)
    for line in skipped:
        if line not in already:
            log.warning("discovery: skipped %s", line)
    return now


class PrometheusDiscovery(Discovery):
    source, settings_attr = "prometheus", "prometheus_sd"

    def __init__(self, settings: Settings, scheduler: Any, shard: ShardView | None = None):
        super().__init__(settings, scheduler, shard)
        self._skipped: set[str] = set()
        self._warned_empty = False

    async def list_found(self) -> list[Found]:
        where = f"Prometheus at {self.cfg.url}"
        try:
            async with httpx.AsyncClient(timeout=self.cfg.timeout) as client:
                r = await client.get(self.cfg.url + "/api/v1/targets", params={"state": "active"})
        except httpx.HTTPError as exc:
            raise DiscoveryError(f"cannot reach {where}: {type(exc).__name__}") from None
        if r.status_code != 200:
            raise DiscoveryError(f"{where} answered HTTP {r.status_code} to GET /api/v1/targets")
        try:
            body = r.json()
        except ValueError:
            raise DiscoveryError(f"{where} answered GET /api/v1/targets with something that is not JSON") from None
        try:
            found, skipped = targets_from_api(body, self.cfg.job, self.cfg.name_label)
        except DiscoveryError as exc:
            raise DiscoveryError(f"{where}: {exc}") from None
        self._skipped = _log_skipped(skipped, self._skipped)
        if not found and not self._warned_empty:
            jobs = sorted({t.get("labels", {}).get("job", "?") for t in body["data"]["activeTargets"] if isinstance(t, dict)})
            log.warning("discovery (prometheus): no active targets with job=%r at %s (jobs there: %s)",
                        self.cfg.job, self.cfg.url, ", ".join(jobs[:20]) or "none")
        self._warned_empty = not found
        return found


class FileSDDiscovery(Discovery):
    source = settings_attr = "file_sd"

    def __init__(self, settings: Settings, scheduler: Any, shard: ShardView | None = None):
        super().__init__(settings, scheduler, shard)
        self._good: dict[str, list[Found]] = {}  # file -> its targets at its last good read
        self._skipped: set[str] = set()

    def _paths(self) -> list[str]:
        paths: list[str] = []
        for pattern in self.cfg.files:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else ([pattern] if Path(pattern).exists() else [])
            paths += [p for p in matches if p not in paths]
        return paths

    def _read(self, path: str) -> tuple[list[Found], list[str]]:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DiscoveryError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or type(exc).__name__}") from None
        try:
            doc = yaml.safe_load(text) if path.endswith((".yml", ".yaml")) else json.loads(text) if text.strip() else None
        except (ValueError, yaml.YAMLError) as exc:
            line = getattr(exc, "lineno", None) or (getattr(getattr(exc, "problem_mark", None), "line", -1) + 1) or None
            raise DiscoveryError(f"{path}: not valid {'YAML' if path.endswith(('.yml', '.yaml')) else 'JSON'}"
                                 f"{f' (line {line})' if line else ''}") from None
        return targets_from_groups(doc, path, self.cfg.scheme, self.cfg.name_label)

    async def list_found(self) -> list[Found]:
        paths = self._paths()
        errors: list[str] = []
        skipped: list[str] = []
        good: dict[str, list[Found]] = {}
        for path in paths:
            try:
                found, skip = self._read(path)
                good[path] = found
                skipped += skip
            except DiscoveryError as exc:
                errors.append(str(exc))
                if path in self._good:
                    good[path] = self._good[path]  # Prometheus does the same: a bad file keeps its last good groups
        self._good = good
        self._skipped = _log_skipped(skipped, self._skipped)
        out: list[Found] = []
        names: set[str] = set()
        for path in paths:
            for f in good.get(path, []):
                if f.name not in names:
                    names.add(f.name)
                    out.append(f)
        self.partial_error = "; ".join(errors) or None
        if not paths:
            self.partial_error = f"no file matches {', '.join(self.cfg.files)}"
        return out
