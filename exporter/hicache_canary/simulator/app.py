"""FastAPI app answering like an SGLang server with HiCache: `create_app(config)`.

SGLang's endpoints (`/generate`, `/v1/completions`, `/server_info`, `/model_info`, `/health*`,
`/flush_cache`, `/metrics`) plus a clearly separate runtime control API under `/_sim/` that SGLang
does not have (state, fault switches, restart with new launch flags). With `--api-key` every route
except `/health*` and `/metrics` needs `Authorization: Bearer <key>` (SGLang's middleware: 401
`{"error": "Unauthorized"}`). A client that disconnects aborts its request, as SGLang does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from . import protocol as P
from .config import Faults, SimConfig
from .engine import Engine
from .metrics import HttpStats, bucket_bounds, render
from .serverinfo import model_info, server_info

FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")
AUTH_EXEMPT = ("/health", "/health_generate", "/metrics")
COUNTED_PATHS = {"/generate", "/v1/completions", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
                 "/health", "/health_generate", "/flush_cache", "/metrics", "/v1/models"}


class Sim:
    """Mutable state of one simulated server process; `restart` swaps in a fresh engine."""

    def __init__(self, cfg: SimConfig):
        self.http = HttpStats()
        self.shutdown: Callable[[], None] | None = None
        self._bg: asyncio.Task | None = None
        self._bg_inflight: set[asyncio.Task] = set()
        self.restarts = 0
        self._install(cfg)

    def _install(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.faults = cfg.faults
        self.engine = Engine(cfg, bucket_bounds(cfg.metrics_profile))
        self.served = 0
        self.rng = random.Random(cfg.seed + 1)

    def start(self) -> None:
        if self.cfg.background_rps > 0 and self._bg is None:
            self._bg = asyncio.get_running_loop().create_task(self._background())

    async def stop(self) -> None:
        tasks = [t for t in (self._bg, *self._bg_inflight) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._bg = None
        self._bg_inflight.clear()

    async def restart(self, cfg: SimConfig) -> None:
        await self.stop()
        self._install(cfg)
        self.restarts += 1
        self.http = HttpStats()
        self.start()

    async def _background(self) -> None:
        """The server's own traffic: unique prompts at --background-rps (simulated seconds)."""
        rng = random.Random(self.cfg.seed + 2)
        interval = self.cfg.time_scale / self.cfg.background_rps
        limit = self.cfg.max_running_requests * 2  # don't let an overloaded sim queue without bound
        while True:
            await asyncio.sleep(interval)
            if len(self._bg_inflight) >= limit:
                continue
            tokens = tuple(rng.randrange(P.VOCAB) for _ in range(self.cfg.background_context_tokens))
            task = asyncio.get_running_loop().create_task(self.engine.generate(tokens, 1, kind="background"))
            self._bg_inflight.add(task)
            task.add_done_callback(self._bg_inflight.discard)

    def state(self) -> dict:
        e, c = self.engine, self.engine.cache
        nodes = sorted(c.nodes(), key=lambda n: -n.last)
        cfg = dataclasses.asdict(self.cfg)
        cfg["api_key"] = "<redacted>" if self.cfg.api_key else None
        return {
            "config": cfg,
            "restarts": self.restarts,
            "in_flight": e.running + e.queued,
            "running": e.running,
            "queued": e.queued,
            "aborted": e.stats.aborted,
            "requests_by_kind": dict(e.stats.requests_by_kind),
            "served": self.served,
            "faults": dataclasses.asdict(self.faults),
            "pools": {
                "device_total": self.cfg.max_total_tokens, "device_cached": c.device_used, "device_inflight": c.inflight,
                "host_total": self.cfg.host_tokens, "host_used": c.host_used,
                "host_mamba_total": self.cfg.host_mamba_states if self.cfg.hybrid_model else 0,
                "host_mamba_used": c.host_mamba_used,
            },
            "cache_stats": dataclasses.asdict(c.stats),
            "segments": [{"tokens": len(n.key), "device": n.device, "host": n.host, "mamba_device": n.mamba_dev,
                          "mamba_host": n.mamba_host, "locked": n.lock > 0} for n in nodes[:200]],
            "segments_total": len(nodes),
        }


class _Middleware:
    """Pure ASGI (so disconnects reach the endpoint): API-key check and per-endpoint HTTP counts."""

    def __init__(self, app, sim: Sim):
        self.app, self.sim = app, sim

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        key = self.sim.cfg.api_key
        if key and method != "OPTIONS" and not path.startswith(AUTH_EXEMPT):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization", b"").decode() != f"Bearer {key}":
                return await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        if path not in COUNTED_PATHS:
            return await self.app(scope, receive, send)
        http = self.sim.http
        ep = (path, method)
        http.requests[ep] = http.requests.get(ep, 0) + 1
        http.active[ep] = http.active.get(ep, 0) + 1
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            http.active[ep] -= 1
            rk = (path, method, str(status["code"]))
            http.responses[rk] = http.responses.get(rk, 0) + 1


def create_app(config: SimConfig, reparse: Callable[[list[str]], SimConfig] | None = None) -> FastAPI:
    sim = Sim(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        sim.start()
        yield
        await sim.stop()

    app = FastAPI(title="SGLang HiCache simulator (hicache-canary sim)", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.sim = sim

    async def _json_body(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise P.BadRequest("The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise P.BadRequest("The request body must be a JSON object.")
        return body

    def _fault_response(openai: bool) -> Response | None:
        f = sim.faults
        if f.rate_429 and sim.rng.random() < f.rate_429:
            msg = "The server is busy, please retry later (simulated: --fault-429-rate)."
            return JSONResponse(P.openai_error(msg, 429, "TooManyRequestsError") if openai else P.native_error(msg), 429)
        if f.rate_5xx and sim.rng.random() < f.rate_5xx:
            msg = "Internal server error (simulated: --fault-5xx-rate)."
            return JSONResponse(P.openai_error(msg, 500, "InternalServerError") if openai else P.native_error(msg), 500)
        return None

    async def _watched(request: Request, coro) -> Any:
        """Run coro; cancel it (SGLang's abort) when the client goes away. None when aborted."""
        task = asyncio.ensure_future(coro)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.02)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None

    async def _finish(body: dict, status: int = 200) -> Response:
        f = sim.faults
        sim.served += 1
        if f.down_after is not None and sim.served >= f.down_after and sim.shutdown is not None:
            asyncio.get_running_loop().call_later(0.05, sim.shutdown)
        if f.slow_s:
            await asyncio.sleep(f.slow_s)
        text = json.dumps(body)
        if f.malformed_json:
            return Response(text[: max(len(text) // 2, 1)], status_code=status, media_type="application/json")
        return Response(text, status_code=status, media_type="application/json")

    async def _run(request: Request, prompts: list[tuple], max_new: int, kind: str, streaming: bool):
        engine = sim.engine
        return await _watched(request, asyncio.gather(
            *(engine.generate(t, max_new, kind=kind, streaming=streaming) for t in prompts)))

    def _output_ids(n: int) -> list[int]:
        return [sim.rng.randrange(P.VOCAB) for _ in range(n)]

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        try:
            body = await _json_body(request)
            if body.get("input_embeds") is not None:
                raise P.BadRequest("input_embeds is not supported by this server.")
            prompts, batch = P.parse_prompts(body.get("text"), body.get("input_ids"))
            sampling = P.parse_sampling(body.get("sampling_params"))
            P.check_dp_rank(body, sim.cfg.dp_size)
            for t in prompts:
                P.check_length(t, sampling.max_new_tokens, sim.cfg.max_req_input_len, sim.cfg.context_length)
        except P.BadRequest as exc:
            return JSONResponse(P.native_error(str(exc)), status_code=400)
        if (fault := _fault_response(openai=False)) is not None:
            return fault
        stream = bool(body.get("stream"))
        results = await _run(request, prompts, sampling.max_new_tokens, "generate", stream)
        if results is None:
            return Response(status_code=499)
        out = [P.generate_response(r.rid, _output_ids(r.completion_tokens), r.prompt_tokens, r.cached_device,
                                   r.cached_host, r.e2e_s) for r in results]
        if stream and not batch:
            payload = f"data: {json.dumps(out[0])}\n\ndata: [DONE]\n\n"
            sim.served += 1
            return StreamingResponse(iter([payload]), media_type="text/event-stream")
        return await _finish(out if batch else out[0])

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await _json_body(request)
            prompts = P.openai_prompts(body.get("prompt"))
            max_tokens = body.get("max_tokens", 16)
            sampling = P.parse_sampling({"max_new_tokens": max_tokens,
                                         **{k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}})
            P.check_dp_rank(body, sim.cfg.dp_size)
            for t in prompts:
                P.check_length(t, sampling.max_new_tokens, sim.cfg.max_req_input_len, sim.cfg.context_length)
        except P.BadRequest as exc:
            return JSONResponse(P.openai_error(str(exc)), status_code=400)
        if (fault := _fault_response(openai=True)) is not None:
            return fault
        results = await _run(request, prompts, sampling.max_new_tokens, "completions", False)
        if results is None:
            return Response(status_code=499)
        r = results[0]
        body_out = P.completion_response(
            r.rid, body.get("model") or sim.cfg.served_model_name, _output_ids(r.completion_tokens), r.prompt_tokens,
            r.cached_device, r.cached_host, sim.cfg.enable_cache_report, bool(body.get("return_cached_tokens_details")))
        for i, extra in enumerate(results[1:], start=1):
            body_out["choices"].append({"index": i, "text": P.detokenize(_output_ids(extra.completion_tokens)),
                                        "finish_reason": "length"})
        return await _finish(body_out)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(sim.cfg)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return model_info(sim.cfg)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": sim.cfg.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "sglang", "root": sim.cfg.served_model_name,
                                            "max_model_len": sim.cfg.context_length}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        res = await _watched(request, sim.engine.generate((0,), 1, kind="health", log_metrics=False))
        return Response(status_code=200 if res is not None else 503)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        ok = sim.engine.flush()
        return PlainTextResponse(FLUSH_TEXT, status_code=200 if ok else 400)

    @app.get("/metrics")
    async def metrics():
        if not sim.cfg.enable_metrics:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return PlainTextResponse(render(sim.cfg, sim.engine, sim.http),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- simulator-only control API ----------------------------------------------------------
    @app.get("/_sim/state")
    async def sim_state():
        return sim.state()

    @app.post("/_sim/faults")
    async def sim_faults(request: Request):
        try:
            body = await _json_body(request)
            known = {f.name for f in dataclasses.fields(Faults)}
            unknown = sorted(set(body) - known)
            if unknown:
                raise P.BadRequest(f"unknown fault switch(es) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            sim.faults = dataclasses.replace(sim.faults, **body)
        except (P.BadRequest, TypeError) as exc:
            return JSONResponse(P.native_error(str(exc)), status_code=400)
        return dataclasses.asdict(sim.faults)

    @app.post("/_sim/restart")
    async def sim_restart(request: Request):
        try:
            body = await _json_body(request)
            args = body.get("args", [])
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise P.BadRequest("args must be a list of launch flags, e.g. [\"--hicache-write-policy\", \"write_back\"]")
            if reparse is None:
                raise P.BadRequest("this simulator was started without a flag parser; restart is unavailable")
            cfg = reparse(args)
        except (P.BadRequest, ValueError) as exc:
            return JSONResponse(P.native_error(str(exc)), status_code=400)
        await sim.restart(dataclasses.replace(cfg, host=sim.cfg.host, port=sim.cfg.port))
        return sim.state()

    app.add_middleware(_Middleware, sim=sim)
    return app
