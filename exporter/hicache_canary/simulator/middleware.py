"""The simulator's pure ASGI middleware: SGLang's API-key check and per-endpoint HTTP counts.

Pure ASGI rather than Starlette's BaseHTTPMiddleware so that a client's disconnect reaches the
endpoint (which aborts the request, as SGLang does).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .server_state import Sim

AUTH_EXEMPT = ("/health", "/health_generate", "/metrics")
COUNTED_PATHS = {"/generate", "/v1/completions", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
                 "/health", "/health_generate", "/flush_cache", "/metrics", "/v1/models"}


class SimMiddleware:
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
