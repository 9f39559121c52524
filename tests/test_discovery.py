"""Docker discovery through the real docker SDK, against a small stand-in Engine API served by
uvicorn on a unix socket (no Docker engine exists here). The stand-in answers GET /version and
GET /containers/json with the label filter, like the engine does."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request

from hicache_canary.settings.config import load_settings
from hicache_canary.service.discovery import DockerDiscovery, targets_from_containers
from hicache_canary.service.scheduler import Scheduler


def container(cid, name, labels, ports=(), ip="172.18.0.5"):
    return {"Id": cid * 16, "Names": [f"/{name}"], "Labels": labels, "State": "running",
            "Ports": list(ports), "NetworkSettings": {"Networks": {"bridge": {"IPAddress": ip}}}}


ENABLE = {"hicache-canary.enable": "true"}


class Engine:
    """Stand-in Engine API: filters containers by label like dockerd does."""

    def __init__(self):
        self.containers: list[dict] = []
        self.requests: list[str] = []
        app = FastAPI()

        @app.get("/version")
        @app.get("/v{api}/version")
        async def version(api: str = ""):
            return {"ApiVersion": "1.45", "Version": "26.1.0", "MinAPIVersion": "1.24", "Os": "linux"}

        @app.get("/v{api}/containers/json")
        async def containers(request: Request, api: str):
            self.requests.append(str(request.url.query))
            filters = json.loads(request.query_params.get("filters", "{}"))
            out = []
            for c in self.containers:
                ok = True
                for sel in filters.get("label", []):
                    k, _, v = sel.partition("=")
                    ok &= k in c["Labels"] and (not v or c["Labels"][k] == v)
                ok &= not filters.get("status") or c["State"] in filters["status"]
                if ok:
                    out.append(c)
            return out

        self.app = app


@pytest.fixture()
def engine(tmp_path: Path):
    sock = tmp_path / "docker.sock"
    eng = Engine()
    server = uvicorn.Server(uvicorn.Config(eng.app, uds=str(sock), log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stand-in engine did not start"
        time.sleep(0.01)
    eng.socket = f"unix://{sock}"
    yield eng
    server.should_exit = True
    th.join(5)


def settings_for(tmp_path: Path, socket: str, static: bool = False):
    cfg = tmp_path / "c.yml"
    targets = "targets:\n  - {name: static-0, url: 'http://127.0.0.1:1'}\n" if static else ""
    cfg.write_text(f"defaults: {{interval: 1h, context_tokens: 4096}}\n{targets}"
                   f"discovery:\n  docker: {{enabled: true, socket: '{socket}', refresh: 1h}}\n")
    return load_settings(cfg, {})


def test_url_from_label_then_published_port_then_network_address():
    found, skipped = targets_from_containers([
        container("a", "sglang-a", {**ENABLE, "hicache-canary.url": "http://gpu-a:30000"}),
        container("b", "sglang-b", ENABLE, ports=[{"PrivatePort": 30000, "PublicPort": 31000, "IP": "0.0.0.0", "Type": "tcp"}]),
        container("c", "sglang-c", {**ENABLE, "hicache-canary.name": "gpu-c"}),
        container("d", "Bad Name!", {**ENABLE, "hicache-canary.url": "ftp://x"}),
        container("e", "sglang-e", ENABLE, ip=""),
    ], "hicache-canary.url", "hicache-canary.name", 30000)
    assert [(f.name, f.url) for f in found] == [
        ("sglang-a", "http://gpu-a:30000"),
        ("sglang-b", "http://127.0.0.1:31000"),
        ("gpu-c", "http://172.18.0.5:30000"),
    ]
    assert skipped == [
        "container dddddddddddd (bad-name-): hicache-canary.url label must start with http:// or https://",
        "container eeeeeeeeeeee (sglang-e): no hicache-canary.url label, no published port 30000 and no network address",
    ]


async def test_discovery_adds_and_removes_targets_through_the_docker_sdk(engine, tmp_path):
    engine.containers = [
        container("a", "sglang-a", {**ENABLE, "hicache-canary.url": "http://127.0.0.1:30001"}),
        container("x", "unrelated", {"other": "1"}),
        container("s", "static-0", {**ENABLE, "hicache-canary.url": "http://127.0.0.1:30009"}),
    ]
    s = settings_for(tmp_path, engine.socket, static=True)
    sched = Scheduler(s.targets, None, lambda t: None)
    disc = DockerDiscovery(s, sched)
    found = await disc.refresh()
    assert [(t.name, t.url, t.source, t.probe.context_tokens) for t in found] == [("sglang-a", "http://127.0.0.1:30001", "docker", 4096)]
    assert set(sched.snapshot()) == {"static-0", "sglang-a"}  # the static target of the same name wins
    assert sched.snapshot()["static-0"].target.url == "http://127.0.0.1:1"
    assert any("hicache-canary.enable%3Dtrue" in q or "hicache-canary.enable=true" in q for q in engine.requests)

    engine.containers = [container("b", "sglang-b", {**ENABLE, "hicache-canary.url": "http://127.0.0.1:30002"})]
    found = await disc.refresh()
    assert [t.name for t in found] == ["sglang-b"]
    assert set(sched.snapshot()) == {"static-0", "sglang-b"}


async def test_unreachable_engine_keeps_current_targets(engine, tmp_path):
    engine.containers = [container("a", "sglang-a", {**ENABLE, "hicache-canary.url": "http://127.0.0.1:30001"})]
    s = settings_for(tmp_path, engine.socket)
    sched = Scheduler(s.targets, None, lambda t: None)
    disc = DockerDiscovery(s, sched)
    await disc.refresh()
    disc.cfg = disc.cfg.model_copy(update={"socket": f"unix://{tmp_path}/gone.sock"})
    found = await disc.refresh()
    assert [t.name for t in found] == ["sglang-a"] and "cannot list containers" in disc.last_error


def test_discovery_only_config_is_valid(tmp_path):
    s = settings_for(tmp_path, "unix:///var/run/docker.sock")
    assert s.targets == () and s.docker is not None and s.docker.refresh == 3600


async def test_discovered_target_is_probed(engine, tmp_path):
    engine.containers = [container("a", "sglang-a", {**ENABLE, "hicache-canary.url": "http://127.0.0.1:30001"})]
    s = settings_for(tmp_path, engine.socket)
    probed = []

    async def probe(client, settings, *, progress=None):
        from hicache_canary.models import ProbeRecord, Verdict

        probed.append(settings.target)
        return ProbeRecord(target=settings.target, started_at=time.time(), finished_at=time.time(), verdict=Verdict.REUSED)

    sched = Scheduler(s.targets, probe, lambda t: None, initial_delay=lambda i, n, iv: 0.0)
    sched.start()
    try:
        await DockerDiscovery(s, sched).refresh()
        deadline = time.monotonic() + 5
        while not probed:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert probed == ["sglang-a"]
    finally:
        await sched.stop()
