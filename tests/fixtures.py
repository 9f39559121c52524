"""Where the real SGLang outputs live: tests/testdata/sglang (copied in; see its README).

One home for the path so no test reaches outside the repository for data.
"""

from __future__ import annotations

import json
from pathlib import Path

SGLANG = Path(__file__).resolve().parent / "testdata" / "sglang"


def sglang_path(rel: str) -> Path:
    path = SGLANG / rel
    if not path.is_file():
        raise FileNotFoundError(f"real SGLang fixture {path} is missing from the repository")
    return path


def sglang_text(rel: str) -> str:
    return sglang_path(rel).read_text()


def sglang_json(rel: str):
    return json.loads(sglang_text(rel))
