"""`hicache-canary demo` as a user runs it: two simulator processes, two probes, two tables."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import httpx
import pytest

from procs import canary_argv, start_simulator


def sim_urls(stderr: str) -> list[str]:
    return re.findall(r"simulator at (http://127\.0\.0\.1:\d+)", stderr)


def assert_down(url: str) -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_demo_shows_silent_write_through_next_to_reused_write_back() -> None:
    started = time.monotonic()
    p = subprocess.run(canary_argv("demo", "--poll-interval", "0.05"), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert p.returncode == 0, p.stdout + p.stderr
    assert "time scale 0.2" in p.stderr
    header = next(line for line in p.stdout.splitlines() if line.startswith("target write_through"))
    assert "target write_back" in header  # the two tables side by side
    verdicts = next(line for line in p.stdout.splitlines() if line.startswith("verdict: silent"))
    assert "verdict: reused" in verdicts
    assert "suspected cause: mamba_state_not_backed_up" in p.stdout
    assert "write_through: silent, write_back: reused" in p.stdout
    assert took < 45, f"demo took {took:.1f} s"
    urls = sim_urls(p.stderr)
    assert len(urls) == 2
    for url in urls:
        assert_down(url)


def test_ctrl_c_stops_both_simulators() -> None:
    proc = subprocess.Popen(canary_argv("demo", "--time-scale", "1"), stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while len(sim_urls("".join(lines))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stderr.readline())
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "Traceback" not in err
    for url in sim_urls("".join(lines)):
        assert_down(url)


def test_demo_with_target_probes_that_server() -> None:
    sim, url = start_simulator("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model",
                               "--max-total-tokens", "40000", "--hicache-write-policy", "write_back")
    try:
        p = subprocess.run(canary_argv("demo", "--target", url, "--context-tokens", "8192", "--poll-interval", "0.05"),
                           capture_output=True, text=True, timeout=60)
    finally:
        sim.stop()
    assert p.returncode == 0, p.stderr
    assert f"target {url}" in p.stdout and "verdict: reused" in p.stdout
    assert "simulator at" not in p.stderr
