"""HICACHE_CANARY_* environment variables applied to the raw config document (env wins over the
file: it is how an operator overrides a mounted config). Each bad value is reported naming the
variable, not a YAML path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache_canary.settings.config_types import NAME_RE, NAME_RULE, parse_duration, validate_url
from hicache_canary.settings.discovery_config import parse_shard

DEFAULT_TARGET_NAME = "sglang"


def env_target_name(env: Mapping[str, str]) -> str | None:
    """The name of the target HICACHE_CANARY_TARGET_URL defines, if it is set."""
    return (env.get("HICACHE_CANARY_TARGET_NAME") or DEFAULT_TARGET_NAME) if env.get("HICACHE_CANARY_TARGET_URL") else None


def _env_value(var: str, raw: str, check: Any, problems: list[str]) -> Any:
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


def env_overrides(doc: dict[str, Any], env: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
    """Apply HICACHE_CANARY_* variables to the raw document (env wins over the file)."""
    doc = dict(doc)
    targets = list(doc.get("targets") or []) if isinstance(doc.get("targets") or [], list) else doc.get("targets")
    raw_url = env.get("HICACHE_CANARY_TARGET_URL")
    if raw_url and isinstance(targets, list):
        url = _env_value("HICACHE_CANARY_TARGET_URL", raw_url, validate_url, problems)
        name = env.get("HICACHE_CANARY_TARGET_NAME") or DEFAULT_TARGET_NAME
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
