"""`hicache-canary serve` end to end: simulators and the exporter as real processes on 127.0.0.1.

What a user would notice: the right verdict per server on /metrics, each target on its own
schedule, /metrics answering fast while probes run and a target is down, busy / budget / auth
behaviour, no orphan requests on the server after a SIGTERM mid-probe, passive pressure from the
server's own traffic, and a status page a browser renders.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from procs import ARTIFACTS, Proc, canary_argv, free_port, require_binary, start_simulator, wait_for

pytestmark = pytest.mark.e2e

HYBRID = ("--enable-hierarchical-cache", "--hybrid-model", "--enable-metrics", "--max-total-tokens", "40000",
          "--hicache-host-tokens", "400000")
FAST = {"context_tokens": 8192, "poll_interval": "0.2s", "passive_wait": "0.5s", "request_timeout": "60s"}
TOKEN = "e2e-probe-token-5f2c9a"
# One client: HTTP.get() builds a fresh SSL context per call (100+ ms on a busy CI box), which
# would be measured as exporter latency.
HTTP = httpx.Client(timeout=5)


def start_exporter(tmp: Path, cfg: dict, env: dict[str, str] | None = None, name: str = "exporter") -> tuple[Proc, str]:
    port = free_port()
    cfg = {"listen": {"host": "127.0.0.1", "port": port}, **cfg}
    path = tmp / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc(name, canary_argv("serve", "--config", str(path)), env=env)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/healthz", ok=lambda r: r.status_code == 200)
    return proc, url


def scrape(url: str, timings: list[float] | None = None) -> dict[tuple[str, frozenset], float]:
    t0 = time.perf_counter()
    text = HTTP.get(url + "/metrics").text
    if timings is not None:
        timings.append(time.perf_counter() - t0)
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(m: dict, name: str, **labels) -> float | None:
    return m.get((name, frozenset(labels.items())))




def sim_state(url: str) -> dict:
    return HTTP.get(url + "/_sim/state").json()


@pytest.fixture(scope="module")
def fleet():
    """write_back (reused) and write_through (silent) hybrid simulators, plus a target that is down."""
    tmp = Path(tempfile.mkdtemp(prefix="hicache-e2e-"))
    wb, wb_url = start_simulator(*HYBRID, "--hicache-write-policy", "write_back", name="sim-wb")
    wt, wt_url = start_simulator(*HYBRID, "--hicache-write-policy", "write_through", name="sim-wt")
    procs = [wb, wt]
    try:
        exp, url = start_exporter(tmp, {
            "defaults": FAST,
            "targets": [
                {"name": "wb", "url": wb_url, "interval": "1s"},
                {"name": "wt", "url": wt_url, "interval": "4s"},
                {"name": "down", "url": f"http://127.0.0.1:{free_port()}", "interval": "1s"},
            ],
        }, env={"HICACHE_CANARY_API_TOKEN": TOKEN})
        procs.append(exp)
        yield {"url": url, "exporter": exp, "wb": wb_url, "wt": wt_url}
    finally:
        for p in reversed(procs):
            p.stop()


def test_two_targets_get_their_verdicts_on_their_own_schedules_and_metrics_stay_fast(fleet):
    url = fleet["url"]
    latencies = []

    def progressed():
        m = scrape(url, latencies)
        reused = val(m, "hicache_canary_probes_total", target="wb", verdict="reused") or 0
        silent = val(m, "hicache_canary_probes_total", target="wt", verdict="silent") or 0
        return m if reused >= 4 and silent >= 1 else None

    m = wait_for(progressed, 90, "4 reused probes of wb and 1 silent of wt")
    assert val(m, "hicache_canary_verdict", target="wb", verdict="reused") == 1
    assert val(m, "hicache_canary_verdict", target="wt", verdict="silent") == 1
    assert val(m, "hicache_canary_suspected_cause", target="wt", cause="none") == 0
    total = lambda t: sum(v for (n, ls), v in m.items() if n == "hicache_canary_probes_total" and ("target", t) in ls)  # noqa: E731
    assert total("wt") < total("wb")  # wt's interval is 4x longer
    assert val(m, "hicache_canary_rehost_cached_ratio", target="wb", tier="host") > 0.9
    assert val(m, "hicache_canary_rehost_cached_ratio", target="wt", tier="host") == 0
    assert val(m, "hicache_canary_host_pool_growth_tokens", target="wt") > 0
    assert val(m, "hicache_canary_server_info", target="wt", version="0.5.23", write_policy="write_through",
               hicache="true", hybrid="true", speculative_algorithm="none") == 1
    # the dead target: errors, marked down, and it never slowed a scrape
    assert val(m, "hicache_canary_target_up", target="down") == 0
    assert val(m, "hicache_canary_probe_errors_total", target="down", reason="connect_failed") >= 1
    assert len(latencies) >= 10
    # Loose bounds: CI shares 2 cores with two simulators; bench/exporter_overhead.py measures p99.
    assert max(latencies) < 2.0 and statistics.median(latencies) < 0.25, latencies


def test_probe_api_auth_and_in_flight(fleet):
    url = fleet["url"]
    assert HTTP.post(f"{url}/api/probe/wt").status_code == 401
    assert HTTP.post(f"{url}/api/probe/wt", headers={"Authorization": "Bearer nope"}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert HTTP.post(f"{url}/api/probe/nope", headers=auth).status_code == 404
    codes = [HTTP.post(f"{url}/api/probe/wt", headers=auth).status_code for _ in range(2)]
    assert codes[0] in (202, 409) and codes[1] == 409  # at most one probe per target, ever
    body = HTTP.get(f"{url}/api/targets").json()
    assert {t["config"]["name"] for t in body["targets"]} == {"wb", "wt", "down"}
    assert TOKEN not in HTTP.get(f"{url}/api/targets").text + fleet["exporter"].log()


def test_status_page_renders_in_headless_chromium(fleet):
    chromium = require_binary("chromium")
    url = fleet["url"]
    wait_for(lambda: HTTP.get(url + "/").text.count("<polyline") >= 4, 60, "charts for wb and wt")
    shot = ARTIFACTS / "status-page.png"
    ARTIFACTS.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1280,900", url + "/"],
            capture_output=True, timeout=90,
        )
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000, f"screenshot only {len(data)} bytes: blank page?"


def test_busy_server_is_skipped_and_nothing_is_sent(tmp_path):
    sim, sim_url = start_simulator(*HYBRID, "--hicache-write-policy", "write_back", name="sim-busy", time_scale=1.0)
    exp = None
    try:
        # the server's own long request keeps it busy for ~11 s
        ids = [1000 + (i * 7919) % 29000 for i in range(30000)]
        threading.Thread(target=lambda: httpx.post(sim_url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, timeout=60),
                         daemon=True).start()
        wait_for(lambda: sim_state(sim_url)["running"] >= 1, 10, "the background request to run")
        exp, url = start_exporter(tmp_path, {"defaults": {**FAST, "busy_running_threshold": 0, "interval": "1h"},
                                             "targets": [{"name": "busy", "url": sim_url}]},
                                  env={"HICACHE_CANARY_API_TOKEN": TOKEN})
        wait_for(lambda: val(scrape(url), "hicache_canary_probes_total", target="busy", verdict="skipped_busy") == 1, 20, "a busy skip")
        assert HTTP.post(f"{url}/api/probe/busy", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 202
        m = wait_for(lambda: (lambda m: m if val(m, "hicache_canary_probes_total", target="busy", verdict="skipped_busy") == 2 else None)(scrape(url)),
                     20, "a second busy skip")
        assert val(m, "hicache_canary_verdict", target="busy", verdict="skipped_busy") == 1
        assert val(m, "hicache_canary_target_up", target="busy") == 1
        assert val(m, "hicache_canary_tokens_sent_total", target="busy", kind="canary") == 0
        assert sim_state(sim_url)["requests_by_kind"].get("generate") == 1  # only the server's own request
    finally:
        if exp:
            exp.stop()
        sim.stop()


def test_spent_budget_skips_without_sending(tmp_path):
    sim, sim_url = start_simulator(*HYBRID, "--hicache-write-policy", "write_back", name="sim-budget")
    exp = None
    try:
        exp, url = start_exporter(tmp_path, {"defaults": {**FAST, "token_budget_per_hour": 20000, "interval": "1h"},
                                             "targets": [{"name": "poor", "url": sim_url}]})
        m = wait_for(lambda: (lambda m: m if val(m, "hicache_canary_probes_total", target="poor", verdict="skipped_budget") else None)(scrape(url)),
                     20, "a budget skip")
        assert val(m, "hicache_canary_budget_remaining_tokens", target="poor") == 20000
        assert val(m, "hicache_canary_tokens_sent_total", target="poor", kind="canary") == 0
        assert val(m, "hicache_canary_tokens_sent_total", target="poor", kind="pressure") == 0
        assert "generate" not in sim_state(sim_url)["requests_by_kind"]
        last = HTTP.get(url + "/api/targets/poor").json()["last"]
        assert last["verdict"] == "skipped_budget" and "20000 left of 20000" in last["evidence"]
    finally:
        if exp:
            exp.stop()
        sim.stop()


def test_sigterm_mid_probe_leaves_no_request_on_the_server(tmp_path):
    # time scale 1: R's cold prefill takes ~3 s, so a request is surely in flight when we stop
    sim, sim_url = start_simulator(*HYBRID, "--hicache-write-policy", "write_back", name="sim-term", time_scale=1.0)
    exp = None
    try:
        exp, url = start_exporter(tmp_path, {"defaults": {**FAST, "interval": "1h"}, "targets": [{"name": "t", "url": sim_url}]})
        wait_for(lambda: sim_state(sim_url)["in_flight"] >= 1, 20, "the probe's request on the server")
        assert val(scrape(url), "hicache_canary_probe_in_progress", target="t") == 1
        t0 = time.monotonic()
        rc = exp.stop()
        took = time.monotonic() - t0
        log = exp.log_path.read_text()
        # uvicorn re-raises the SIGTERM it caught once shutdown is done, so -15 is a clean exit
        assert rc in (0, -15) and took < 8 and "Application shutdown complete" in log, (rc, took, log[-2000:])
        state = wait_for(lambda: (lambda s: s if s["in_flight"] == 0 else None)(sim_state(sim_url)), 3, "no request in flight")
        assert state["aborted"] >= 1  # the server aborted it: it did not just finish
        assert "Traceback" not in log
    finally:
        if exp:
            exp.stop()
        sim.stop()


def test_background_traffic_gives_a_verdict_without_synthetic_pressure(tmp_path):
    sim, sim_url = start_simulator(*HYBRID, "--hicache-write-policy", "write_back", "--background-rps", "1",
                                   name="sim-bg", time_scale=0.01)
    exp = None
    try:
        exp, url = start_exporter(tmp_path, {"defaults": {**FAST, "passive_wait": "10s", "interval": "1h"},
                                             "targets": [{"name": "bg", "url": sim_url}]})
        m = wait_for(lambda: (lambda m: m if val(m, "hicache_canary_verdict", target="bg", verdict="reused") == 1 else None)(scrape(url)),
                     60, "a reused verdict")
        assert val(m, "hicache_canary_tokens_sent_total", target="bg", kind="pressure") == 0
        assert val(m, "hicache_canary_passive_pressure_tokens_total", target="bg") > 0
        assert val(m, "hicache_canary_tokens_sent_total", target="bg", kind="canary") == 3 * (8192 - 63)  # R is 64k+1 tokens on a hybrid model
    finally:
        if exp:
            exp.stop()
        sim.stop()


def test_a_restarted_server_is_probed_after_restart_probe_delay_not_its_interval(tmp_path):
    """A deploy restarts the server into the silent configuration: the watch notices within a
    watch interval and the probe comes `restart_probe_delay` later, not an hour later; a server
    that goes away shows as down within a watch interval, without a probe."""
    sim, sim_url = start_simulator(*HYBRID, "--hicache-write-policy", "write_back", name="sim-restart")
    exp = None
    try:
        exp, url = start_exporter(tmp_path, {"defaults": FAST, "targets": [{
            "name": "r", "url": sim_url, "interval": "1h", "confirm_after": "0s",
            "watch_interval": "0.2s", "restart_probe_delay": "1s",
        }]})
        total = lambda m: sum(val(m, "hicache_canary_probes_total", target="r", verdict=v) or 0 for v in ("reused", "silent", "error"))
        wait_for(lambda: val(scrape(url), "hicache_canary_probes_total", target="r", verdict="reused") == 1, 60, "the first probe: reused")
        m = scrape(url)
        assert val(m, "hicache_canary_restarts_detected_total", target="r") == 0 and total(m) == 1
        r = HTTP.post(sim_url + "/_sim/restart", json={"args": ["--hicache-write-policy", "write_through"]})
        assert r.status_code == 200
        restarted = time.monotonic()
        wait_for(lambda: val(scrape(url), "hicache_canary_restarts_detected_total", target="r") == 1, 5, "the watch noticing the restart")
        noticed = time.monotonic() - restarted
        wait_for(lambda: val(scrape(url), "hicache_canary_probes_total", target="r", verdict="silent") == 1, 60, "the restart's probe")
        probed = time.monotonic() - restarted
        m = scrape(url)
        assert total(m) == 2  # exactly one probe for the restart, and it saw the new configuration
        duration = val(m, "hicache_canary_last_probe_duration_seconds", target="r")
        assert noticed < 2.0, f"noticed {noticed:.1f} s after the restart (watch every 0.2 s)"
        # restart_probe_delay (1 s) + the probe itself + scrape polling; the interval is an hour
        assert 1.0 < probed < 1.0 + noticed + duration + 3.0, f"probed {probed:.1f} s after the restart (probe took {duration:.1f} s)"
        sim.stop()
        gone = time.monotonic()
        wait_for(lambda: val(scrape(url), "hicache_canary_target_up", target="r") == 0, 5, "down seen by the watch")
        assert time.monotonic() - gone < 2.0
        m = scrape(url)
        assert total(m) == 2 and val(m, "hicache_canary_watch_errors_total", target="r") >= 1  # no probe needed to see it
    finally:
        if exp is not None:
            exp.stop()
        sim.stop()


def test_sighup_reloads_the_config_and_a_broken_one_leaves_it_running(tmp_path):
    """As blackbox_exporter: SIGHUP re-reads the file; a valid config replaces the targets (kept
    ones keep their state), a broken one is refused, logged, and shown by the reload gauge."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(4)]  # nothing listens: probes end in connect_failed
    quiet = {"interval": "1h", "watch_interval": "0s"}
    cfg = {"defaults": quiet, "targets": [{"name": "keep", "url": dead[0]}, {"name": "gone", "url": dead[1]},
                                          {"name": "moved", "url": dead[2]}]}
    exp, url = start_exporter(tmp_path, cfg)
    path = tmp_path / "exporter.yml"

    def targets() -> dict[str, dict]:
        return {t["config"]["name"]: t for t in HTTP.get(url + "/api/targets").json()["targets"]}

    try:
        first = wait_for(lambda: targets()["keep"]["last"], 20, "keep's first probe")
        loaded_at = val(scrape(url), "hicache_canary_config_last_reload_success_timestamp_seconds")
        assert val(scrape(url), "hicache_canary_config_last_reload_successful") == 1 and loaded_at > 0

        new = {"listen": {"host": "127.0.0.1", "port": int(url.rsplit(":", 1)[1])}, "defaults": quiet,
               "targets": [{"name": "keep", "url": dead[0]}, {"name": "moved", "url": dead[3]}, {"name": "new", "url": dead[1]}]}
        path.write_text(yaml.safe_dump(new))
        exp.popen.send_signal(signal.SIGHUP)
        now = wait_for(lambda: (lambda t: t if set(t) == {"keep", "moved", "new"} else None)(targets()), 10, "the new targets")
        assert now["moved"]["config"]["url"] == dead[3]
        assert now["keep"]["last"]["started_at"] == first["started_at"]  # unchanged: its state kept, not re-probed
        m = scrape(url)
        assert val(m, "hicache_canary_config_last_reload_successful") == 1
        assert val(m, "hicache_canary_config_last_reload_success_timestamp_seconds") > loaded_at
        assert val(m, "hicache_canary_verdict", target="gone", verdict="error") is None  # its series went with it

        path.write_text("targets:\n  - name: keep\n    url: not-a-url\n")
        exp.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: val(scrape(url), "hicache_canary_config_last_reload_successful") == 0, 10, "the gauge at 0")
        assert set(targets()) == {"keep", "moved", "new"}  # the old config still runs
        assert val(scrape(url), "hicache_canary_config_last_reload_success_timestamp_seconds") == \
            val(m, "hicache_canary_config_last_reload_success_timestamp_seconds")
        assert "config reload failed" in exp.log() and "targets[0].url" in exp.log()
        assert HTTP.get(url + "/healthz").status_code == 200
    finally:
        exp.stop()
