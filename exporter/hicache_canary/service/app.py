"""The exporter's HTTP face: /metrics, /healthz, /api/targets, POST /api/probe/{target}, and `/`.

`create_app(settings, scheduler, registry)` takes its collaborators so tests can pass fakes. The
scheduler is started and stopped by the app's lifespan, so SIGTERM to uvicorn cancels in-flight
probes. The probe endpoint is the only way in: it needs a bearer token (constant-time compare),
accepts only configured target names (never a URL, so the exporter is not an open proxy for GPU
time), and is disabled when no token is configured.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hicache_canary.service.collector import CanaryCollector
from hicache_canary.settings.config import Settings
from hicache_canary.service.config_reload import ConfigReloader
from hicache_canary.service.exposition import PROMETHEUS_ACCEPT, Exposition
from hicache_canary.service.history import record_to_dict
from hicache_canary.service.scheduler import Scheduler, Trigger
from hicache_canary.service.target_state import TargetSnapshot
from hicache_canary.service.statuspage import render_status_page

log = logging.getLogger("hicache_canary.service.app")
MAX_BODY_BYTES = 4096  # nothing we accept has a body; this only stops someone streaming junk at us
NAME_RE = re.compile(r"^[a-z0-9_.-]{1,63}$")


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, declared or streamed.

    Bodies are read (bounded) before the route runs, so a chunked upload is refused even by a
    route that never reads its body.
    """

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length" and (not v.isdigit() or int(v) > self.limit):
                await _too_large(scope, receive, send, self.limit)
                return
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.limit:
                await _too_large(scope, receive, send, self.limit)
                return
            if not msg.get("more_body"):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
    resp = JSONResponse({"detail": f"request body larger than {limit} bytes"}, status_code=413)
    await resp(scope, receive, send)


class MetricsFastPath:
    """ASGI middleware: GET /metrics goes straight to the cached exposition."""

    def __init__(self, app: ASGIApp, metrics: Exposition):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            await self.metrics(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def target_view(s: TargetSnapshot, history: list[dict[str, Any]], secrets: list[str]) -> dict[str, Any]:
    """One target for /api/targets: config summary (no secrets), state, last table, history."""
    return {
        "config": s.target.summary(),
        "state": {
            "verdict": s.last.verdict.value if s.last and s.last.verdict else None,
            "in_progress": s.in_progress,
            "phase": s.phase,
            "up": s.up,
            "last_conclusive_verdict": s.streak_verdict.value if s.streak_verdict else None,
            "streak": s.streak,  # consecutive conclusive verdicts equal to last_conclusive_verdict
            "probes_since_conclusive": s.since_conclusive,
            "consecutive_errors": s.consecutive_errors,
            "budget_remaining_tokens": s.budget_remaining,
            "next_probe_at": s.next_probe_at,
            "last_conclusive_at": s.last_conclusive_at,
            "last_error_reason": s.last_error_reason.value if s.last_error_reason else None,
            "restarts_detected": s.restarts_detected,
            "watch_errors": s.watch_errors,
        },
        "last": record_to_dict(s.last, secrets) if s.last else None,
        "last_measured": record_to_dict(s.last_measured, secrets) if s.last_measured else None,
        "history": history,
    }


def create_app(
    settings: Settings,
    scheduler: Scheduler,
    registry: CollectorRegistry,
    *,
    collector: CanaryCollector,
    background: list[Callable[[], Awaitable[None]]] | None = None,
    discovery: list[Any] | None = None,
    shard: Any = None,
    reloader: ConfigReloader | None = None,
) -> FastAPI:
    """`background`: extra coroutines run for the app's lifetime (discovery loops).

    `discovery` (objects with `status()`) and `shard` (a sharding.ShardView) are shown in /api/targets.
    `collector`: the one registered in `registry`, which /metrics' fast path renders too.
    `reloader`: reloads the config on SIGHUP for the app's lifetime.
    """
    token = settings.probe_api_token.get_secret_value().encode() if settings.probe_api_token else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import asyncio

        scheduler.start()
        metrics.warm(PROMETHEUS_ACCEPT, b"")
        extra = [asyncio.create_task(fn()) for fn in (background or []) + ([reloader.run] if reloader else [])]
        app.state.background = extra
        try:
            yield
        finally:
            for t in extra:
                t.cancel()
            await asyncio.gather(*extra, return_exceptions=True)
            await metrics.aclose()
            await scheduler.stop()

    app = FastAPI(title="hicache-canary", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit)
    metrics = Exposition(scheduler.snapshot, make_asgi_app(registry=registry), collector)
    app.router.routes.append(Route("/metrics", metrics, methods=["GET"]))
    # Outermost, so a scrape skips routing and FastAPI's per-request machinery (~half its cost).
    app.add_middleware(MetricsFastPath, metrics=metrics)

    def secrets() -> list[str]:
        return (reloader.settings if reloader else settings).secrets()

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        ok, problems = scheduler.healthy()
        for t in getattr(request.app.state, "background", []):
            if t.done():
                ok = False
                problems.append("target discovery stopped")
        body = {"status": "ok" if ok else "unhealthy", "config": "loaded", "targets": len(scheduler.snapshot()), "problems": problems}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/api/targets")
    async def api_targets() -> JSONResponse:
        snaps = scheduler.snapshot()
        views = [target_view(s, scheduler.history(n), secrets()) for n, s in sorted(snaps.items())]
        body: dict[str, Any] = {"targets": views}
        if shard is not None:
            body["shard"] = shard.summary()
        if discovery:
            body["discovery"] = [d.status() for d in discovery]
        return JSONResponse(body)

    @app.get("/api/targets/{name}")
    async def api_target(name: str) -> JSONResponse:
        s = scheduler.snapshot().get(name)
        if s is None:
            return JSONResponse({"detail": "unknown target"}, status_code=404)
        return JSONResponse(target_view(s, scheduler.history(name), secrets()))

    @app.post("/api/probe/{name}")
    async def api_probe(name: str, request: Request) -> JSONResponse:
        if token is None:
            return JSONResponse(
                {"detail": "the probe API is disabled: configure probe_api_token_env or probe_api_token_file"},
                status_code=403,
            )
        given = _bearer(request)
        # compare_digest on bytes: the time taken does not tell how much of a guess was right
        if given is None or not hmac.compare_digest(given.encode(), token):
            return JSONResponse(
                {"detail": "missing or wrong bearer token"}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
            )
        if not NAME_RE.match(name):
            return JSONResponse({"detail": "unknown target (give a configured target name)"}, status_code=404)
        result = scheduler.trigger(name)
        if result is Trigger.UNKNOWN:
            return JSONResponse({"detail": "unknown target (give a configured target name)"}, status_code=404)
        if result is Trigger.IN_FLIGHT:
            return JSONResponse({"detail": f"a probe of {name} is already in flight"}, status_code=409)
        log.info("probe of %s requested through the API", name)
        return JSONResponse({"target": name, "status": "started"}, status_code=202)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        snaps = scheduler.snapshot()
        page = render_status_page([(s, scheduler.history(n)) for n, s in sorted(snaps.items())], secrets())
        return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:"})

    return app
