"""A config that must not be used, and pydantic's errors turned into one line per problem naming its
YAML path (`targets[1].url: ...`) in words a user of the config file reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError


class ConfigError(Exception):
    """A config that must not be used. `str()` is one line per problem, each naming its path."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def problems_of(exc: ValidationError) -> list[str]:
    return [f"{_loc(e['loc'])}: {_message(e)}" for e in exc.errors()]


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
