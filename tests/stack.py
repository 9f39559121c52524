"""The real monitoring stack as processes: Prometheus, Alertmanager and a webhook receiver.

End-to-end tests run the Debian `prometheus` and `prometheus-alertmanager` binaries on 127.0.0.1
with the repository's own rule and Alertmanager files, the way compose runs them in containers.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from procs import Proc, free_port, require_binary


def start_prometheus(
    config_path: Path, *, port: int | None = None, name: str = "prometheus", extra_args: tuple[str, ...] = (),
    data_dir: Path | None = None,
) -> tuple[Proc, str]:
    """Prometheus on `config_path`; `data_dir` holds TSDB blocks to start from (a fresh one otherwise)."""
    binary = require_binary("prometheus")
    port = port or free_port()
    data = str(data_dir) if data_dir else tempfile.mkdtemp(prefix="prom-data-")
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
        "--storage.tsdb.retention.time=1h",
        # Resend firing alerts every second: by default Prometheus waits a minute, so an alert
        # that fired before Alertmanager was discovered would add a minute to every e2e test.
        "--rules.alert.resend-delay=1s",
        *extra_args,
    ]
    proc = Proc(name, argv)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/-/ready", timeout=60, ok=lambda r: r.status_code == 200)
    return proc, url


def start_alertmanager(config_path: Path, *, port: int | None = None, name: str = "alertmanager") -> tuple[Proc, str]:
    binary = require_binary("prometheus-alertmanager")
    port = port or free_port()
    data = tempfile.mkdtemp(prefix="am-data-")
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
        # A lone instance: no gossip port to collide with parallel tests.
        "--cluster.listen-address=",
    ]
    proc = Proc(name, argv)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/-/ready", timeout=60, ok=lambda r: r.status_code == 200)
    return proc, url


class WebhookReceiver:
    """Records Alertmanager webhook notifications, keyed by URL path (one path per receiver)."""

    def __init__(self) -> None:
        self.notifications: list[tuple[str, dict, float]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsable": body.decode(errors="replace")}
                with receiver._lock:
                    receiver.notifications.append((self.path, payload, time.monotonic()))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "WebhookReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self, path: str | None = None, status: str | None = None) -> list[dict]:
        """Every alert in every notification (optionally for one receiver path / status)."""
        with self._lock:
            items = list(self.notifications)
        out = []
        for p, payload, _ in items:
            if path is not None and p != path:
                continue
            for alert in payload.get("alerts", []):
                if status is None or alert.get("status") == status:
                    out.append(alert)
        return out

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for alert in self.alerts():
                if predicate(alert):
                    return alert
            time.sleep(0.2)
        raise TimeoutError(f"no {what} within {timeout}s; received: {self.notifications!r}"[:4000])


def prom_query(prom_url: str, expr: str, at: float | None = None) -> list[dict]:
    """Instant query; raises with Prometheus's own error text on a bad expression."""
    params = {"query": expr}
    if at is not None:
        params["time"] = str(at)
    r = httpx.get(prom_url + "/api/v1/query", params=params, timeout=10)
    body = r.json()
    if body.get("status") != "success":
        raise AssertionError(f"query failed: {expr!r}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def prom_query_range(prom_url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """Range query, as a Grafana time series panel asks; raises with Prometheus's error text."""
    params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
    r = httpx.get(prom_url + "/api/v1/query_range", params=params, timeout=10)
    body = r.json()
    if body.get("status") != "success":
        raise AssertionError(f"query failed: {expr!r}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def wait_prom(prom_url: str, expr: str, timeout: float, what: str) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = prom_query(prom_url, expr)
        if result:
            return result
        time.sleep(0.5)
    raise TimeoutError(f"{what}: {expr!r} returned nothing within {timeout}s")
