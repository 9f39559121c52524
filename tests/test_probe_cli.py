"""`hicache-canary probe` as a user runs it: a real CLI process against a real simulator process."""

from __future__ import annotations

import json
import subprocess

import pytest

from procs import canary_argv, free_port

REPORT = ("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--max-total-tokens", "400000",
          "--hicache-host-tokens", "709577", "--chunked-prefill-size", "4096")
SCALED = ("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--max-total-tokens", "40000",
          "--hicache-host-tokens", "70958", "--chunked-prefill-size", "4096")
FAST = ("--poll-interval", "0.05", "--passive-wait", "1")


def run_probe_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(canary_argv("probe", *args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def table_row(stdout: str, name: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(name + " "))
    return line.split()


def ratio(stdout: str) -> float:
    return float(next(line for line in stdout.splitlines() if line.startswith("rehost/cold ratio")).split()[-1])


@pytest.mark.parametrize(
    "policy, code, verdict",
    [
        pytest.param("write_back", 0, "reused", id="write-back-exit-0"),
        pytest.param("write_through", 1, "silent", id="write-through-exit-1"),
    ],
)
def test_report_shape_with_40k_context(sim, policy, code, verdict) -> None:
    url = sim(*REPORT, "--hicache-write-policy", policy, time_scale=0.02)  # cold 40K ~0.3 s
    p = run_probe_cli("--target", url, "--context-tokens", "40000", *FAST)
    assert p.returncode == code, p.stdout + p.stderr
    for row in ("R-cold", "pressure", "R-rehost", "R-again"):
        table_row(p.stdout, row)
    assert f"verdict: {verdict}" in p.stdout
    assert "evidence:" in p.stdout
    cold, rehost, again = (float(table_row(p.stdout, n)[1]) for n in ("R-cold", "R-rehost", "R-again"))
    assert again < 0.5 * cold  # the device hit baseline (report: 0.1 s)
    if verdict == "silent":
        assert 0.7 < ratio(p.stdout) < 1.4  # cold ~ rehost, as in the report (15.4 s vs 15.5 s)
        assert "suspected cause: mamba_state_not_backed_up" in p.stdout
    else:
        assert ratio(p.stdout) < 0.5  # the report: 0.4 s against 15.4 s (HTTP overhead weighs more here)
    # Cost: R three times plus what LRU needs (the floor), within 1.1x; the report's manual method
    # spent 40K + 10x40K + 2x40K = 520K (write_through) and 40K + 14x40K + 2x40K = 680K (write_back).
    sent = next(line for line in p.stdout.splitlines() if line.startswith("tokens sent"))
    total = int(sent.split("=")[1].split()[0].replace(",", ""))
    eviction = next(line for line in p.stdout.splitlines() if line.startswith("eviction: LRU needed"))
    need = int(eviction.split("LRU needed")[1].split(";")[0].replace(",", ""))
    assert total <= 1.1 * (3 * 40_000 + need)
    assert total <= 520_000 * 1.01


def test_plain_progress_lines_on_a_pipe(sim) -> None:
    url = sim(*SCALED, "--hicache-write-policy", "write_back")
    p = run_probe_cli("--target", url, "--context-tokens", "8192", *FAST)
    assert p.returncode == 0, p.stderr
    phases = [line.split()[0] for line in p.stderr.splitlines()]
    for phase in ("preflight", "cold", "pressure", "rehost", "again", "done"):
        assert phase in phases, p.stderr
    assert "\r" not in p.stderr


def test_hicache_off_exits_4(sim) -> None:
    url = sim("--enable-metrics")
    p = run_probe_cli("--target", url, *FAST)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "verdict: hicache_disabled" in p.stdout


def test_not_evicted_exits_2(sim) -> None:
    url = sim(*SCALED)
    p = run_probe_cli("--target", url, "--context-tokens", "8192", "--max-pressure-tokens", "1000", *FAST)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "verdict: not_evicted" in p.stdout


def test_json_is_the_whole_record_without_secrets(sim) -> None:
    url = sim(*SCALED, "--hicache-write-policy", "write_back", "--api-key", "s3cret-key-value")
    p = run_probe_cli("--target", url, "--context-tokens", "8192", "--api-key-env", "SGLANG_KEY", "--json", *FAST,
                      env={"SGLANG_KEY": "s3cret-key-value"})
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["verdict"] == "reused" and rec["cause"] == "none"
    assert [s["phase"] for s in rec["steps"]] == ["warmup", "cold", "pressure", "rehost", "again"]  # a fresh server
    assert rec["tokens_canary"] == 64 + 3 * rec["context_tokens"]
    assert "s3cret-key-value" not in p.stdout + p.stderr


@pytest.mark.parametrize(
    "flags, reason",
    [
        pytest.param(("--fault-5xx-rate", "1"), "http_5xx", id="5xx"),
        pytest.param(("--fault-malformed-json",), "bad_response", id="malformed-json"),
        pytest.param(("--api-key", "right"), "unauthorized", id="no-api-key"),
    ],
)
def test_server_errors_exit_3_with_one_line(sim, flags, reason) -> None:
    url = sim(*SCALED, *flags)
    p = run_probe_cli("--target", url, *FAST)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line and line.startswith("hicache-canary")]
    assert len(errors) == 1 and f"({reason})" in errors[0], p.stderr


def test_nothing_listening_exits_3() -> None:
    p = run_probe_cli("--target", f"http://127.0.0.1:{free_port()}", *FAST)
    assert p.returncode == 3 and "connect_failed" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(("--target", "localhost:30000"), "is not an http(s)://host[:port] URL", id="url-without-scheme"),
        pytest.param(("--target", "http://x", "--context-tokens", "-5"), "must be positive", id="negative-context"),
        pytest.param(("--target", "http://x", "--timeout", "soon"), "is not a number", id="timeout-not-a-number"),
        pytest.param(("--target", "http://x", "--api-key-file", "/nonexistent/key"),
                     "cannot read API key file /nonexistent/key: No such file or directory", id="missing-key-file"),
        # The same bounded read as the exporter's config: never a MemoryError on a device file.
        pytest.param(("--target", "http://x", "--api-key-file", "/dev/zero"),
                     "API key file /dev/zero is larger than 4 KiB (a secret file holds one key)", id="key-file-dev-zero"),
        pytest.param(("--target", "http://x", "--api-key-env", "HICACHE_TEST_UNSET_VAR"), "is not set", id="unset-key-env"),
        pytest.param(("--target", "http://x", "--api", "grpc"), "invalid choice", id="unknown-api"),
    ],
)
def test_bad_input_is_one_line_and_exit_3(args, message) -> None:
    p = run_probe_cli(*args)
    assert p.returncode == 3
    assert message in p.stderr and "Traceback" not in p.stderr
    assert len([line for line in p.stderr.splitlines() if "error" in line]) == 1
