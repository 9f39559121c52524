"""Ten consecutive probes against one simulator per policy, as an operator's cron would run them.

The live SGLang 0.5.17 servers (tests/testdata/sglang/sglang-0.5.17-live/consecutive-probes) were right
on their first probe and `not_evicted` on every later write_through probe: after R's cold request its
write-through kept it locked (used, not evictable) until the next scheduler step, so a pressure plan
read from `kv_available + kv_evictable` left R out and other entries' evictions "confirmed" it gone.
The simulator shares its cache between the ten probes, so history accumulates as on a live server.

Geometry: the live servers' (`--max-total-tokens 40000 --chunked-prefill-size 2048
--max-mamba-cache-size 32 --hicache-ratio 4`, hybrid model, R = 16,384, the probe's default), at a time
scale where a cold R takes ~12 ms. Each probe runs through the real CLI (`hicache-canary probe --json`).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from procs import canary_argv

LIVE = ("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--max-total-tokens", "40000",
        "--chunked-prefill-size", "2048", "--max-mamba-cache-size", "32", "--hicache-ratio", "4",
        "--max-running-requests", "4", "--context-length", "32768")
V0517 = ("--metrics-profile", "0.5.17")  # the live servers' version
PROBES = 10


@pytest.mark.parametrize(
    "flags, verdict, cause",
    [
        pytest.param((*V0517, "--hicache-write-policy", "write_through", "--hybrid-failure", "none"), "reused",
                     "none", id="write-through"),
        pytest.param((*V0517, "--hicache-write-policy", "write_back", "--hybrid-failure", "none"), "reused", "none",
                     id="write-back"),
        pytest.param((*V0517, "--hicache-write-policy", "write_through_selective", "--hybrid-failure", "none"),
                     "reused", "none", id="write-through-selective"),
        # The field report's build (0.5.23 metrics, with the backup counters that name the cause): KV reaches
        # host, the Mamba state never does. Silent, every time.
        pytest.param(("--hicache-write-policy", "write_through"), "silent", "mamba_state_not_backed_up",
                     id="write-through-report-build"),
    ],
)
def test_ten_consecutive_probes_are_each_conclusive_and_right(sim, flags, verdict, cause) -> None:
    url = sim(*LIVE, *flags, time_scale=0.002)
    seen = []
    for i in range(PROBES):
        p = subprocess.run(canary_argv("probe", "--target", url, "--json", "--poll-interval", "0.05",
                                       "--passive-wait", "1", "--timeout", "60"),
                           capture_output=True, text=True, timeout=120)
        assert p.stdout, p.stderr
        rec = json.loads(p.stdout)
        rehost = next((s for s in rec["steps"] if s["phase"] == "rehost"), {})
        seen.append(f"probe {i + 1}: {rec['verdict']}/{rec['cause']} (rehost cached {rehost.get('cached')}, "
                    f"eviction_confirmed {rec['pressure']['eviction_confirmed']}): {rec['evidence']}")
    # Every probe's outcome in the message, so a failure shows where the run went wrong.
    wrong = [line for line in seen if not line.split(": ", 1)[1].startswith(f"{verdict}/{cause} ")]
    assert not wrong, "\n".join(seen)
