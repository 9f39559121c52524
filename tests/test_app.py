"""The HTTP face through FastAPI's test client: a real Scheduler with a fake probe function.
Asserts what a user sees: status codes in sequence, no secrets anywhere, escaped HTML."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from hicache_canary.service.app import create_app
from hicache_canary.service.collector import CanaryCollector
from hicache_canary.settings.config import load_settings
from hicache_canary.models import CachedTokens, ErrorReason, Phase, PressureRecord, ProbeRecord, StepRecord, Verdict
from hicache_canary.service.next_step import explain
from hicache_canary.service.scheduler import Scheduler

TOKEN = "probe-token-abcdef123456"
KEY = "sk-sglang-key-987654"


class Gate:
    """A probe function that waits (thread-safely) until the test opens the gate."""

    def __init__(self):
        self.open = threading.Event()
        self.calls = 0
        self.evidence = "rehost loaded 96 of 100 tokens from host <script>alert(1)</script>"

    async def __call__(self, client, settings, *, progress=None):
        self.calls += 1
        if progress:
            progress(Phase.PRESSURE)
        while not self.open.is_set():
            await asyncio.sleep(0.005)
        r = ProbeRecord(target=settings.target, started_at=time.time() - 2, finished_at=time.time(), context_tokens=100,
                        verdict=Verdict.REUSED, evidence=self.evidence + f" key={KEY}")
        r.steps = [StepRecord(Phase.COLD, latency_s=1.5, prompt_tokens=100),
                   StepRecord(Phase.REHOST, latency_s=0.1, prompt_tokens=100, cached=CachedTokens(0, 96, 0)),
                   StepRecord(Phase.AGAIN, latency_s=0.05, prompt_tokens=100, cached=CachedTokens(96, 0, 0))]
        r.rehost_cold_ratio = 0.1 / 1.5
        return r


def build(token: str | None = TOKEN, gate: Gate | None = None, interval: str = "1h", client_factory=lambda t: None):
    env = {"HICACHE_CANARY_TARGET_URL": "http://127.0.0.1:9", "HICACHE_CANARY_INTERVAL": interval, "SGLANG_API_KEY": KEY}
    if token:
        env["HICACHE_CANARY_API_TOKEN"] = token
    settings = load_settings(None, env)
    from dataclasses import replace

    from pydantic import SecretStr

    settings = replace(settings, targets=(replace(settings.targets[0], api_key=SecretStr(KEY)),), default_api_key=SecretStr(KEY))
    gate = gate or Gate()
    sched = Scheduler(settings.targets, gate, client_factory, secrets=settings.secrets(),
                      initial_delay=lambda i, n, iv: 3600.0)
    reg = CollectorRegistry()
    collector = CanaryCollector(sched.snapshot)
    reg.register(collector)
    return create_app(settings, sched, reg, collector=collector), sched, gate


def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("timed out")


def auth(tok: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


def test_probe_endpoint_status_sequence():
    app, sched, gate = build()
    with TestClient(app) as c:
        assert c.post("/api/probe/sglang").status_code == 401
        assert c.post("/api/probe/sglang", headers=auth("wrong")).status_code == 401
        assert c.post("/api/probe/sglang", headers={"Authorization": TOKEN}).status_code == 401  # no scheme
        r = c.post("/api/probe/sglang", headers=auth())
        assert r.status_code == 202 and r.json() == {"target": "sglang", "status": "started"}
        until(lambda: gate.calls == 1)
        assert c.post("/api/probe/sglang", headers=auth()).status_code == 409
        assert c.post("/api/probe/nope", headers=auth()).status_code == 404
        assert c.post("/api/probe/http%3A%2F%2F169.254.169.254%2F", headers=auth()).status_code == 404
        assert c.post("/api/probe/sglang?url=http://evil", headers=auth()).status_code == 409  # the query is ignored
        gate.open.set()
        until(lambda: sched.snapshot()["sglang"].last is not None)
        until(lambda: c.post("/api/probe/sglang", headers=auth()).status_code == 202)
        assert gate.calls in (1, 2)
        until(lambda: gate.calls == 2)


def test_unauthenticated_caller_cannot_learn_target_names():
    app, _, _ = build()
    with TestClient(app) as c:
        assert c.post("/api/probe/nope").status_code == 401
        assert c.post("/api/probe/sglang").status_code == 401


def test_probe_endpoint_disabled_without_a_token():
    app, _, gate = build(token=None)
    with TestClient(app) as c:
        r = c.post("/api/probe/sglang", headers=auth())
        assert r.status_code == 403 and "disabled" in r.json()["detail"]
        assert gate.calls == 0


def test_request_body_is_limited():
    app, _, gate = build()
    with TestClient(app) as c:
        assert c.post("/api/probe/sglang", headers=auth(), content=b"x" * 100_000).status_code == 413

        def chunks():
            for _ in range(100):
                yield b"y" * 1000

        assert c.post("/api/probe/sglang", headers=auth(), content=chunks()).status_code == 413
        assert gate.calls == 0


def test_metrics_healthz_and_a_cached_scrape_that_follows_the_probe():
    app, sched, gate = build()
    with TestClient(app) as c:
        assert c.get("/healthz").json()["status"] == "ok"
        m1 = c.get("/metrics")
        assert m1.status_code == 200 and 'hicache_canary_probes_total{target="sglang",verdict="reused"} 0.0' in m1.text
        assert c.get("/metrics").text == m1.text
        gate.open.set()
        c.post("/api/probe/sglang", headers=auth())
        until(lambda: sched.snapshot()["sglang"].last is not None)
        m2 = c.get("/metrics").text
        assert 'hicache_canary_probes_total{target="sglang",verdict="reused"} 1.0' in m2
        assert 'hicache_canary_verdict{target="sglang",verdict="reused"} 1.0' in m2
        gz = c.get("/metrics", headers={"Accept-Encoding": "gzip"})
        assert gz.headers.get("content-encoding") == "gzip" and "verdict=\"reused\"} 1.0" in gz.text


def test_healthz_fails_when_the_scheduler_is_not_running():
    def broken(target):  # outside the probe's own error handling: a bug that ends the probe loop
        raise RuntimeError("client factory bug")

    app, _, _ = build(client_factory=broken)
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        assert c.post("/api/probe/sglang", headers=auth()).status_code == 202
        until(lambda: c.get("/healthz").status_code == 503)
        assert "probe loop for sglang is not running" in c.get("/healthz").json()["problems"]


def test_api_targets_and_status_page_show_results_without_secrets():
    app, sched, gate = build()
    gate.open.set()
    with TestClient(app) as c:
        c.post("/api/probe/sglang", headers=auth())
        until(lambda: sched.snapshot()["sglang"].last is not None)
        api = c.get("/api/targets")
        body = api.json()["targets"][0]
        assert body["config"]["name"] == "sglang" and body["config"]["api_key"] == "set"
        assert body["last"]["verdict"] == "reused" and [s["phase"] for s in body["last"]["steps"]] == ["cold", "rehost", "again"]
        assert body["history"][-1]["verdict"] == "reused"
        assert c.get("/api/targets/sglang").json()["last"]["verdict"] == "reused"
        assert c.get("/api/targets/nope").status_code == 404
        page = c.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "default-src 'none'" in page.headers["content-security-policy"]
        html = page.text
        assert "sglang" in html and "reused" in html and "<svg" in html and "<polyline" in html
        assert "<script>" not in html and "&lt;script&gt;" in html
        for text in (api.text, html, c.get("/metrics").text, c.get("/healthz").text):
            assert KEY not in text and TOKEN not in text


def _before_any_probe_page(r):
    html = r.text
    assert '<section class="target" id="t-sglang">' in html and '<span class="badge v-none">none</span>' in html
    for shown in ("no probe has finished yet", "not contacted yet", "none yet", "no measured probes yet", "3600 s"):
        assert shown in html, shown


def _before_any_probe_api(r):
    [t] = r.json()["targets"]
    assert t["config"]["name"] == "sglang" and t["last"] is None and t["history"] == []
    assert t["state"]["verdict"] is None and t["state"]["in_progress"] is False


def _before_any_probe_metrics(r):
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(r.text) for s in f.samples}
    verdicts = {k: v for k, v in samples.items() if k[0] == "hicache_canary_verdict"}
    assert len(verdicts) == len(Verdict) and set(verdicts.values()) == {0.0}  # listed, none set
    assert samples[("hicache_canary_probes_total", (("target", "sglang"), ("verdict", "reused")))] == 0
    assert samples[("hicache_canary_config_last_reload_successful", ())] == 1
    assert not any(name == "hicache_canary_rehost_cold_ratio" for name, _ in samples)  # no ratio guessed


def _before_any_probe_health(r):
    assert r.json() == {"status": "ok", "config": "loaded", "targets": 1, "problems": []}


@pytest.mark.parametrize("path,shows", [
    ("/", _before_any_probe_page),
    ("/api/targets", _before_any_probe_api),
    ("/metrics", _before_any_probe_metrics),
    ("/healthz", _before_any_probe_health),
])
def test_pages_answer_before_any_probe(path, shows):
    """What a user sees of a target whose first probe has not run yet (its first one is an hour away)."""
    app, _, gate = build()
    with TestClient(app) as c:
        r = c.get(path)
        assert r.status_code == 200
        shows(r)
    assert gate.calls == 0


class Sequence:
    """A probe function that ends each probe with the next verdict of a list (the last one repeats).

    not_evicted is shaped like the live SGLang 0.5.17 write_through probes (consecutive-probes/
    README.md): the counters suggested R was evicted while filler was sent, the rehost still hit
    14,336 of 16,320 tokens on device.
    """

    def __init__(self, verdicts: list[Verdict]):
        self.verdicts = verdicts
        self.calls = 0

    async def __call__(self, client, settings, *, progress=None):
        verdict = self.verdicts[min(self.calls, len(self.verdicts) - 1)]
        self.calls += 1
        r = ProbeRecord(target=settings.target, started_at=time.time() - 1, finished_at=time.time(),
                        context_tokens=16384, verdict=verdict)
        r.pressure = PressureRecord(planned_tokens=23616, synthetic_tokens=23637, chunks=3, eviction_confirmed=True)
        device, host = (14336, 0) if verdict == Verdict.NOT_EVICTED else (0, 14336)
        r.evidence = f"rehost hit {device} on device and {host} from host"
        r.steps = [StepRecord(Phase.COLD, latency_s=0.2, prompt_tokens=16384),
                   StepRecord(Phase.REHOST, latency_s=0.04, prompt_tokens=16384, cached=CachedTokens(device, host, 0))]
        return r


def _probe_n(c, sched, n: int) -> None:
    done = sum(sched.snapshot()["sglang"].probes_total.values())
    for i in range(1, n + 1):
        until(lambda: c.post("/api/probe/sglang", headers=auth()).status_code == 202)
        until(lambda: sum(sched.snapshot()["sglang"].probes_total.values()) == done + i and not sched.snapshot()["sglang"].in_progress)


def test_not_evicted_probes_are_explained_counted_and_never_reported_as_evicted():
    probe = Sequence([Verdict.NOT_EVICTED])
    app, sched, _ = build(gate=probe)
    with TestClient(app) as c:
        _probe_n(c, sched, 3)
        last = c.get("/api/targets/sglang").json()["last"]
        # the counters' guess stays visible, but the verdict decides what "confirmed" says
        assert last["verdict"] == "not_evicted"
        assert last["pressure"]["eviction_confirmed"] is False and last["pressure"]["counters_suggested_eviction"] is True
        html = c.get("/").text
        assert "R was still on the device after the pressure" in html and "raise max_pressure_tokens" in html
        assert "none yet (3 inconclusive probes so far)" in html  # what HiCacheCanaryInconclusive counts


def test_status_page_counts_inconclusive_probes_since_the_last_conclusive_one_and_explains_errors():
    probe = Sequence([Verdict.REUSED, Verdict.NOT_EVICTED, Verdict.SKIPPED_BUSY])
    app, sched, _ = build(gate=probe)
    with TestClient(app) as c:
        _probe_n(c, sched, 1)
        html = c.get("/").text
        assert "reused x1<" in html and 'class="next"' not in html  # a conclusive verdict needs no next step
        assert c.get("/api/targets/sglang").json()["last"]["pressure"]["eviction_confirmed"] is True
        _probe_n(c, sched, 2)
        html = c.get("/").text
        # a skip is not a probe (HiCacheCanaryInconclusive does not count it either)
        assert "reused x1 (1 inconclusive probe since)" in html
        assert "Real users were queueing" in html


def test_every_verdict_without_a_verdict_about_hicache_has_a_next_step():
    for verdict in Verdict:
        rec = ProbeRecord(target="t", started_at=0.0, verdict=verdict)
        line = explain(rec)
        assert (line is None) == verdict.conclusive, verdict
        if line is not None and verdict != Verdict.ERROR:
            assert "Next:" in line
    for reason in ErrorReason:
        line = explain(ProbeRecord(target="t", started_at=0.0, verdict=Verdict.ERROR, reason=reason))
        assert f"({reason.value})" in line and "Next:" in line and "read the exporter log" not in line
