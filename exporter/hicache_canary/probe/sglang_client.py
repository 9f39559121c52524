"""Async HTTP client for one SGLang server: /generate, /v1/completions, /server_info, /metrics, /health.

Every failure surfaces as one exception type, SGLangError, whose `.reason` is a closed
models.ErrorReason (safe as a label) and whose text is a bounded one-liner that never contains
the API key: the key is scrubbed from the whole text before it is cut (shown.shown_text), and
every public method scrubs what it raises. Mapping: connect refused/DNS -> CONNECT_FAILED (a
connect that times out too: the server is unreachable, not slow); a connection that was open and
then dropped (no answer, half an answer, reset) -> CONNECTION_LOST; read/write/pool timeouts ->
TIMEOUT; 401/403 -> UNAUTHORIZED;
429 -> RATE_LIMITED; 400 saying the input exceeds the context -> CONTEXT_TOO_LONG; other 4xx ->
HTTP_4XX with SGLang's own message; 5xx -> HTTP_5XX; truncated bodies, bad JSON or wrong types ->
BAD_RESPONSE. The bodies are parsed by sglang_responses.py (pure); this module does the IO.

Bodies are read with a limit (MAX_METRICS_BYTES, MAX_JSON_BYTES): a server that streams without end
costs a bounded amount of memory and ends in BAD_RESPONSE.

Latency is measured here, client side, around the whole request (send, prefill, body read): it is
what a user of the server waits, and what the rehost/cold ratio compares.

`routed_dp_rank` is SGLang 0.5.23's name for pinning a /generate to one DP rank; older builds call
it `data_parallel_rank` (0.5.23 still accepts that as a deprecated alias). We send the new name
only: a build that predates it ignores unknown fields, which at worst leaves DP routing to the
server (the canary reports dp_size so a human can tell).
"""

from __future__ import annotations

import functools
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import httpx

from hicache_canary.models import CounterSnapshot, ErrorReason, GenerateResult, ServerFacts
from hicache_canary.settings.secrets_loader import load_api_key  # noqa: F401 - the SGLang API key, for callers of the client
from hicache_canary.shown import display_url, shown_text
from hicache_canary.probe.sglang_errors import SGLangError
from hicache_canary.probe.sglang_metrics import parse_snapshot
from hicache_canary.probe.sglang_responses import parse_completion, parse_generate, parse_server_info, redact_server_info, status_failure

__all__ = ["SGLangClient", "SGLangError", "Timeouts", "load_api_key"]

MAX_NOT_JSON = 80  # of a body that should have been JSON, quoted in the message
MAX_METRICS_BYTES = 16 << 20  # SGLang's /metrics with TP=8 and every histogram is well under 1 MiB
MAX_JSON_BYTES = 4 << 20  # /server_info, /generate with max_new_tokens=1


@dataclass(frozen=True)
class Timeouts:
    """Seconds. /generate and /v1/completions take their timeout per call (prefill can be long)."""

    connect: float = 5.0
    read_small: float = 10.0  # /server_info, /metrics, /health




def _scrubbing(method):
    """Re-raise any SGLangError from `method` scrubbed of this client's secrets (parse errors included)."""

    @functools.wraps(method)
    async def wrapper(self: SGLangClient, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except SGLangError as exc:
            raise exc.scrubbed(self._secrets) from None

    return wrapper


@lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One verifying TLS context per process, shared by every client.

    httpx builds (and loads the CA bundle into) a new context for every client, ~20-40 ms holding
    the GIL; the exporter makes a client per probe and per restart-watch poll, and that stall showed
    up as /metrics p99 during probes.
    """
    return httpx.create_ssl_context()


class SGLangClient:
    """One SGLang server. Use as `async with SGLangClient(url) as c:` or call aclose()."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        small_timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeouts = Timeouts(connect=connect_timeout, read_small=small_timeout)
        self._display = display_url(self.base_url)
        self._secrets = tuple(s for s in (api_key, _userinfo(self.base_url)) if s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, transport=transport, verify=_ssl_context()
        )

    def __repr__(self) -> str:
        return f"SGLangClient({self._display!r}, api_key={'set' if self._secrets else 'none'})"

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- endpoints (each scrubs what it raises: parse errors quote server text too) ---------

    @_scrubbing
    async def server_info(self) -> ServerFacts:
        return parse_server_info(await self._server_info_json())

    @_scrubbing
    async def raw_server_info(self) -> dict:
        body = await self._server_info_json()
        if not isinstance(body, dict):
            return {"_body": redact_server_info(body, self._secrets)}
        return redact_server_info(body, self._secrets)

    @_scrubbing
    async def metrics_text(self) -> str:
        resp = await self._request("GET", "/metrics", timeout=self._small(), not_found=False, limit=MAX_METRICS_BYTES)
        if resp.status_code == 404:
            raise SGLangError(ErrorReason.BAD_RESPONSE, "GET /metrics: 404, metrics disabled (--enable-metrics)", 404)
        return resp.text

    @_scrubbing
    async def metrics(self) -> CounterSnapshot:
        text = await self.metrics_text()
        return parse_snapshot(text, taken_at=time.time())

    async def health(self) -> bool:
        """True on 200 from /health; False on any other status, timeout or connection failure."""
        try:
            resp = await self._request("GET", "/health", timeout=self._small(), check=False)
        except SGLangError:
            return False
        return resp.status_code == 200

    @_scrubbing
    async def generate(
        self,
        input_ids: list[int],
        *,
        max_new_tokens: int = 1,
        routed_dp_rank: int | None = None,
        timeout: float = 300.0,
    ) -> GenerateResult:
        payload: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        }
        if routed_dp_rank is not None:
            payload["routed_dp_rank"] = routed_dp_rank
        return await self._timed_post("/generate", payload, timeout, parse_generate)

    @_scrubbing
    async def completion(
        self,
        prompt: str | list[int],
        *,
        model: str | None = None,
        max_new_tokens: int = 1,
        timeout: float = 300.0,
    ) -> GenerateResult:
        payload: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "stream": False,
            "return_cached_tokens_details": True,
        }
        if model is not None:
            payload["model"] = model
        return await self._timed_post("/v1/completions", payload, timeout, parse_completion)

    # --- plumbing ------------------------------------------------------------------------

    async def _timed_post(self, path: str, payload: dict[str, Any], timeout: float,
                          parse: Callable[[Any, float], GenerateResult]) -> GenerateResult:
        """POST and parse; the latency is the whole request as its caller waits it (send, prefill, body)."""
        start = time.perf_counter()
        resp = await self._request("POST", path, json_body=payload, timeout=self._long(timeout))
        body = self._json(resp, f"POST {path}")
        return parse(body, time.perf_counter() - start)

    def _small(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeouts.read_small, connect=self.timeouts.connect)

    def _long(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=min(self.timeouts.connect, seconds))

    async def _server_info_json(self) -> Any:
        resp = await self._request("GET", "/server_info", timeout=self._small(), not_found=False)
        where = "GET /server_info"
        if resp.status_code == 404:  # builds before the rename only have the old path
            resp = await self._request("GET", "/get_server_info", timeout=self._small())
            where = "GET /get_server_info"
        return self._json(resp, where)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        timeout: httpx.Timeout,
        json_body: Any = None,
        check: bool = True,
        not_found: bool = True,
        limit: int = MAX_JSON_BYTES,
    ) -> Reply:
        """Send and read the whole body (at most `limit` bytes); map every failure to SGLangError.

        `check=False` returns any status; `not_found=False` returns a 404 to the caller.
        """
        where = f"{method} {path}"
        try:
            request = self._http.build_request(method, path, json=json_body, timeout=timeout)
            stream = await self._http.send(request, stream=True)
            try:
                resp = Reply(stream.status_code, await _read_limited(stream, limit, where), stream.charset_encoding)
            finally:
                await stream.aclose()
        except httpx.ConnectTimeout:
            raise self._err(ErrorReason.CONNECT_FAILED, f"{where}: connect to {self._display} timed out") from None
        except httpx.TimeoutException as exc:
            raise self._err(ErrorReason.TIMEOUT, f"{where}: {_timeout_kind(exc)} timed out after {timeout.read}s") from None
        except httpx.ConnectError as exc:
            raise self._err(ErrorReason.CONNECT_FAILED, f"{where}: cannot connect to {self._display}: {exc}") from None
        except httpx.RemoteProtocolError as exc:
            # The connection was open and the server dropped it: it died or was killed mid-request.
            if "without sending" in str(exc) and "response" in str(exc) and "body" not in str(exc):
                raise self._err(ErrorReason.CONNECTION_LOST, f"{where}: server closed the connection before answering") from None
            if "peer closed connection" in str(exc):
                raise self._err(ErrorReason.CONNECTION_LOST, f"{where}: server closed the connection mid-answer: {exc}") from None
            raise self._err(ErrorReason.BAD_RESPONSE, f"{where}: broken HTTP response: {exc}") from None
        except httpx.DecodingError as exc:
            raise self._err(ErrorReason.BAD_RESPONSE, f"{where}: undecodable body: {exc}") from None
        except (httpx.ReadError, httpx.WriteError) as exc:
            raise self._err(ErrorReason.CONNECTION_LOST, f"{where}: connection lost: {type(exc).__name__} {exc}") from None
        except httpx.HTTPError as exc:
            raise self._err(ErrorReason.CONNECT_FAILED, f"{where}: {type(exc).__name__}: {exc}") from None
        if not check or resp.is_success or (resp.status_code == 404 and not not_found):
            return resp
        raise self._status_error(where, resp)

    def _status_error(self, where: str, resp: Reply) -> SGLangError:
        reason, text = status_failure(where, resp.status_code, resp.content, resp.text)
        return self._err(reason, text, resp.status_code)

    def _json(self, resp: Reply, where: str) -> Any:
        try:
            return json.loads(resp.content)
        except (ValueError, UnicodeDecodeError):
            # scrubbed before the cut: a key straddling character 80 must not survive in part
            raise self._err(ErrorReason.BAD_RESPONSE, f"{where}: body is not JSON: {shown_text(resp.text, self._secrets, MAX_NOT_JSON)!r}") from None

    def _err(self, reason: ErrorReason, message: str, status: int | None = None) -> SGLangError:
        return SGLangError(reason, message, status, self._secrets)


@dataclass(frozen=True)
class Reply:
    """A whole (bounded) HTTP answer: what httpx.Response gave, without unbounded reads."""

    status_code: int
    content: bytes
    encoding: str | None = None

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        try:
            return self.content.decode(self.encoding or "utf-8", errors="replace")
        except LookupError:  # a charset Python does not know
            return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


async def _read_limited(resp: httpx.Response, limit: int, where: str) -> bytes:
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise SGLangError(ErrorReason.BAD_RESPONSE, f"{where}: body of {int(declared)} bytes is larger than the {limit}-byte limit")
    parts, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise SGLangError(ErrorReason.BAD_RESPONSE, f"{where}: body is larger than the {limit}-byte limit")
        parts.append(chunk)
    return b"".join(parts)


def _timeout_kind(exc: httpx.TimeoutException) -> str:
    return {httpx.ReadTimeout: "read", httpx.WriteTimeout: "write", httpx.PoolTimeout: "pool"}.get(type(exc), "request")


def _userinfo(url: str) -> str | None:
    return urlsplit(url).password
