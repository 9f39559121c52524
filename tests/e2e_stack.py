"""The whole product as processes, for the end-to-end tests and bench/detection.py.

`start_e2e_stack()` brings up, all on 127.0.0.1 with free ports:
- SGLang simulators (one per `SimSpec`), scaled down from the field report's server,
- the exporter (`hicache-canary serve`) with a config naming them,
- Prometheus with the repository's prometheus.yml rendered for these addresses and 1 s
  scrape/evaluation, loading the rule files verbatim,
- Alertmanager with the repository's alertmanager.yml rendered by the same script compose runs,
- a WebhookReceiver behind the pager, chat and heartbeat receivers.

The Alertmanager config is the shipped one (pager group_wait 10s, group_interval 1m), so the tests
prove the timing a user gets; `am_group_interval` can shorten the root's group_interval for a
comparison (bench/detection.py), never by default. The exporter runs every target with
`confirm_after: 1s`: a first `silent` is confirmed a second later, whatever the target's interval.

Tests share one stack per session through `shared_stack()` (refcounted, so both e2e files can
hold it as a session fixture and the last one out stops it): starting it and waiting for the first
page is the slow part, not the assertions.
"""

from __future__ import annotations

import atexit
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from procs import Proc, canary_argv, free_port
from stack import WebhookReceiver, prom_query, start_alertmanager, start_prometheus
from test_prometheus_rules import SECRET_NAMES, render_alertmanager_config, render_prometheus_config

# The field report's server scaled down 20x in pool sizes (the demo's shape, smaller): a hybrid
# GDN model with HiCache, so write_through loses the Mamba state and write_back does not.
SIM_FLAGS = (
    "--enable-hierarchical-cache", "--hybrid-model", "--enable-metrics", "--enable-cache-report",
    "--max-total-tokens", "20000", "--hicache-host-tokens", "40000", "--chunked-prefill-size", "4096",
)
CONTEXT_TOKENS = 8192
PAGER = "/pager_webhook_url"
CHAT = "/chat_webhook_url"
HEARTBEAT = "/heartbeat_webhook_url"
API_TOKEN = "e2e-probe-token"


@dataclass(frozen=True)
class SimSpec:
    name: str  # the target name in the exporter config and Prometheus's `target` label
    flags: tuple[str, ...] = ()  # on top of SIM_FLAGS
    interval: str = "3s"  # exporter probe interval for this target


@dataclass
class Sim:
    spec: SimSpec
    port: int
    proc: Proc
    url: str


@dataclass
class E2EStack:
    sims: dict[str, Sim]
    exporter: Proc
    exporter_url: str
    prom: Proc
    prom_url: str
    am: Proc
    am_url: str
    hook: WebhookReceiver
    started: float  # time.monotonic() when the simulators were up
    dir: Path
    extra_ams: dict[str, tuple[Proc, str]] = field(default_factory=dict)  # name -> (process, url)
    marks: dict[str, float] = field(default_factory=dict)  # shared moments between tests (monotonic)
    _stopped: bool = field(default=False, repr=False)

    # ---- control

    def restart_sim(self, name: str, *args: str) -> float:
        """Restart a simulator in place with extra launch flags; returns monotonic time of the restart."""
        r = httpx.post(self.sims[name].url + "/_sim/restart", json={"args": list(args)}, timeout=30)
        assert r.status_code == 200, f"restart of {name} failed: {r.status_code} {r.text}"
        return time.monotonic()

    def set_faults(self, name: str, **faults) -> None:
        """Switch the simulator's runtime faults (e.g. malformed_json=True) without a restart."""
        r = httpx.post(self.sims[name].url + "/_sim/faults", json=faults, timeout=30)
        assert r.status_code == 200, f"faults of {name}: {r.status_code} {r.text}"

    def stop_sim(self, name: str) -> float:
        self.sims[name].proc.stop()
        return time.monotonic()

    def trigger_probe(self, name: str, timeout: float = 30) -> None:
        """POST /api/probe/{name} until the exporter accepts it (409 while one is in flight)."""
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(
                f"{self.exporter_url}/api/probe/{name}", headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=5
            )
            if r.status_code < 300:
                return
            assert r.status_code == 409 and time.monotonic() < deadline, f"probe trigger for {name}: {r.status_code} {r.text}"
            time.sleep(0.2)

    # ---- observation

    def query(self, expr: str) -> list[dict]:
        return prom_query(self.prom_url, expr)

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_value(self, expr: str, predicate, timeout: float, what: str) -> float:
        deadline = time.monotonic() + timeout
        while True:
            v = self.value(expr)
            if v is not None and predicate(v):
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {expr!r} = {v} after {timeout}s\n{self.logs_tail()}")
            time.sleep(0.5)

    def notifications(self, path: str, *, alertname: str | None = None, target: str | None = None,
                      status: str | None = None, after: float | None = None) -> list[tuple[dict, float]]:
        """(alert, received_at) for every alert in every webhook call on `path` that matches."""
        out = []
        for p, payload, at in list(self.hook.notifications):
            if p != path or (after is not None and at < after):
                continue
            for alert in payload.get("alerts", []):
                labels = alert.get("labels", {})
                if alertname is not None and labels.get("alertname") != alertname:
                    continue
                if target is not None and labels.get("target") != target:
                    continue
                if status is not None and alert.get("status") != status:
                    continue
                out.append((alert, at))
        return out

    def wait_notification(self, path: str, timeout: float, **match) -> tuple[dict, float]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.notifications(path, **match)
            if got:
                return got[0]
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no notification on {path} matching {match} within {timeout}s; "
                    f"received: {[(p, [(a['labels'].get('alertname'), a['labels'].get('target'), a['status']) for a in pl.get('alerts', [])]) for p, pl, _ in self.hook.notifications]}"
                    f"\n{self.logs_tail()}"
                )
            time.sleep(0.2)

    def am_alerts(self) -> list[dict]:
        return httpx.get(self.am_url + "/api/v2/alerts", timeout=5).json()

    def logs_tail(self) -> str:
        return "exporter log tail:\n" + self.exporter.log()[-2000:]

    # ---- teardown

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        extra = [proc for proc, _ in self.extra_ams.values()]
        for proc in (self.prom, self.am, *extra, self.exporter, *(s.proc for s in self.sims.values())):
            proc.stop()
        self.hook.__exit__(None, None, None)


def _exporter_config(sims: dict[str, Sim], path: Path, confirm_after: str, watch: dict[str, str] | None = None) -> Path:
    cfg = {
        "probe_api_token_env": "HICACHE_CANARY_E2E_TOKEN",
        "defaults": {
            "context_tokens": CONTEXT_TOKENS,
            # A probe sends ~40K tokens; the default 2M/hour would skip probes at a 3 s interval.
            "token_budget_per_hour": 1_000_000_000,
            "passive_wait": "0s",  # no traffic of its own: send filler at once
            "poll_interval": "200ms",
            "request_timeout": "30s",
            # Confirm a first silent verdict a second later (shipped: 60s, capped at the interval):
            # `doomed`, probed hourly, reaches the two silent probes HiCacheSilent needs on its own.
            "confirm_after": confirm_after,
            # watch_interval / restart_probe_delay when given (bench/detection.py scales them);
            # otherwise the shipped 30s watch, which is off at these intervals of seconds.
            **(watch or {}),
        },
        "targets": [{"name": n, "url": s.url, "interval": s.spec.interval} for n, s in sims.items()],
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _alertmanager_config(out: Path, hook_url: str, group_interval: str | None) -> Path:
    """The shipped config rendered with webhook URLs under hook_url (+ optional shorter group_interval,
    on the root route and on every route that sets its own, such as the pager's)."""
    path = render_alertmanager_config(out, {n: f"{hook_url}/{n}" for n in SECRET_NAMES})
    if group_interval is not None:
        cfg = yaml.safe_load(path.read_text())
        for route in [cfg["route"], *cfg["route"].get("routes", [])]:
            if route is cfg["route"] or "group_interval" in route:
                route["group_interval"] = group_interval
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def start_e2e_stack(
    specs: list[SimSpec],
    *,
    time_scale: float = 0.01,
    am_group_interval: str | None = None,
    extra_alertmanagers: dict[str, str | None] | None = None,
    confirm_after: str = "1s",
    watch: dict[str, str] | None = None,
) -> E2EStack:
    """Start everything; on any failure stop what already started and re-raise.

    `extra_alertmanagers` maps a name to a group_interval (None: as shipped): each gets its own
    Alertmanager, fed by the same Prometheus, whose receivers post to `/<name>/<secret name>` on the
    same webhook receiver (see `E2EStack.extra_ams`). bench/detection.py uses it to time the
    shipped Alertmanager and a fast one side by side.
    """
    workdir = Path(tempfile.mkdtemp(prefix="e2e-stack-"))
    started: list[Proc] = []
    hook = WebhookReceiver().__enter__()
    try:
        sims: dict[str, Sim] = {}
        for spec in specs:  # start all, then wait: each one's Python start-up takes a second or two
            port = free_port()
            argv = canary_argv("sim", "--host", "127.0.0.1", "--port", str(port), "--time-scale", str(time_scale), *SIM_FLAGS, *spec.flags)
            proc = Proc(f"e2e-sim-{spec.name}", argv)
            started.append(proc)
            sims[spec.name] = Sim(spec, port, proc, f"http://127.0.0.1:{port}")
        for sim in sims.values():
            sim.proc.wait_http(sim.url + "/health")
        t0 = time.monotonic()
        am_cfg = _alertmanager_config(workdir / "am", hook.url, am_group_interval)
        am, am_url = start_alertmanager(am_cfg, name="e2e-alertmanager")
        started.append(am)
        extra: dict[str, tuple[Proc, str]] = {}
        for name, interval in (extra_alertmanagers or {}).items():
            cfg_path = _alertmanager_config(workdir / f"am-{name}", f"{hook.url}/{name}", interval)
            proc, url = start_alertmanager(cfg_path, name=f"e2e-alertmanager-{name}")
            started.append(proc)
            extra[name] = (proc, url)
        exporter_port = free_port()
        cfg = _exporter_config(sims, workdir / "exporter.yml", confirm_after, watch)
        exporter = Proc(
            "e2e-exporter",
            canary_argv("serve", "--config", str(cfg), "--host", "127.0.0.1", "--port", str(exporter_port)),
            env={"HICACHE_CANARY_E2E_TOKEN": API_TOKEN},
        )
        started.append(exporter)
        exporter_url = f"http://127.0.0.1:{exporter_port}"
        exporter.wait_http(exporter_url + "/healthz", ok=lambda r: r.status_code == 200)
        prom_cfg = render_prometheus_config(
            workdir / "prom",
            exporter=f"127.0.0.1:{exporter_port}",
            sglang={n: f"127.0.0.1:{s.port}" for n, s in sims.items()},
            alertmanager=am_url.removeprefix("http://"),
        )
        if extra:  # every Alertmanager gets every alert, as an HA pair would
            cfg = yaml.safe_load(prom_cfg.read_text())
            cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] += [u.removeprefix("http://") for _, u in extra.values()]
            prom_cfg.write_text(yaml.safe_dump(cfg, sort_keys=False))
        prom, prom_url = start_prometheus(prom_cfg, name="e2e-prometheus")
        started.append(prom)
    except BaseException:
        for proc in reversed(started):
            proc.stop()
        hook.__exit__(None, None, None)
        raise
    return E2EStack(sims, exporter, exporter_url, prom, prom_url, am, am_url, hook, t0, workdir, extra_ams=extra)


# ---------------------------------------------------------------- the shared test stack

# The shared stack's targets. Order matters: the scheduler staggers first probes by position, and
# `doomed` (1h interval, probed on demand) goes first so its scheduled probe starts at once.
DOOMED = "e2e-doomed"  # silent, then stopped: SGLangTargetDown pages and inhibits its HiCacheSilent
SILENT = "e2e-silent"  # write_through (default hybrid failure): pages; restarted as write_back: resolves
HEALTHY = "e2e-healthy"  # write_back: never pages
BROKEN = "e2e-broken"  # answers with malformed JSON: probes end in error (bad_response), never down
SHARED_SPECS = [
    SimSpec(DOOMED, ("--hicache-write-policy", "write_through"), interval="1h"),
    SimSpec(SILENT, ("--hicache-write-policy", "write_through")),
    SimSpec(HEALTHY, ("--hicache-write-policy", "write_back")),
    SimSpec(BROKEN, ("--hicache-write-policy", "write_back", "--fault-malformed-json")),
]

_shared: E2EStack | None = None
_users = 0


def acquire_shared_stack() -> E2EStack:
    global _shared, _users
    if _shared is None:
        stack = start_e2e_stack(SHARED_SPECS)
        atexit.register(stack.stop)  # a crashed session must not leave daemons on the runner
        try:
            _prime_doomed(stack)
        except BaseException:
            stack.stop()
            raise
        _shared = stack
    _users += 1
    return _shared


def _prime_doomed(stack: E2EStack) -> None:
    """Wait for `doomed`'s two silent probes: its first scheduled one, and the exporter's own
    confirmation a second later (its interval is 1h). Its page then arrives while the other tests
    run; it is never probed again, so its HiCacheSilent keeps firing after the server stops (which is
    what inhibition has to hide)."""
    stack.wait_value(f'hicache_canary_verdict_streak{{target="{DOOMED}"}} and on (target) hicache_canary_verdict{{verdict="silent"}} == 1',
                     lambda v: v >= 2, 60, "doomed's confirmed silent verdict")
    stack.marks["doomed_confirmed"] = time.monotonic()


def stop_doomed_after_its_page(stack: E2EStack) -> float:
    """Stop `doomed` once its HiCacheSilent has paged (once per stack); returns when it stopped.

    The alerting test calls it as soon as it can, so SGLangTargetDown's `for: 2m` runs while the
    silent server is being fixed rather than after."""
    if "doomed_stopped" not in stack.marks:
        stack.wait_notification(PAGER, 240, alertname="HiCacheSilent", target=DOOMED, status="firing")
        stack.marks["doomed_stopped"] = stack.stop_sim(DOOMED)
    return stack.marks["doomed_stopped"]


def release_shared_stack() -> None:
    global _shared, _users
    _users -= 1
    if _users == 0 and _shared is not None:
        _shared.stop()
        _shared = None


def finite_values(result: list[dict]) -> list[float]:
    """The sample values of an instant query that a panel would draw (NaN/Inf draw nothing)."""
    values = [float(r["value"][1]) for r in result]
    return [v for v in values if math.isfinite(v)]

