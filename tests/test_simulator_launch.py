"""The one simulator launcher (demo, bench and tests start simulators through it): a simulator that
cannot start fails fast with its own words, and stopping one frees its port and its log."""

from __future__ import annotations

import time

import httpx
import pytest

from hicache_canary.simulator.launch import SimulatorStartError, start


def test_a_bad_flag_fails_fast_quoting_the_simulators_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(SimulatorStartError) as err:
        start(["--hicache-write-policy", "write_sideways"], name="bad simulator", timeout_s=30)
    msg = str(err.value)
    assert time.monotonic() - t0 < 20  # it noticed the exit, it did not wait out the timeout
    assert msg.startswith("the bad simulator exited with 2")
    assert "write_sideways" in msg  # argparse's own message, from the log tail


def test_a_simulator_that_never_answers_health_times_out_with_its_log() -> None:
    # 10 ms is shorter than the interpreter's own start-up: /health cannot have answered yet.
    with pytest.raises(SimulatorStartError) as err:
        start([], name="slow simulator", timeout_s=0.01)
    assert "did not answer http://127.0.0.1:" in str(err.value) and "/health within 0.01 s" in str(err.value)


def test_stop_frees_the_port_and_removes_the_temporary_log() -> None:
    sim = start([], time_scale=0.001)
    assert httpx.get(sim.url + "/health", timeout=5).status_code == 200
    log = sim.log_path
    assert sim.stop() is not None
    assert not log.exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url + "/health", timeout=2)
