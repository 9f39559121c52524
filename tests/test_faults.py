"""Fault matrix (issue 7): every way a target can break ends in a defined verdict with a bounded
reason, and the next probe works once the fault clears.

Most rows drive `canary.run_probe` directly (fast) against a real simulator process, either
through `misbehaving.FaultProxy` (a fault in one chosen phase of the probe) or with the
simulator's own fault switches (`/_sim/faults`, `--fault-down-after`). A representative subset
runs through the real exporter process (`hicache-canary serve`): /metrics keeps answering, fast,
while the fault is on, shows `verdict="error"` and the reason, then a real verdict again.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hicache_canary.probe.canary import run_probe
from hicache_canary.models import ErrorReason, ProbeRecord, ProbeSettings, Verdict
from hicache_canary.probe.sglang_client import SGLangClient
from misbehaving import FaultProxy
from procs import REPO, Proc, canary_argv, free_port, start_simulator

# The report's hybrid server scaled down 20x, write_back (it reuses: a clean probe says `reused`).
SIM = ("--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--hicache-write-policy", "write_back",
       "--max-total-tokens", "8000", "--hicache-host-tokens", "16000", "--chunked-prefill-size", "1024")
CONTEXT = 2048
CHUNK = 4096  # filler per request: two or three requests evict R, so a probe is a dozen HTTP calls
TIMEOUT_S = 0.5  # per request; the stalled phase is abandoned after this
MAX_EVIDENCE = 400  # the client's 300-character message plus the phase and path


def settings(**kw) -> ProbeSettings:
    return ProbeSettings(**{"target": "sim", "context_tokens": CONTEXT, "poll_interval_s": 0.05, "passive_wait_s": 0.0,
                            "pressure_chunk_tokens": CHUNK, "timeout_s": TIMEOUT_S, **kw})


async def probe(url: str, **kw) -> ProbeRecord:
    async with SGLangClient(url, small_timeout=TIMEOUT_S, connect_timeout=TIMEOUT_S) as c:
        return await run_probe(c, settings(**kw), rng=random.Random())


def assert_bounded(rec: ProbeRecord) -> None:
    assert rec.finished_at is not None
    assert rec.evidence and "\n" not in rec.evidence and len(rec.evidence) <= MAX_EVIDENCE, rec.evidence


async def assert_recovers(url: str) -> None:
    rec = await probe(url)
    assert (rec.verdict, rec.reason) == (Verdict.REUSED, None), rec.evidence


@pytest.fixture(scope="module")
def sim():
    proc, url = start_simulator(*SIM, time_scale=0.002)
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def proxy(sim):
    with FaultProxy(sim) as p:
        yield p


@pytest.fixture
def clean(proxy, sim):
    proxy.clear()
    httpx.post(sim + "/_sim/faults", json=NO_SIM_FAULTS).raise_for_status()
    yield proxy
    proxy.clear()
    httpx.post(sim + "/_sim/faults", json=NO_SIM_FAULTS).raise_for_status()


NO_SIM_FAULTS = {"down_after": None, "rate_5xx": 0.0, "rate_429": 0.0, "slow_s": 0.0, "malformed_json": False, "metrics_missing": False}
TO = f"read timed out after {TIMEOUT_S}s"

# phase, kind, verdict, reason, exact evidence (None: a real verdict, whose evidence is the verdict's own)
PROXY_ROWS = [
    ("preflight", "stall", Verdict.ERROR, ErrorReason.TIMEOUT, f"preflight: GET /server_info: {TO}"),
    ("metrics", "stall", Verdict.ERROR, ErrorReason.TIMEOUT, f"preflight: GET /metrics: {TO}"),
    ("cold", "stall", Verdict.ERROR, ErrorReason.TIMEOUT, f"cold: POST /generate: {TO}"),
    ("pressure", "stall", Verdict.ERROR, ErrorReason.TIMEOUT, f"pressure: POST /generate: {TO}"),
    ("rehost", "stall", Verdict.ERROR, ErrorReason.TIMEOUT, f"rehost: POST /generate: {TO}"),
    ("again", "stall", Verdict.ERROR, ErrorReason.TIMEOUT, f"again: POST /generate: {TO}"),
    ("cold", "hangup", Verdict.ERROR, ErrorReason.CONNECTION_LOST, "cold: POST /generate: server closed the connection before answering"),
    ("rehost", "hangup", Verdict.ERROR, ErrorReason.CONNECTION_LOST, "rehost: POST /generate: server closed the connection before answering"),
    ("metrics", "hangup", Verdict.ERROR, ErrorReason.CONNECTION_LOST, "preflight: GET /metrics: server closed the connection before answering"),
    ("preflight", "http_500", Verdict.ERROR, ErrorReason.HTTP_5XX, "preflight: GET /server_info: HTTP 500: Internal Server Error"),
    ("rehost", "http_500", Verdict.ERROR, ErrorReason.HTTP_5XX, "rehost: POST /generate: HTTP 500: Internal Server Error"),
    ("metrics", "http_500", Verdict.ERROR, ErrorReason.HTTP_5XX, "preflight: GET /metrics: HTTP 500: Internal Server Error"),
    ("pressure", "http_429", Verdict.ERROR, ErrorReason.RATE_LIMITED, "pressure: POST /generate: HTTP 429: Too many requests, retry later"),
    ("again", "garbage_json", Verdict.ERROR, ErrorReason.BAD_RESPONSE, "again: POST /generate: body is not JSON: '<html><body>502 Bad Gateway</body></html>'"),
    ("preflight", "garbage_json", Verdict.ERROR, ErrorReason.BAD_RESPONSE, "preflight: GET /server_info: body is not JSON: '<html><body>502 Bad Gateway</body></html>'"),
    ("cold", "truncated", Verdict.ERROR, ErrorReason.CONNECTION_LOST, None),
    ("cold", "no_prompt_tokens", Verdict.ERROR, ErrorReason.BAD_RESPONSE, "cold: meta_info lacks prompt_tokens"),
    # Degraded, not broken: the canary falls back to the next evidence (docs/verdicts.md) and still judges.
    ("rehost", "no_cached_fields", Verdict.REUSED, None, None),
    ("metrics", "metrics_garbage", Verdict.REUSED, None, None),
    ("metrics", "metrics_no_sglang", Verdict.REUSED, None, None),
    ("cold", "slow", Verdict.REUSED, None, None),
    # SGLang restarted mid-probe on a server that had already counted past this probe's tokens
    ("rehost", "restart", Verdict.ERROR, ErrorReason.SERVER_RESTARTED, "rehost: the server restarted during the probe (its counters went back)"),
    ("pressure", "restart", Verdict.ERROR, ErrorReason.SERVER_RESTARTED, "pressure: the server restarted during the probe (its counters went back)"),
    # Issue 14: a body without end is read up to a limit, never into all of memory.
    ("metrics", "endless_body", Verdict.ERROR, ErrorReason.BAD_RESPONSE, "preflight: GET /metrics: body is larger than the 16777216-byte limit"),
    ("preflight", "endless_body", Verdict.ERROR, ErrorReason.BAD_RESPONSE, "preflight: GET /server_info: body is larger than the 4194304-byte limit"),
    ("again", "endless_body", Verdict.ERROR, ErrorReason.BAD_RESPONSE, "again: POST /generate: body is larger than the 4194304-byte limit"),
]


@pytest.mark.parametrize("phase,kind,verdict,reason,evidence", PROXY_ROWS, ids=[f"{p}-{k}" for p, k, *_ in PROXY_ROWS])
async def test_fault_in_one_phase(clean, sim, phase, kind, verdict, reason, evidence) -> None:
    if kind == "restart":
        await probe(sim)  # counters past one probe's worth, so the restart shows as counters going back
    clean.set(phase, kind)
    start = time.monotonic()
    rec = await probe(clean.url)
    assert clean.triggered >= 1, f"the {phase} fault never fired: {clean.phases}"
    assert (rec.verdict, rec.reason) == (verdict, reason), rec.evidence
    if evidence is not None:
        assert rec.evidence == evidence
    if kind == "truncated":
        assert rec.evidence.startswith("cold: POST /generate: server closed the connection mid-answer: peer closed connection without sending complete message body")
    if kind == "stall":  # abandoned at the timeout, not after the server's 10 s stall
        assert time.monotonic() - start < 5
    assert_bounded(rec)
    if kind == "slow":
        step = rec.step(rec.steps[0].phase.__class__(phase))
        assert step is not None and step.latency_s >= clean.slow_s  # the slowness was measured, not hidden
    clean.clear()
    await assert_recovers(clean.url)


# The simulator's own switches (/_sim/faults): SGLang-shaped error bodies, on every /generate.
SIM_ROWS = [
    ({"rate_5xx": 1.0}, Verdict.ERROR, ErrorReason.HTTP_5XX, "cold: POST /generate: HTTP 500: Internal server error (simulated: --fault-5xx-rate)."),
    ({"rate_429": 1.0}, Verdict.ERROR, ErrorReason.RATE_LIMITED, "cold: POST /generate: HTTP 429: The server is busy, please retry later (simulated: --fault-429-rate)."),
    ({"malformed_json": True}, Verdict.ERROR, ErrorReason.BAD_RESPONSE, None),
    ({"slow_s": 1.0}, Verdict.ERROR, ErrorReason.TIMEOUT, f"cold: POST /generate: {TO}"),
    ({"slow_s": 0.05}, Verdict.REUSED, None, None),
    ({"metrics_missing": True}, Verdict.REUSED, None, None),
]


@pytest.mark.parametrize("switch,verdict,reason,evidence", SIM_ROWS, ids=["5xx", "429", "malformed-json", "slow-past-timeout",
                                                                         "slow-within-timeout", "metrics-missing-families"])
async def test_simulator_fault_switch(clean, sim, switch, verdict, reason, evidence) -> None:
    httpx.post(sim + "/_sim/faults", json=switch).raise_for_status()
    rec = await probe(sim)
    assert (rec.verdict, rec.reason) == (verdict, reason), rec.evidence
    if evidence is not None:
        assert rec.evidence == evidence
    if switch.get("malformed_json"):
        assert rec.evidence.startswith("cold: POST /generate: body is not JSON: '{")
    assert_bounded(rec)
    httpx.post(sim + "/_sim/faults", json=NO_SIM_FAULTS).raise_for_status()
    await assert_recovers(sim)


async def test_connection_refused_then_the_server_comes_up() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rec = await probe(url)
    assert (rec.verdict, rec.reason) == (Verdict.ERROR, ErrorReason.CONNECT_FAILED)
    assert rec.evidence.startswith(f"preflight: GET /server_info: cannot connect to {url}: ")
    assert_bounded(rec)
    proc, _ = start_simulator(*SIM, port=port, time_scale=0.002)
    try:
        await assert_recovers(url)
    finally:
        proc.stop()


async def test_server_process_dies_mid_probe_then_is_restarted() -> None:
    port = free_port()
    proc, url = start_simulator(*SIM, "--fault-down-after", "2", "--warmup-seconds", "0", port=port, time_scale=0.05)  # after the warm-up and cold; slow enough that the rest outlasts the 50 ms exit
    try:
        rec = await probe(url)
        # The process exits ~50 ms after its second reply; whichever later phase meets the closed port
        # says so (connect_failed), or the one whose open connection it drops (connection_lost).
        assert rec.verdict == Verdict.ERROR and rec.reason in (ErrorReason.CONNECT_FAILED, ErrorReason.CONNECTION_LOST), rec.evidence
        assert rec.evidence.split(":")[0] in ("pressure", "rehost", "again"), rec.evidence
        assert_bounded(rec)
        assert proc.popen.wait(10) is not None  # it really died
    finally:
        proc.stop()
    proc, url = start_simulator(*SIM, port=port, time_scale=0.002)
    try:
        await assert_recovers(url)
    finally:
        proc.stop()


# A restart on a freshly started server: its counters after the restart are still above the probe's
# first snapshot (taken near zero), so the canary compares every snapshot with the previous one; R
# re-sent to an empty cache would otherwise read as "never reused" and the exporter would lie.
FRESH_RESTART = [
    ("rehost", "restart"),
    ("again", "restart"),
    # Issue 14: the server answers R, then loses cache and counters before the next /metrics. Its
    # counters are back near where the fresh server's first snapshot was, so nothing "went back";
    # only the prompt-token counter not rising by R's length shows that R was never counted.
    # Before the fix: `silent (mamba_state_not_backed_up)`, 3 runs of 3.
    ("cold", "restart_after"),
    ("pressure", "restart_after"),
    ("rehost", "restart_after"),
]


@pytest.mark.parametrize("phase,kind", FRESH_RESTART, ids=[f"{p}-{k}" for p, k in FRESH_RESTART])
async def test_restart_mid_probe_of_a_fresh_server_is_not_a_verdict(phase, kind) -> None:
    proc, url = start_simulator(*SIM, time_scale=0.002)
    try:
        with FaultProxy(url) as p:
            p.set(phase, kind)
            rec = await probe(p.url)
            assert p.triggered == 1
            assert (rec.verdict, rec.reason) == (Verdict.ERROR, ErrorReason.SERVER_RESTARTED), rec.evidence
            assert rec.evidence.startswith(f"{phase}: the server restarted during the probe ("), rec.evidence
            # Which sign shows it depends on where the fresh server's counters stood (a simulator that
            # warms up first shows "went back"; one at zero shows only the missing count, as in
            # tests/test_continuity.py): either way never a verdict.
            assert_bounded(rec)
    finally:
        proc.stop()


# ---------------------------------------------------------------- through the real exporter


TOKEN = "fault-matrix-probe-token"


@pytest.fixture(scope="module")
def exporter(proxy, tmp_path_factory):
    cfg: Path = tmp_path_factory.mktemp("faults") / "exporter.yml"
    cfg.write_text(
        "probe_api_token_env: FAULTS_PROBE_TOKEN\n"
        "targets:\n"
        f"  - {{name: sim, url: '{proxy.url}', interval: 1h, context_tokens: {CONTEXT}, request_timeout: 1.5s, pressure_chunk_tokens: {CHUNK},\n"
        "     poll_interval: 50ms, passive_wait: 0, token_budget_per_hour: 100000000}\n"
    )
    port = free_port()
    proc = Proc("exporter-faults", canary_argv("serve", "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)),
                env={"FAULTS_PROBE_TOKEN": TOKEN})
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/healthz", ok=lambda r: r.status_code == 200)
    wait_probe(url, after=0.0, timeout=30)  # the first, scheduled probe
    yield url
    proc.stop()


def last(url: str) -> dict | None:
    return httpx.get(url + "/api/targets/sim", timeout=5).json()["last"]


def wait_probe(url: str, after: float, timeout: float = 30, scrapes: list[float] | None = None) -> dict:
    """Poll until a probe that finished after `after` is published; time every /metrics on the way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = time.perf_counter()
        r = httpx.get(url + "/metrics", timeout=5)
        if scrapes is not None:
            scrapes.append(time.perf_counter() - t)
        assert r.status_code == 200
        rec = last(url)
        if rec and rec["finished_at"] and rec["finished_at"] > after:
            return rec
        time.sleep(0.05)
    raise TimeoutError(f"no probe finished within {timeout}s")


def sample(url: str, name: str, **labels: str) -> float | None:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            series, value = line.rsplit(" ", 1)
            got = "{" + ",".join(sorted(series[len(name) + 1:-1].split(","))) + "}"
            if got == want:
                return float(value)
    return None


def trigger(url: str) -> float:
    before = time.time()
    r = httpx.post(url + "/api/probe/sim", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 202, r.text
    return before


# target_up: 0 only when no working server answered (no connection, a dropped one, no answer in
# time); an HTTP 500 or a garbled body is an answer from a server that is up (issue 14).
EXPORTER_ROWS = [
    ("cold", "stall", "timeout", 0),
    ("rehost", "http_500", "http_5xx", 1),
    ("pressure", "hangup", "connection_lost", 0),
    ("again", "garbage_json", "bad_response", 1),
]


@pytest.mark.parametrize("phase,kind,reason,up", EXPORTER_ROWS, ids=[f"{p}-{k}" for p, k, *_ in EXPORTER_ROWS])
def test_exporter_reports_the_fault_keeps_serving_and_recovers(exporter, clean, phase, kind, reason, up) -> None:
    clean.set(phase, kind)
    scrapes: list[float] = []
    rec = wait_probe(exporter, trigger(exporter), scrapes=scrapes)
    assert (rec["verdict"], rec["reason"]) == ("error", reason), rec["evidence"]
    assert rec["evidence"].startswith(f"{phase}: ") and "\n" not in rec["evidence"]
    assert sample(exporter, "hicache_canary_verdict", target="sim", verdict="error") == 1
    assert sample(exporter, "hicache_canary_verdict", target="sim", verdict="reused") == 0
    assert sample(exporter, "hicache_canary_last_error_reason", target="sim", reason=reason) == 1
    assert sample(exporter, "hicache_canary_probe_errors_total", target="sim", reason=reason) >= 1
    assert sample(exporter, "hicache_canary_target_up", target="sim") == up
    # /metrics answered every poll while the target misbehaved, and fast (a probe never blocks a scrape)
    assert len(scrapes) >= 2 and max(scrapes) < 0.5, scrapes

    clean.clear()
    rec = wait_probe(exporter, trigger(exporter))
    assert (rec["verdict"], rec["reason"]) == ("reused", None), rec["evidence"]
    assert sample(exporter, "hicache_canary_verdict", target="sim", verdict="reused") == 1
    assert sample(exporter, "hicache_canary_verdict", target="sim", verdict="error") == 0
    assert sample(exporter, "hicache_canary_target_up", target="sim") == 1


# ---------------------------------------------------------------- soak smoke


def test_soak_smoke_run_is_flat_and_every_fault_gets_its_verdict() -> None:
    """bench/soak.py with 30 probes (the full run is 1,000, see docs/benchmarks.md "Soak")."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--probes", "30"], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "FAIL" not in r.stdout
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["start"], ["25%"], ["100%"])}
    assert set(rows) == {"start", "25%", "100%"}
    assert rows["100%"][1] == "30" and rows["100%"][5] == rows["start"][5]  # series: label cardinality did not move
    verdicts = next(line for line in r.stdout.splitlines() if line.startswith("verdicts: "))
    for v in ("reused", "error (http_5xx)", "error (bad_response)", "error (timeout)", "error (rate_limited)"):
        assert v in verdicts, verdicts
