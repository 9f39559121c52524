import sys
from pathlib import Path

# Tests import helpers as `procs`; the package itself is installed (scripts/test uses `pip install -e`).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))


import pytest  # noqa: E402

from procs import start_simulator  # noqa: E402


@pytest.fixture
def sim():
    """Start simulators as real processes: `url = sim(*flags, time_scale=...)`; all stopped after the test."""
    started = []

    def start(*flags: str, time_scale: float = 0.002) -> str:
        proc, url = start_simulator(*flags, time_scale=time_scale)
        started.append(proc)
        return url

    yield start
    for p in started:
        p.stop()
