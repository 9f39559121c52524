"""Exporter config: YAML + environment -> validated, immutable `Settings`.

Everything is checked before anything starts (blackbox's `--config.check` discipline): unknown keys,
URLs, sizes, durations, duplicate names, unreadable secret files. Every problem becomes ONE line
naming its YAML path (`targets[1].url: ...`), and all of them are reported at once in a
`ConfigError`. Secrets are resolved here and kept in `SecretStr`, so a repr or a log line never
shows them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, field_validator

from .files import MAX_CONFIG_BYTES, MAX_SECRET_BYTES, FileTooLarge, read_text
from .models import ProbeSettings

DEFAULT_PORT = 9807
# Starts with a letter or digit: `.` and `..` would be path segments in /api/targets/<name>.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
NAME_RULE = "use 1-63 of a-z 0-9 _ . -, starting with a letter or digit"


_DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h|d))+$")
_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any, *, allow_zero: bool = False) -> float:
    """`30s`, `10m`, `1h30m`, `500ms` or a number of seconds -> seconds (float)."""
    if isinstance(value, bool):
        raise ValueError("must be a duration like 30s, 10m, 1h or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION_RE.match(value.strip()):
        seconds = sum(float(n) * _UNIT[u] for n, u in _PART_RE.findall(value.strip()))
    elif isinstance(value, str) and re.fullmatch(r"\d+(\.\d+)?", value.strip()):
        seconds = float(value)
    else:
        raise ValueError(f"{value!r} is not a duration (use 30s, 10m, 1h or a number of seconds)")
    if not math.isfinite(seconds):
        # YAML's .nan/.inf: a NaN interval compares false with everything and ends as a 500 from /api/targets
        raise ValueError(f"{value!r} is not a finite duration (use 30s, 10m, 1h or a number of seconds)")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError("must be a positive duration")
    return seconds


class ConfigError(Exception):
    """A config that must not be used. `str()` is one line per problem, each naming its path."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _duration(value: Any) -> float:
    return parse_duration(value)


Duration = Annotated[float, BeforeValidator(_duration)]
# Strict: pydantic's lax mode turns YAML's `yes`/`on`/`true` into 1 (and `no`/`off` into 0), so
# `context_tokens: yes` would probe with a one-token R. Strict ints take ints only; strict floats
# take ints and floats, never booleans or strings, and never NaN or infinity.
PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegInt = Annotated[int, Field(ge=0, strict=True)]
Ratio = Annotated[float, Field(gt=0, le=1, strict=True, allow_inf_nan=False)]
Port = Annotated[int, Field(ge=1, le=65535, strict=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetFields(_Strict):
    """Every per-target knob; each may also be set under `defaults`."""

    api_key_env: str | None = None
    api_key_file: str | None = None
    interval: Duration | None = None
    # Early re-probe after a first `silent` verdict (0: off); capped at `interval`.
    confirm_after: Annotated[float, BeforeValidator(lambda v: parse_duration(v, allow_zero=True))] | None = None
    # GET /metrics this often between probes to notice a restart (0: off); see watch.py.
    watch_interval: Annotated[float, BeforeValidator(lambda v: parse_duration(v, allow_zero=True))] | None = None
    # After a restart, probe this much later (warm-up), never later than the next scheduled probe.
    restart_probe_delay: Annotated[float, BeforeValidator(lambda v: parse_duration(v, allow_zero=True))] | None = None
    context_tokens: PositiveInt | None = None
    max_pressure_tokens: PositiveInt | None = None
    pressure_chunk_tokens: PositiveInt | None = None
    busy_queue_threshold: NonNegInt | None = None
    busy_running_threshold: NonNegInt | None = None
    token_budget_per_hour: PositiveInt | None = None
    api: Literal["auto", "native", "openai"] | None = None
    request_timeout: Duration | None = None
    passive_wait: Annotated[float, BeforeValidator(lambda v: parse_duration(v, allow_zero=True))] | None = None
    poll_interval: Duration | None = None
    min_cold_latency: Annotated[float, BeforeValidator(lambda v: parse_duration(v, allow_zero=True))] | None = None
    host_hit_threshold: Ratio | None = None
    dp_rank: NonNegInt | None = None


class TargetConfig(TargetFields):
    name: str
    url: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid name ({NAME_RULE})")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return validate_url(v)


class Listen(_Strict):
    host: str = Field(default="", min_length=0)
    port: Port = DEFAULT_PORT


class DockerDiscoveryConfig(_Strict):
    enabled: bool = False
    socket: str = "unix:///var/run/docker.sock"
    label: str = "hicache-canary.enable=true"
    url_label: str = "hicache-canary.url"
    name_label: str = "hicache-canary.name"
    port: Port = 30000
    refresh: Duration = 60.0


class PrometheusDiscoveryConfig(_Strict):
    """Targets from a Prometheus server's own service discovery: its active targets of one job."""

    enabled: bool = False
    url: str = "http://127.0.0.1:9090"
    job: str = Field(default="sglang", min_length=1)  # the `job` label of the targets, as in PromQL
    name_label: str = Field(default="instance", min_length=1)  # target label that names a canary target
    refresh: Duration = 60.0
    timeout: Duration = 10.0

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return validate_url(v)


class FileSDDiscoveryConfig(_Strict):
    """Targets from Prometheus file_sd files (JSON or YAML target groups), re-read every `refresh`."""

    enabled: bool = False
    files: Annotated[list[str], Field(min_length=1)] = ["/etc/hicache-canary/targets/*.json"]
    name_label: str = Field(default="instance", min_length=1)
    scheme: Literal["http", "https"] = "http"  # unless a group sets the `__scheme__` label
    refresh: Duration = 30.0


class DiscoveryConfig(_Strict):
    docker: DockerDiscoveryConfig = DockerDiscoveryConfig()
    prometheus: PrometheusDiscoveryConfig = PrometheusDiscoveryConfig()
    file_sd: FileSDDiscoveryConfig = FileSDDiscoveryConfig()


_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    """This replica's share of the targets: `index` of `count` (0-based), written `i/N`."""

    index: int = 0
    count: int = 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(value: Any) -> Shard:
    """`"1/4"` -> Shard(1, 4): replica 1 of 4, counted from 0."""
    m = _SHARD_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{value!r} is not a shard (write i/N, e.g. 0/2: replica 0 of 2, counted from 0)")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1 or index >= count:
        raise ValueError(f"{value!r}: need 0 <= i < N (replicas are counted from 0)")
    return Shard(index, count)


ShardSpec = Annotated[Shard, BeforeValidator(lambda v: v if isinstance(v, Shard) else parse_shard(v))]


class ConfigFile(_Strict):
    listen: Listen = Listen()
    probe_api_token_env: str | None = None
    probe_api_token_file: str | None = None
    defaults: TargetFields = TargetFields()
    targets: list[TargetConfig] = []
    discovery: DiscoveryConfig = DiscoveryConfig()
    max_concurrent_probes: Annotated[int, Field(ge=1, strict=True)] = 4
    history_limit: Annotated[int, Field(ge=1, le=10000, strict=True)] = 100
    # Least time between two probe starts of this exporter (0: no spacing); see scheduler.StartPacer.
    probe_spacing: Annotated[float, BeforeValidator(lambda v: parse_duration(v, allow_zero=True))] = 1.0
    shard: ShardSpec = Shard()


# Built-in values for anything neither the target nor `defaults` sets.
BUILTIN: dict[str, Any] = {
    "interval": 900.0,
    "confirm_after": 60.0,
    "watch_interval": 30.0,
    "restart_probe_delay": 60.0,
    "context_tokens": 16384,
    "token_budget_per_hour": 2_000_000,
    "busy_queue_threshold": 2,
    "api": "auto",
}


@dataclass(frozen=True)
class Target:
    """One resolved target: what the scheduler needs, secrets already read."""

    name: str
    url: str
    api_key: SecretStr | None
    interval_s: float
    token_budget_per_hour: int
    probe: ProbeSettings
    source: str = "config"  # config | env | docker
    confirm_after_s: float = 60.0  # re-probe this soon after a first `silent` (0: wait the interval)
    watch_interval_s: float = 30.0  # restart watch between probes (0: off)
    restart_probe_delay_s: float = 60.0  # probe this long after a detected restart (capped at the interval)

    def summary(self) -> dict[str, Any]:
        """What /api/targets and the status page may show: never the key itself."""
        p = self.probe
        return {
            "name": self.name,
            "url": self.url,
            "source": self.source,
            "api_key": "set" if self.api_key else "none",
            "interval_seconds": self.interval_s,
            "confirm_after_seconds": self.confirm_after_s,
            "watch_interval_seconds": self.watch_interval_s,
            "restart_probe_delay_seconds": self.restart_probe_delay_s,
            "token_budget_per_hour": self.token_budget_per_hour,
            "context_tokens": p.context_tokens,
            "api": p.api,
            "max_pressure_tokens": p.max_pressure_tokens,
            "busy_queue_threshold": p.busy_queue_threshold,
            "busy_running_threshold": p.busy_running_threshold,
        }


@dataclass(frozen=True)
class Settings:
    listen_host: str
    listen_port: int
    probe_api_token: SecretStr | None
    targets: tuple[Target, ...]
    defaults: TargetFields
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
    def discovery_on(self) -> bool:
        return any(x is not None for x in (self.docker, self.prometheus_sd, self.file_sd))

    def secrets(self) -> list[str]:
        """Every secret value in use, for scrubbing text before it leaves the process."""
        vals = [self.probe_api_token, self.default_api_key, *(t.api_key for t in self.targets)]
        return [v.get_secret_value() for v in vals if v is not None and v.get_secret_value()]

    def target_from_defaults(self, name: str, url: str, source: str) -> Target:
        """A target made only from `defaults` (used by discovery)."""
        return _resolve_target(name, url, self.defaults, TargetFields(), self.default_api_key, None, source)


def validate_url(v: str) -> str:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(v)
        port = parts.port  # raises on a bad port
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("must start with http:// or https://")
    if not parts.hostname:
        raise ValueError("has no host")
    if parts.username or parts.password:
        # credentials in a URL end up in logs and /api/targets; use api_key_env / api_key_file
        raise ValueError("must not contain credentials (use api_key_env or api_key_file)")
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment")
    del port
    return v.rstrip("/")


def in_container() -> bool:
    return Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()


def _read_secret(path: str, where: str, problems: list[str]) -> SecretStr | None:
    try:
        value = read_text(path, MAX_SECRET_BYTES).strip()
    except OSError as exc:
        problems.append(f"{where}: cannot read {path}: {exc.strerror or exc}")
        return None
    except FileTooLarge as exc:
        problems.append(f"{where}: {exc} (a secret file holds one key)")
        return None
    except UnicodeDecodeError:
        # Never echo the bytes: they are (part of) a secret.
        problems.append(f"{where}: {path} is not UTF-8 text")
        return None
    if not value:
        problems.append(f"{where}: {path} is empty")
        return None
    return SecretStr(value)


def _resolve_key(fields: TargetFields, where: str, env: Mapping[str, str], problems: list[str]) -> SecretStr | None:
    if fields.api_key_env and fields.api_key_file:
        problems.append(f"{where}: set api_key_env or api_key_file, not both")
        return None
    if fields.api_key_file:
        return _read_secret(fields.api_key_file, f"{where}.api_key_file", problems)
    if fields.api_key_env:
        value = env.get(fields.api_key_env)
        if value is None:
            problems.append(f"{where}.api_key_env: environment variable {fields.api_key_env} is not set")
            return None
        # An empty variable (compose's `${SGLANG_API_KEY:-}`) means: this server needs no key.
        return SecretStr(value) if value else None
    return None


def _resolve_target(
    name: str,
    url: str,
    defaults: TargetFields,
    own: TargetFields,
    default_key: SecretStr | None,
    own_key: SecretStr | None,
    source: str,
) -> Target:
    merged: dict[str, Any] = dict(BUILTIN)
    merged.update({k: getattr(defaults, k) for k in defaults.model_fields_set})
    merged.update({k: getattr(own, k) for k in own.model_fields_set})
    # A target naming its own key source replaces the default one entirely.
    own_sets_key = bool({"api_key_env", "api_key_file"} & own.model_fields_set)
    key = own_key if own_sets_key else default_key
    probe = ProbeSettings(target=name, context_tokens=merged["context_tokens"], api=merged["api"])
    optional = {
        "max_pressure_tokens": "max_pressure_tokens",
        "pressure_chunk_tokens": "pressure_chunk_tokens",
        "busy_queue_threshold": "busy_queue_threshold",
        "busy_running_threshold": "busy_running_threshold",
        "host_hit_threshold": "host_hit_threshold",
        "dp_rank": "dp_rank",
        "request_timeout": "timeout_s",
        "passive_wait": "passive_wait_s",
        "poll_interval": "poll_interval_s",
        "min_cold_latency": "min_cold_latency_s",
    }
    probe = replace(probe, **{dst: merged[src] for src, dst in optional.items() if merged.get(src) is not None})
    return Target(
        name=name,
        url=url,
        api_key=key,
        interval_s=float(merged["interval"]),
        confirm_after_s=float(merged["confirm_after"]),
        watch_interval_s=float(merged["watch_interval"]),
        restart_probe_delay_s=float(merged["restart_probe_delay"]),
        token_budget_per_hour=int(merged["token_budget_per_hour"]),
        probe=probe,
        source=source,
    )


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "constrained-", "literal[")):
            continue  # pydantic's internal validator steps, meaningless to a user
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _message(err: Mapping[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    msg = str(err.get("msg", "invalid"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if msg.startswith("Input should be "):
        msg = "must be " + msg[len("Input should be "):]
    msg = msg.splitlines()[0]
    value = err.get("input")
    if isinstance(value, bool):
        # YAML 1.1 reads unquoted yes/no/on/off/true/false as booleans: `name: off` is False
        words = "on, yes or true" if value else "off, no or false"
        hint = f"YAML reads an unquoted {words} as the boolean {str(value).lower()}"
        msg += f" ({hint}: put the name in quotes)" if kind == "string_type" else f" ({hint})"
    return msg


def _env_value(var: str, raw: str, check: Any, problems: list[str]) -> Any:
    """Validate one HICACHE_CANARY_* value, naming the variable (not a YAML path) on error."""
    try:
        return check(raw)
    except ValueError as exc:
        problems.append(f"{var}: {exc}")
        return None


def _positive_int(raw: str) -> int:
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise ValueError(f"{raw!r} is not a positive whole number")
    return int(raw)


def _port(raw: str) -> int:
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 65535:
        raise ValueError(f"{raw!r} is not a port number")
    return int(raw)


def _env_overrides(doc: dict[str, Any], env: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
    """Apply HICACHE_CANARY_* variables to the raw document (env wins over the file)."""
    doc = dict(doc)
    targets = list(doc.get("targets") or []) if isinstance(doc.get("targets") or [], list) else doc.get("targets")
    raw_url = env.get("HICACHE_CANARY_TARGET_URL")
    if raw_url and isinstance(targets, list):
        url = _env_value("HICACHE_CANARY_TARGET_URL", raw_url, validate_url, problems)
        name = env.get("HICACHE_CANARY_TARGET_NAME") or "sglang"
        if not NAME_RE.match(name):
            problems.append(f"HICACHE_CANARY_TARGET_NAME: {name!r} is not a valid name ({NAME_RULE})")
        elif url is not None:
            kept = next((t for t in targets if isinstance(t, dict) and t.get("name") == name), {})
            targets = [t for t in targets if not (isinstance(t, dict) and t.get("name") == name)]
            targets.append({**kept, "name": name, "url": url})
    for var, key, check in (
        ("HICACHE_CANARY_INTERVAL", "interval", parse_duration),
        ("HICACHE_CANARY_CONTEXT_TOKENS", "context_tokens", _positive_int),
    ):
        if env.get(var):
            value = _env_value(var, env[var], check, problems)
            if value is not None and isinstance(targets, list):
                # env wins over the file: it is how an operator overrides a mounted config
                doc["defaults"] = {**_mapping(doc, "defaults", problems), key: value}
                targets = [({**t, key: value} if isinstance(t, dict) else t) for t in targets]
    if targets is not None:
        doc["targets"] = targets
    if env.get("HICACHE_CANARY_SHARD"):
        # A StatefulSet gives each replica its index: `value: "$(POD_INDEX)/3"` in the pod spec.
        shard = _env_value("HICACHE_CANARY_SHARD", env["HICACHE_CANARY_SHARD"], parse_shard, problems)
        if shard is not None:
            doc["shard"] = shard
    if env.get("HICACHE_CANARY_LISTEN_PORT"):
        port = _env_value("HICACHE_CANARY_LISTEN_PORT", env["HICACHE_CANARY_LISTEN_PORT"], _port, problems)
        if port is not None:
            doc["listen"] = {**_mapping(doc, "listen", problems), "port": port}
    return doc


def _mapping(doc: dict[str, Any], key: str, problems: list[str]) -> dict[str, Any]:
    """doc[key] as a mapping to merge an env override into; a non-mapping is reported, not merged."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{key}: must be a mapping, not {type(value).__name__}")
        return {}
    return value


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently:
    a second `targets:` block would drop the first list without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` then an explicit key: overriding a merged key is the point
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get((type(key), key))  # typed: 1 and true are different keys to a reader
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error names it
            line = key_node.start_mark.line + 1
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first}); give each key once", key_node.start_mark
                )
            seen[(type(key), key)] = line
        return super().construct_mapping(node, deep=deep)


def _key_problems(value: Any, where: str = "") -> list[str]:
    """Keys that are not text (`1:`, `yes:`), reported by their value, not as a list index `[1]`."""
    problems: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                if isinstance(k, bool):
                    shown, kind = str(k).lower(), "a boolean"
                elif isinstance(k, (int, float)):
                    shown, kind = repr(k), "a number"
                else:
                    shown, kind = repr(k), "null" if k is None else f"a {type(k).__name__}"
                problems.append(f"{where + '.' if where else ''}{shown}: unknown key ({kind}, not a name)")
            else:
                problems += _key_problems(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            problems += _key_problems(v, f"{where}[{i}]")
    return problems


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = read_text(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read config: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8"]) from None
    except FileTooLarge as exc:
        raise ConfigError([f"{exc}; not a config file?"]) from None
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError([f"{path}:{where}: {problem}"]) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, not {type(doc).__name__}"])
    problems = _key_problems(doc)
    if problems:
        raise ConfigError(problems)
    return doc


def load_settings(path: str | os.PathLike[str] | None, env: Mapping[str, str] = os.environ) -> Settings:
    """Read, override from env, validate and resolve; raise ConfigError listing every problem."""
    problems: list[str] = []
    doc = _read_yaml(path) if path else {}
    doc = _env_overrides(doc, env, problems)
    try:
        cfg = ConfigFile.model_validate(doc)
    except ValidationError as exc:
        problems += [f"{_loc(e['loc'])}: {_message(e)}" for e in exc.errors()]
        raise ConfigError(problems) from None

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

    token: SecretStr | None = None
    if cfg.probe_api_token_env and cfg.probe_api_token_file:
        problems.append("probe_api_token_env: set probe_api_token_env or probe_api_token_file, not both")
    elif cfg.probe_api_token_file:
        token = _read_secret(cfg.probe_api_token_file, "probe_api_token_file", problems)
    else:
        # No token, no probe endpoint (it answers 403): an unset variable is not an error.
        value = env.get(cfg.probe_api_token_env or "HICACHE_CANARY_API_TOKEN", "")
        token = SecretStr(value) if value else None

    default_key = _resolve_key(cfg.defaults, "defaults", env, problems)
    targets = []
    for i, t in enumerate(cfg.targets):
        own_key = _resolve_key(t, f"targets[{i}]", env, problems)
        source = "env" if env.get("HICACHE_CANARY_TARGET_URL") and t.name == (env.get("HICACHE_CANARY_TARGET_NAME") or "sglang") else "config"
        targets.append(_resolve_target(t.name, t.url, cfg.defaults, t, default_key, own_key, source))
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
