"""Text rendering for the one-shot commands: live progress on stderr, the probe table, side-by-side.

The table has the field report's shape: one row per step (R-cold, R-prime on write_through_selective,
pressure, R-rehost, R-again) with
latency, prompt tokens, cached device/host tokens and the host pool before/after the step, then
the rehost/cold ratio, the verdict, the suspected cause and the evidence sentence.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import shutil
import textwrap
import time
from typing import Any, TextIO

from hicache_canary.probe.canary import ProgressEvent
from hicache_canary.service.history import eviction_confirmed
from hicache_canary.models import Cause, Phase, ProbeRecord, StepRecord

ROW_NAMES = {Phase.WARMUP: "warm-up", Phase.COLD: "R-cold", Phase.PRIME: "R-prime", Phase.PRESSURE: "pressure", Phase.REHOST: "R-rehost", Phase.AGAIN: "R-again"}
HEADERS = ("step", "latency", "prompt tok", "cached dev/host", "host pool before -> after")


class ProgressLine:
    """Callable progress sink: one rewritten line on a TTY, plain lines (throttled) otherwise."""

    def __init__(self, stream: TextIO, *, tty: bool | None = None, label: str = "", min_interval_s: float = 2.0):
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.label = f"[{label}] " if label else ""
        self.min_interval_s = min_interval_s
        self._last_phase: object = None
        self._last_plain = 0.0
        self._width = 0

    def __call__(self, ev: ProgressEvent) -> None:
        phase = ev.phase.value if isinstance(ev.phase, Phase) else str(ev.phase)
        plan = f"{ev.tokens_sent:,}/{ev.tokens_planned:,} tokens" if ev.tokens_planned else f"{ev.tokens_sent:,} tokens"
        line = f"{self.label}{phase:<9} {plan}  {ev.elapsed_s:6.1f} s" + (f"  {ev.note}" if ev.note else "")
        if self.tty:
            cols = shutil.get_terminal_size((100, 20)).columns - 1
            line = line[:cols]
            pad = max(0, self._width - len(line))
            self._width = len(line)
            end = "\n" if phase == "done" else ""
            self.stream.write("\r" + line + " " * pad + end)
        else:
            now = time.monotonic()
            if phase == self._last_phase and phase != "done" and now - self._last_plain < self.min_interval_s:
                return  # plain logs get phase changes and a line every few seconds, not every chunk
            self._last_plain = now
            self.stream.write(line + "\n")
        self._last_phase = phase
        self.stream.flush()


def _n(x: float | int | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _row(step: StepRecord) -> tuple[str, ...]:
    lat = "-" if step.latency_s is None else f"{step.latency_s:.3f} s"
    if step.phase == Phase.PRESSURE:
        lat, cached = f"{step.requests} req", "-"
    elif step.cached is not None:
        cached = f"{step.cached.device:,}/{step.cached.host:,}"
    else:
        cached = f"{_n(step.cached_tokens)}/?" if step.cached_tokens is not None else "?"
    before = step.before.host_used_tokens if step.before else None
    after = step.after.host_used_tokens if step.after else None
    return (ROW_NAMES[step.phase], lat, _n(step.prompt_tokens), cached, f"{_n(before)} -> {_n(after)}")


def render_table(rec: ProbeRecord, *, width: int = 100) -> str:
    """The probe's table plus verdict lines, as plain text."""
    rows = [HEADERS] + [_row(s) for s in rec.steps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = [f"target {rec.target}" + _server_line(rec)]
    if len(rows) > 1:
        lines += [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]
    total = _host_total(rec)
    if total:
        lines.append(f"host pool total {total:,.0f} tokens")
    if rec.rehost_cold_ratio is not None:
        lines.append(f"rehost/cold ratio {rec.rehost_cold_ratio:.3f}")
    if rec.steps:
        p = rec.pressure
        lines.append(f"tokens sent: canary {rec.tokens_canary:,} + pressure {rec.tokens_pressure:,} = {rec.tokens_canary + rec.tokens_pressure:,}")
        lines += textwrap.wrap(
            f"eviction: LRU needed {p.planned_tokens:,}; server traffic credited {p.passive_tokens:,}; "
            f"{'confirmed' if eviction_confirmed(rec) else 'not confirmed'}{'; cut by ' + p.limited_by if p.limited_by else ''}",
            width=width, subsequent_indent="  ",
        )
    verdict = rec.verdict.value if rec.verdict else "?"
    if rec.reason is not None:
        verdict += f" ({rec.reason.value})"
    lines.append(f"verdict: {verdict}")
    if rec.cause != Cause.NONE:
        lines.append(f"suspected cause: {rec.cause.value}")
    lines += textwrap.wrap(f"evidence: {rec.evidence}", width=width, subsequent_indent="  ")
    return "\n".join(lines)


def _host_total(rec: ProbeRecord) -> float | None:
    for step in reversed(rec.steps):
        for snap in (step.after, step.before):
            if snap is not None and snap.host_total_tokens:
                return snap.host_total_tokens
    return None


def _server_line(rec: ProbeRecord) -> str:
    f = rec.server
    if f is None:
        return ""
    bits = [f"SGLang {f.version}" if f.version else "", f"policy {f.write_policy}" if f.write_policy else "", "hybrid" if f.hybrid_model else "", f"api {rec.api}"]
    return " (" + ", ".join(b for b in bits if b) + ")"


def side_by_side(left: str, right: str, gap: int = 4) -> str:
    a, b = left.splitlines(), right.splitlines()
    w = max((len(x) for x in a), default=0)
    n = max(len(a), len(b))
    a += [""] * (n - len(a))
    b += [""] * (n - len(b))
    return "\n".join((x.ljust(w + gap) + y).rstrip() for x, y in zip(a, b))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in obj]
        return sorted(items) if isinstance(obj, (set, frozenset)) else items
    return obj


def record_json(rec: ProbeRecord) -> str:
    """The whole record as JSON (enums as values). The record holds no credentials."""
    data = _jsonable(rec)
    data["tokens_canary"], data["tokens_pressure"] = rec.tokens_canary, rec.tokens_pressure
    return json.dumps(data, indent=2)
