"""The kinds of value a config holds (durations, counts, ratios, ports, URLs, names), each validated
by one rule, and the strict base every config section is built on."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

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


def validate_url(v: str) -> str:
    try:
        parts = urlsplit(v)
        parts.port  # raises on a bad port
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
    return v.rstrip("/")


def validate_name(v: str) -> str:
    if not NAME_RE.match(v):
        raise ValueError(f"{v!r} is not a valid name ({NAME_RULE})")
    return v


Duration = Annotated[float, BeforeValidator(parse_duration)]
DurationOrZero = Annotated[float, BeforeValidator(lambda v: parse_duration(v, allow_zero=True))]
# Strict: pydantic's lax mode turns YAML's `yes`/`on`/`true` into 1 (and `no`/`off` into 0), so
# `context_tokens: yes` would probe with a one-token R. Strict ints take ints only; strict floats
# take ints and floats, never booleans or strings, and never NaN or infinity.
PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegInt = Annotated[int, Field(ge=0, strict=True)]
Ratio = Annotated[float, Field(gt=0, le=1, strict=True, allow_inf_nan=False)]
Port = Annotated[int, Field(ge=1, le=65535, strict=True)]
Url = Annotated[str, AfterValidator(validate_url)]
Name = Annotated[str, AfterValidator(validate_name)]

# The validated type of each `target_knobs.Knob.kind`.
KINDS: dict[str, Any] = {
    "duration": Duration,
    "duration_or_zero": DurationOrZero,
    "positive_int": PositiveInt,
    "non_negative_int": NonNegInt,
    "ratio": Ratio,
    "api": Literal["auto", "native", "openai"],
}


class Strict(BaseModel):
    """A config section: unknown keys are errors, and the result is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
