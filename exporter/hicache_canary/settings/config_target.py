"""One target's settings: the YAML fields (built from the knob table, target_knobs.py), and the
resolved `Target` (built-ins < `defaults` < the target's own keys, secrets read) the scheduler uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import SecretStr, create_model

from hicache_canary.settings.config_types import KINDS, Name, Strict, Url
from hicache_canary.models import ProbeSettings
from hicache_canary.settings.secrets_loader import SecretError, read_secret_file
from hicache_canary.settings.target_knobs import BUILTIN, KNOBS, SCHEDULE_KNOBS

# Every per-target knob, each optional: unset means "from `defaults`, else built in".
TargetFields = create_model(  # type: ignore[call-overload]
    "TargetFields",
    __base__=Strict,
    __module__=__name__,
    api_key_env=(Optional[str], None),
    api_key_file=(Optional[str], None),
    **{k.key: (Optional[KINDS[k.kind]], None) for k in KNOBS},
)
TargetFields.__doc__ = "Every per-target knob; each may also be set under `defaults`."


class TargetConfig(TargetFields):  # type: ignore[misc, valid-type]
    name: Name
    url: Url


@dataclass(frozen=True)
class Target:
    """One resolved target: what the scheduler needs, secrets already read.

    The scheduling knobs (`interval_s`, `confirm_after_s`, `watch_interval_s`,
    `restart_probe_delay_s`, `token_budget_per_hour`) are attributes named by target_knobs.KNOBS."""

    name: str
    url: str
    api_key: SecretStr | None
    interval_s: float
    token_budget_per_hour: int
    probe: ProbeSettings
    source: str = "config"  # config | env | docker
    confirm_after_s: float = BUILTIN["confirm_after"]
    watch_interval_s: float = BUILTIN["watch_interval"]
    restart_probe_delay_s: float = BUILTIN["restart_probe_delay"]

    def summary(self) -> dict[str, Any]:
        """What /api/targets and the status page may show: never the key itself."""
        out: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "source": self.source,
            "api_key": "set" if self.api_key else "none",
        }
        for k in KNOBS:
            if k.shown:
                out[k.shown] = getattr(self.probe if k.probe else self, k.attr)
        return out


def resolve_key(fields: Any, where: str, env: Mapping[str, str], problems: list[str]) -> SecretStr | None:
    """The key `fields` (a TargetFields) names; a problem is appended, naming `where`."""
    if fields.api_key_env and fields.api_key_file:
        problems.append(f"{where}: set api_key_env or api_key_file, not both")
        return None
    if fields.api_key_file:
        return secret_file(fields.api_key_file, f"{where}.api_key_file", problems)
    if fields.api_key_env:
        value = env.get(fields.api_key_env)
        if value is None:
            problems.append(f"{where}.api_key_env: environment variable {fields.api_key_env} is not set")
            return None
        # An empty variable (compose's `${SGLANG_API_KEY:-}`) means: this server needs no key.
        return SecretStr(value) if value else None
    return None


def secret_file(path: str, where: str, problems: list[str]) -> SecretStr | None:
    try:
        return SecretStr(read_secret_file(path))
    except SecretError as exc:
        problems.append(f"{where}: {exc}")
        return None


def resolve_target(
    name: str,
    url: str,
    defaults: Any,
    own: Any,
    default_key: SecretStr | None,
    own_key: SecretStr | None,
    source: str,
) -> Target:
    """built-ins < `defaults` < the target's own keys (both TargetFields)."""
    merged: dict[str, Any] = dict(BUILTIN)
    for fields in (defaults, own):
        merged.update({k: getattr(fields, k) for k in fields.model_fields_set if getattr(fields, k) is not None})
    # A target naming its own key source replaces the default one entirely.
    own_sets_key = bool({"api_key_env", "api_key_file"} & own.model_fields_set)
    probe = ProbeSettings(target=name, **{k.attr: merged[k.key] for k in KNOBS if k.probe})
    return Target(
        name=name,
        url=url,
        api_key=own_key if own_sets_key else default_key,
        probe=probe,
        source=source,
        **{k.attr: k.type(merged[k.key]) for k in SCHEDULE_KNOBS},
    )
