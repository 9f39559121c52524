"""A reshaping HTTP proxy in front of a real simulator, for canary tests (not collected by pytest).

It makes the simulator look like servers we cannot start here: an OpenAI-only deployment
(`/generate` answers 404), an older build without per-request tier details, a router (metrics
renamed `sglang_`), or a data-parallel server (dp_size 2, and it records each request body so the
test can check `routed_dp_rank`). It can also drop metric families (an older build). It serves real HTTP on 127.0.0.1 from a thread of the test process.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from procs import free_port


class ReshapingProxy:
    def __init__(self, upstream: str, *, openai_only=False, strip_details=False, router=False, dp_size: int | None = None,
                 drop_metrics: tuple[str, ...] = ()):
        self.upstream = upstream
        self.drop_metrics = tuple(f"sglang:{m}".encode() for m in drop_metrics)
        self.openai_only, self.strip_details, self.router, self.dp_size = openai_only, strip_details, router, dp_size
        self.bodies: list[dict] = []
        self._client: httpx.AsyncClient | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST", "PUT"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ReshapingProxy:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("proxy did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def handle(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        body = await request.body()
        if path == "/generate" and self.openai_only:
            return Response('{"detail":"Not Found"}', status_code=404, media_type="application/json")
        if body and request.method == "POST":
            self.bodies.append({"path": path, **json.loads(body)})
        if self._client is None:  # one client, created on the proxy's own loop (a new one costs ~100 ms)
            self._client = httpx.AsyncClient(base_url=self.upstream, timeout=300)
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        up = await self._client.request(request.method, path, content=body, headers=headers)
        content, ctype = up.content, up.headers.get("content-type", "application/json")
        if path in ("/generate", "/v1/completions") and self.strip_details and up.status_code == 200:
            data = json.loads(content)
            data.get("meta_info", {}).pop("cached_tokens_details", None)
            data.pop("sglext", None)
            content = json.dumps(data).encode()
        elif path in ("/server_info", "/get_server_info") and self.dp_size and up.status_code == 200:
            data = json.loads(content)
            data["dp_size"] = self.dp_size
            content = json.dumps(data).encode()
        elif path == "/metrics":
            if self.drop_metrics:  # an older build without these families at all
                content = b"\n".join(
                    line for line in content.split(b"\n")
                    if not any(line.lstrip(b"# HELPTYPE").startswith(m) for m in self.drop_metrics)
                )
            if self.router:
                content = content.replace(b"sglang:", b"sglang_")
        return Response(content, status_code=up.status_code, media_type=ctype.split(";")[0])
