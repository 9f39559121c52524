"""Security (issue 7): the probe endpoint needs the token and probes only configured targets, request
bodies are size-limited, and no API key or token ever leaves the exporter (logs, /metrics, /api/*,
the status page, error bodies).

Real processes: a simulator started with `--api-key`, the exporter (`serve --log-level debug`, the
chattiest it gets, access log included) with the key and the token in files, and a `Recorder`
listener that must never be contacted. The secrets are distinctive strings, so a grep cannot miss
them. The compose stack's hardening (loopback-only ports, non-root read-only exporter, no default
Grafana password) is asserted in tests/test_compose.py (test_published_ports_bind_to_loopback_by_default,
test_our_containers_run_non_root_read_only_without_capabilities,
test_grafana_has_no_default_credentials_and_anonymous_users_only_view); SECURITY.md says why.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from hicache_canary.settings.config import load_settings
from hicache_canary.service.serve import build
from misbehaving import FaultProxy, Recorder
from procs import REPO, Proc, canary_argv, free_port, start_simulator

SIM_KEY = "sk-SIMKEY-e7b1c0ffee42d00d"
WRONG_KEY = "sk-WRONGKEY-5d1e9a77aa"
TOKEN = "tok-PROBETOKEN-93ab7c11f0"
SECRETS = (SIM_KEY, WRONG_KEY, TOKEN)
FRAGMENTS = ("SIMKEY", "WRONGKEY", "PROBETOKEN", "e7b1c0ffee42", "5d1e9a77aa", "93ab7c11f0")
SIM = ("--enable-hierarchical-cache", "--enable-metrics", "--hicache-write-policy", "write_back",
       "--max-total-tokens", "8000", "--hicache-host-tokens", "16000", "--chunked-prefill-size", "1024")
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Stack:
    def __init__(self, url: str, proc: Proc, sim: str, recorder: Recorder, proxy: FaultProxy):
        self.url, self.proc, self.sim, self.recorder, self.proxy = url, proc, sim, recorder, proxy

    def sim_served(self) -> int:
        return httpx.get(self.sim + "/_sim/state", headers={"Authorization": f"Bearer {SIM_KEY}"}).json()["served"]

    def last(self, name: str) -> dict | None:
        return httpx.get(f"{self.url}/api/targets/{name}").json()["last"]

    def wait_probe(self, name: str, after: float, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rec = self.last(name)
            if rec and rec["finished_at"] > after:
                return rec
            time.sleep(0.05)
        raise TimeoutError(f"no probe of {name} finished within {timeout}s")

    def probe(self, name: str) -> dict:
        """Trigger a probe through the API (waiting out one in flight) and return its record."""
        deadline = time.monotonic() + 30
        while True:
            before = time.time()
            r = httpx.post(f"{self.url}/api/probe/{name}", headers=AUTH)
            if r.status_code == 202:
                return self.wait_probe(name, before)
            assert r.status_code == 409 and time.monotonic() < deadline, r.text
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d: Path = tmp_path_factory.mktemp("security")
    (d / "key").write_text(SIM_KEY + "\n")
    (d / "wrong").write_text(WRONG_KEY)
    (d / "token").write_text(TOKEN)
    sim_proc, sim = start_simulator(*SIM, "--api-key", SIM_KEY, time_scale=0.002)
    recorder = Recorder().start()
    proxy = FaultProxy(sim).start()  # target `echo`: the same server, misbehaving on cue
    common = "interval: 1h, context_tokens: 2048, pressure_chunk_tokens: 4096, poll_interval: 50ms, passive_wait: 0"
    (d / "exporter.yml").write_text(
        f"probe_api_token_file: {d / 'token'}\n"
        "targets:\n"
        f"  - {{name: sim, url: '{sim}', api_key_file: {d / 'key'}, {common}}}\n"
        f"  - {{name: badkey, url: '{sim}', api_key_file: {d / 'wrong'}, {common}}}\n"
        f"  - {{name: echo, url: '{proxy.url}', api_key_file: {d / 'key'}, {common}}}\n"
    )
    port = free_port()
    proc = Proc("exporter-security", canary_argv("serve", "--config", str(d / "exporter.yml"), "--host", "127.0.0.1",
                                                 "--port", str(port), "--log-level", "debug"))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/healthz", ok=lambda r: r.status_code == 200)
        s = Stack(url, proc, sim, recorder, proxy)
        assert s.wait_probe("sim", 0.0)["verdict"] == "reused"  # the first, scheduled probe used the key
        s.wait_probe("echo", 0.0)
        yield s
    finally:
        proc.stop()
        recorder.stop()
        proxy.stop()
        sim_proc.stop()


@pytest.mark.parametrize(
    "headers,params",
    [
        ({}, {}),
        ({"Authorization": "Bearer wrong-token"}, {}),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, {}),
        ({"Authorization": f"Basic {TOKEN}"}, {}),
        ({"Authorization": TOKEN}, {}),
        ({}, {"token": TOKEN, "access_token": TOKEN}),
        ({"X-Api-Key": TOKEN}, {}),
    ],
    ids=["none", "wrong", "prefix-of-token", "basic-scheme", "no-scheme", "query-param", "other-header"],
)
def test_probe_endpoint_refuses_without_the_bearer_token(stack, headers, params):
    served = stack.sim_served()
    r = httpx.post(f"{stack.url}/api/probe/sim", headers=headers, params=params)
    assert (r.status_code, r.json()) == (401, {"detail": "missing or wrong bearer token"})
    assert r.headers["www-authenticate"] == "Bearer"
    assert stack.sim_served() == served  # nothing was sent to the GPU


@pytest.mark.parametrize(
    "path",
    ["/api/probe/unknown", "/api/probe/{url}", "/api/probe/{host}", "/api/probe/SIM", "/api/probe/sim%2F..%2Fbadkey"],
    ids=["unknown-name", "url-in-path", "host-port-in-path", "case-variant", "traversal"],
)
def test_probe_endpoint_only_knows_configured_names(stack, path):
    rec = stack.recorder
    path = path.format(url=quote(rec.url, safe=""), host=quote(rec.url.removeprefix("http://"), safe=""))
    r = httpx.post(stack.url + path, headers=AUTH)
    assert r.status_code == 404, r.text
    assert rec.requests == []


def test_a_url_in_the_query_or_body_is_never_probed(stack):
    rec = stack.recorder
    served = stack.sim_served()
    before = time.time()
    r = httpx.post(f"{stack.url}/api/probe/sim", headers=AUTH, params={"target": rec.url, "url": rec.url},
                   json={"url": rec.url, "target": rec.url, "targets": [rec.url]})
    assert r.status_code in (202, 409), r.text
    out = stack.wait_probe("sim", before)
    assert out["verdict"] == "reused"  # the configured target was probed ...
    assert stack.sim_served() > served
    assert rec.requests == []  # ... and nothing else


def test_other_methods_on_the_probe_endpoint_are_refused(stack):
    for method in ("GET", "PUT", "DELETE"):
        assert httpx.request(method, f"{stack.url}/api/probe/sim", headers=AUTH).status_code == 405


@pytest.mark.parametrize("auth", [True, False], ids=["with-token", "without-token"])
def test_request_bodies_are_size_limited(stack, auth):
    headers = AUTH if auth else {}
    big = b"x" * 1_000_000
    r = httpx.post(f"{stack.url}/api/probe/sim", headers=headers, content=big)
    assert r.status_code == 413 and "larger than 4096 bytes" in r.json()["detail"]

    def stream():  # chunked: no Content-Length to refuse up front
        for _ in range(100):
            yield b"y" * 10_000

    r = httpx.post(f"{stack.url}/api/probe/sim", headers=headers, content=stream())
    assert r.status_code == 413
    assert httpx.get(stack.url + "/healthz").status_code == 200  # and the exporter is fine


def test_secrets_never_leave_the_exporter(stack):
    ok = stack.probe("sim")
    bad = stack.probe("badkey")
    assert ok["verdict"] == "reused"
    assert (bad["verdict"], bad["reason"]) == ("error", "unauthorized")
    assert bad["evidence"] == "preflight: GET /server_info: HTTP 401: Unauthorized (check the API key)"
    pages = {
        path: httpx.get(stack.url + path)
        for path in ("/metrics", "/api/targets", "/api/targets/sim", "/api/targets/badkey", "/", "/healthz",
                     "/api/targets/nope", "/nope", "/metrics?debug=true")
    }
    pages["401"] = httpx.post(f"{stack.url}/api/probe/sim", headers={"Authorization": "Bearer nope"})
    pages["404"] = httpx.post(f"{stack.url}/api/probe/nope", headers=AUTH)
    assert 'hicache_canary_last_error_reason{reason="unauthorized",target="badkey"} 1.0' in pages["/metrics"].text
    log = stack.proc.log()
    assert "target badkey: error (unauthorized)" in log and "probe of sim requested through the API" in log
    texts = {name: r.text + "\n" + "\n".join(f"{k}: {v}" for k, v in r.headers.items()) for name, r in pages.items()}
    # The one exception, by design: a client that puts the token in a URL (refused above, 401) has
    # that URL written by uvicorn's access log, which only --log-level debug turns on.
    texts["exporter log"] = "\n".join(line for line in log.splitlines() if '"POST /api/probe/sim?token=' not in line)
    for name, text in texts.items():
        for secret in (*SECRETS, *FRAGMENTS):
            assert secret not in text, f"{secret!r} leaked into {name}"
    # the key is said to be set, never shown
    summary = httpx.get(stack.url + "/api/targets/sim").json()["config"]
    assert summary["api_key"] == "set" and not re.search(r"sk-|tok-", str(summary))


async def test_probe_api_is_disabled_without_a_token(tmp_path, monkeypatch):
    """No token configured: the endpoint answers 403 (never open). In-process, and the transport
    runs no lifespan, so the scheduler never starts and nothing is probed."""
    monkeypatch.delenv("HICACHE_CANARY_API_TOKEN", raising=False)
    cfg = tmp_path / "c.yml"
    cfg.write_text("targets:\n  - {name: sim, url: 'http://127.0.0.1:9'}\n")
    app = build(load_settings(cfg, {}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://exporter") as c:
        r = await c.post("/api/probe/sim", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "disabled" in r.json()["detail"]


def test_security_md_names_every_endpoint(tmp_path):
    cfg = tmp_path / "c.yml"
    cfg.write_text("targets:\n  - {name: sim, url: 'http://127.0.0.1:9'}\n")
    app = build(load_settings(cfg, {}))
    doc = (REPO / "SECURITY.md").read_text()
    paths = {getattr(r, "path", None) for r in app.router.routes} - {None}
    assert paths >= {"/metrics", "/healthz", "/api/targets", "/api/probe/{name}", "/"}
    for path in paths:
        shown = path.replace("{name}", "<target>")
        assert f"`{shown}`" in doc or f"`GET {shown}`" in doc or f"`POST {shown}`" in doc, f"SECURITY.md does not mention {shown}"


# ---------------------------------------------------------------- issue 14


def _pieces(secret: str, n: int = 8) -> list[str]:
    """Every n-character piece of a secret: a key cut in half must not survive in part either."""
    return [secret[i:i + n] for i in range(len(secret) - n + 1)]


@pytest.mark.parametrize(
    "kind,evidence",
    [
        ("echo_key_error", "preflight: GET /server_info: HTTP 400: " + "x" * 185 + "<redacted> is not a valid API key for this server"),
        # scrubbed first, then cut at 80: the marker is what gets cut, never the key
        ("echo_key_garbage", "preflight: GET /server_info: body is not JSON: '" + "x" * 70 + "<redact...'"),
    ],
    ids=["error-message-cut-at-200", "non-json-body-cut-at-80"],
)
def test_a_key_the_server_echoes_is_scrubbed_before_any_cut(stack, kind, evidence, tmp_path):
    """SGLang echoing the key across the place where its text is cut: before issue 14 the cut came
    first, and 47 of 64 characters survived in probe output, /api/targets, / and the log."""
    stack.proxy.set("preflight", kind)
    try:
        rec = stack.probe("echo")
        (tmp_path / "key").write_text(SIM_KEY)
        cli = [subprocess.run(canary_argv("probe", "--target", stack.proxy.url, "--api-key-file", str(tmp_path / "key"),
                                          "--context-tokens", "2048", *extra), capture_output=True, text=True, timeout=60)
               for extra in ((), ("--json",))]
    finally:
        stack.proxy.clear()
    assert rec["evidence"] == evidence
    texts = {path: httpx.get(stack.url + path).text for path in ("/api/targets", "/api/targets/echo", "/")}
    texts["exporter log"] = stack.proc.log()
    for i, r in enumerate(cli):
        assert r.returncode == 3, r.stderr
        texts[f"probe{' --json' if i else ''}"] = r.stdout + r.stderr
    reason = "http_4xx" if kind == "echo_key_error" else "bad_response"
    assert cli[0].stderr.endswith(f"hicache-canary probe: error ({reason}): {evidence}\n"), cli[0].stderr
    for name, text in texts.items():
        for piece in _pieces(SIM_KEY):
            assert piece not in text, f"{piece!r} of the key leaked into {name}"


def test_probe_never_prints_the_password_of_a_target_url(tmp_path):
    """`probe --target http://user:pass@host:port`: the password reached the table and --json."""
    proc, url = start_simulator(*SIM, time_scale=0.002)
    secret = "s3cretPASSw0rd"
    target = url.replace("http://", f"http://operator:{secret}@")
    try:
        runs = [subprocess.run(canary_argv("probe", "--target", target, "--context-tokens", "2048", "--passive-wait", "0",
                                           "--poll-interval", "0.05", *extra), capture_output=True, text=True, timeout=60)
                for extra in ((), ("--json",))]
    finally:
        proc.stop()
    bad = subprocess.run(canary_argv("probe", "--target", f"http://operator:{secret}@127.0.0.1:99999"),
                         capture_output=True, text=True, timeout=60)
    assert runs[0].returncode == 0, runs[0].stdout + runs[0].stderr
    assert runs[0].stdout.startswith(f"target {url} ("), runs[0].stdout
    assert json.loads(runs[1].stdout)["target"] == url
    assert (bad.returncode, bad.stderr) == (3, "hicache-canary probe: error: argument --target: 'http://127.0.0.1:99999' is not a valid URL (bad host or port)\n")
    for r in (*runs, bad):
        assert secret not in r.stdout + r.stderr and "operator" not in r.stdout + r.stderr


def test_strings_from_a_hostile_server_become_bounded_label_values(stack):
    """A 20 KB version, label syntax as a write policy, terminal escapes as an algorithm: the label
    values are `unrecognised` / `other` (SECURITY.md: labels come from closed sets or look like names)."""
    stack.proxy.set("preflight", "hostile_server_info")
    try:
        rec = stack.probe("echo")
    finally:
        stack.proxy.clear()
    assert rec["server"]["version"] == "unrecognised" and rec["server"]["speculative_algorithm"] == "unrecognised"
    lines = [line for line in httpx.get(stack.url + "/metrics").text.splitlines()
             if line.startswith("hicache_canary_server_info{") and 'target="echo"' in line]
    assert len(lines) == 1 and len(lines[0]) < 300, lines
    for label in ('version="unrecognised"', 'write_policy="other"', 'speculative_algorithm="unrecognised"'):
        assert label in lines[0], lines[0]
    page = httpx.get(stack.url + "/").text
    assert "9" * 100 not in page and "\x1b" not in page and "evil" not in page
    assert stack.probe("echo")["server"]["version"] != "unrecognised"  # and a sane answer is shown again
