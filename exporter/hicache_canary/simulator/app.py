"""FastAPI app answering like an SGLang server with HiCache: `create_app(config)`.

SGLang's endpoints (`/generate`, `/v1/completions`, `/server_info`, `/model_info`, `/health*`,
`/flush_cache`, `/metrics`) plus a clearly separate runtime control API under `/_sim/` that SGLang
does not have (state, fault switches, restart with new launch flags: control.py). The process's state
is server_state.py, the API-key check and HTTP counts middleware.py. With `--api-key` every route
except `/health*` and `/metrics` needs `Authorization: Bearer <key>` (SGLang's middleware: 401
`{"error": "Unauthorized"}`). A client that disconnects aborts its request, as SGLang does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from . import protocol as P
from .config import SimConfig
from .control import add_control_routes
from .metrics import render
from .middleware import SimMiddleware
from .server_state import Sim
from .serverinfo import model_info, server_info

FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")


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

    def _check_fits(body: dict, prompts: list[tuple], max_new: int) -> None:
        """SGLang's checks against this server's limits: DP rank, input and context length."""
        P.check_dp_rank(body, sim.cfg.dp_size)
        for t in prompts:
            P.check_length(t, max_new, sim.cfg.max_req_input_len, sim.cfg.context_length)

    def _output_ids(n: int) -> list[int]:
        return [sim.rng.randrange(P.VOCAB) for _ in range(n)]

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        try:
            body = P.json_object(await request.body())
            if body.get("input_embeds") is not None:
                raise P.BadRequest("input_embeds is not supported by this server.")
            prompts, batch = P.parse_prompts(body.get("text"), body.get("input_ids"))
            sampling = P.parse_sampling(body.get("sampling_params"))
            _check_fits(body, prompts, sampling.max_new_tokens)
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
            body = P.json_object(await request.body())
            prompts = P.openai_prompts(body.get("prompt"))
            max_tokens = body.get("max_tokens", 16)
            sampling = P.parse_sampling({"max_new_tokens": max_tokens,
                                         **{k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}})
            _check_fits(body, prompts, sampling.max_new_tokens)
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

    add_control_routes(app, sim, reparse)
    app.add_middleware(SimMiddleware, sim=sim)
    return app
