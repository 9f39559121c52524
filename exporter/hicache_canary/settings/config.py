"""Exporter config: YAML + environment -> validated, immutable `Settings`.

Everything is checked before anything starts (blackbox's `--config.check` discipline): unknown keys,
URLs, sizes, durations, duplicate names, unreadable secret files. Every problem becomes ONE line
naming its YAML path (`targets[1].url: ...`), and all of them are reported at once in a
`ConfigError`. Secrets are resolved here and kept in `SecretStr`, so a repr or a log line never
shows them.

The parts: config_yaml.py reads the file, config_env.py applies HICACHE_CANARY_*, config_types.py
holds the value rules, target_knobs.py the per-target knobs and defaults (config_target.py builds
the target fields and the resolved `Target` from it), discovery_config.py the discovery and shard
sections, config_errors.py turns validation errors into lines.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, ValidationError

from hicache_canary.settings.config_env import env_overrides, env_target_name
from hicache_canary.settings.config_errors import ConfigError, problems_of
from hicache_canary.settings.config_target import Target, TargetConfig, TargetFields, resolve_key, resolve_target, secret_file
from hicache_canary.settings.config_types import NAME_RE, DurationOrZero, Port, Strict, parse_duration, validate_url
from hicache_canary.settings.config_yaml import read_yaml
from hicache_canary.settings.discovery_config import (
    DiscoveryConfig,
    DockerDiscoveryConfig,
    FileSDDiscoveryConfig,
    PrometheusDiscoveryConfig,
    Shard,
    ShardSpec,
    parse_shard,
)

__all__ = ["ConfigError", "NAME_RE", "Settings", "Shard", "Target", "load_settings", "parse_duration",
           "parse_shard", "validate_url"]

DEFAULT_PORT = 9807


class Listen(Strict):
    host: str = Field(default="", min_length=0)
    port: Port = DEFAULT_PORT


class ConfigFile(Strict):
    listen: Listen = Listen()
    probe_api_token_env: str | None = None
    probe_api_token_file: str | None = None
    defaults: TargetFields = TargetFields()  # type: ignore[valid-type]
    targets: list[TargetConfig] = []
    discovery: DiscoveryConfig = DiscoveryConfig()
    max_concurrent_probes: Annotated[int, Field(ge=1, strict=True)] = 4
    history_limit: Annotated[int, Field(ge=1, le=10000, strict=True)] = 100
    # Least time between two probe starts of this exporter (0: no spacing); see scheduler.StartPacer.
    probe_spacing: DurationOrZero = 1.0
    shard: ShardSpec = Shard()


@dataclass(frozen=True)
class Settings:
    listen_host: str
    listen_port: int
    probe_api_token: SecretStr | None
    targets: tuple[Target, ...]
    defaults: TargetFields  # type: ignore[valid-type]
    default_api_key: SecretStr | None
    docker: DockerDiscoveryConfig | None
    max_concurrent_probes: int = 4
    history_limit: int = 100
    source: str = "<env>"
    prometheus_sd: PrometheusDiscoveryConfig | None = None
    file_sd: FileSDDiscoveryConfig | None = None
    probe_spacing: float = 1.0
    shard: Shard = Shard()

    @property
    def discovery_names(self) -> list[str]:
        """The discovery sources turned on, as the config names them."""
        on = (("docker", self.docker), ("prometheus", self.prometheus_sd), ("file_sd", self.file_sd))
        return [name for name, source in on if source is not None]

    @property
    def discovery_on(self) -> bool:
        return bool(self.discovery_names)

    def secrets(self) -> list[str]:
        """Every secret value in use, for scrubbing text before it leaves the process."""
        vals = [self.probe_api_token, self.default_api_key, *(t.api_key for t in self.targets)]
        return [v.get_secret_value() for v in vals if v is not None and v.get_secret_value()]

    def target_from_defaults(self, name: str, url: str, source: str) -> Target:
        """A target made only from `defaults` (used by discovery)."""
        return resolve_target(name, url, self.defaults, TargetFields(), self.default_api_key, None, source)


def in_container() -> bool:
    return Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()


def _probe_api_token(cfg: ConfigFile, env: Mapping[str, str], problems: list[str]) -> SecretStr | None:
    if cfg.probe_api_token_env and cfg.probe_api_token_file:
        problems.append("probe_api_token_env: set probe_api_token_env or probe_api_token_file, not both")
        return None
    if cfg.probe_api_token_file:
        return secret_file(cfg.probe_api_token_file, "probe_api_token_file", problems)
    # No token, no probe endpoint (it answers 403): an unset variable is not an error.
    value = env.get(cfg.probe_api_token_env or "HICACHE_CANARY_API_TOKEN", "")
    return SecretStr(value) if value else None


def load_settings(path: str | os.PathLike[str] | None, env: Mapping[str, str] = os.environ) -> Settings:
    """Read, override from env, validate and resolve; raise ConfigError listing every problem."""
    problems: list[str] = []
    doc = read_yaml(path) if path else {}
    doc = env_overrides(doc, env, problems)
    try:
        cfg = ConfigFile.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(problems + problems_of(exc)) from None

    seen: dict[str, int] = {}
    for i, t in enumerate(cfg.targets):
        if t.name in seen:
            problems.append(f"targets[{i}].name: duplicate name {t.name!r} (also targets[{seen[t.name]}])")
        seen.setdefault(t.name, i)
    docker = cfg.discovery.docker if cfg.discovery.docker.enabled else None
    prom_sd = cfg.discovery.prometheus if cfg.discovery.prometheus.enabled else None
    file_sd = cfg.discovery.file_sd if cfg.discovery.file_sd.enabled else None
    if not cfg.targets and docker is None and prom_sd is None and file_sd is None:
        problems.append("targets: at least one target is required (or set HICACHE_CANARY_TARGET_URL, or enable "
                        "discovery.docker, discovery.prometheus or discovery.file_sd)")

    token = _probe_api_token(cfg, env, problems)
    default_key = resolve_key(cfg.defaults, "defaults", env, problems)
    targets = []
    for i, t in enumerate(cfg.targets):
        own_key = resolve_key(t, f"targets[{i}]", env, problems)
        source = "env" if t.name == env_target_name(env) else "config"
        targets.append(resolve_target(t.name, t.url, cfg.defaults, t, default_key, own_key, source))
    if problems:
        raise ConfigError(problems)

    host = cfg.listen.host or ("0.0.0.0" if in_container() else "127.0.0.1")
    return Settings(
        listen_host=host,
        listen_port=cfg.listen.port,
        probe_api_token=token,
        targets=tuple(targets),
        defaults=cfg.defaults,
        default_api_key=default_key,
        docker=docker,
        max_concurrent_probes=cfg.max_concurrent_probes,
        history_limit=cfg.history_limit,
        source=str(path) if path else "<env>",
        prometheus_sd=prom_sd,
        file_sd=file_sd,
        probe_spacing=cfg.probe_spacing,
        shard=cfg.shard,
    )
