"""Probe records as `hicache-canary probe --json` wrote them, read back into the typed models.

So a record captured on a real SGLang can be judged again by today's verdict rules, without the
server: the live conformance runs (tests/testdata/sglang/) become regression tests.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path
from typing import Any

from hicache_canary.models import (
    CachedTokens,
    Cause,
    CounterSnapshot,
    ErrorReason,
    Phase,
    PressureRecord,
    ProbeRecord,
    ServerFacts,
    StepRecord,
    Verdict,
)


def _fields(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def snapshot(d: dict[str, Any] | None) -> CounterSnapshot | None:
    if d is None:
        return None
    kept = _fields(CounterSnapshot, d)
    kept["families"] = frozenset(kept.get("families", ()))
    kept["parse_errors"] = tuple(kept.get("parse_errors", ()))
    return CounterSnapshot(**kept)


def record(d: dict[str, Any]) -> ProbeRecord:
    rec = ProbeRecord(**{k: v for k, v in _fields(ProbeRecord, d).items() if k not in ("server", "steps", "pressure", "verdict", "cause", "reason")})
    rec.server = ServerFacts(**_fields(ServerFacts, d["server"])) if d.get("server") else None
    rec.pressure = PressureRecord(**_fields(PressureRecord, d.get("pressure") or {}))
    for s in d.get("steps", []):
        step = StepRecord(**{k: v for k, v in _fields(StepRecord, s).items() if k not in ("phase", "cached", "before", "after")},
                          phase=Phase(s["phase"]))
        step.cached = CachedTokens(**s["cached"]) if s.get("cached") else None
        step.before, step.after = snapshot(s.get("before")), snapshot(s.get("after"))
        rec.steps.append(step)
    rec.verdict = Verdict(d["verdict"]) if d.get("verdict") else None
    rec.cause = Cause(d.get("cause") or "none")
    rec.reason = ErrorReason(d["reason"]) if d.get("reason") else None
    return rec


def records_in_archive(path: Path, pattern: str = "/probes/") -> dict[str, dict[str, Any]]:
    """Every probe JSON in a conformance archive, by its path inside the archive."""
    out = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.isfile() and pattern in m.name and m.name.endswith(".json"):
                out[m.name] = json.load(io.TextIOWrapper(tar.extractfile(m), encoding="utf-8"))
    return out
