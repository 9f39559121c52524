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
BAD_RESPONSE.

Bodies are read with a limit (MAX_METRICS_BYTES, MAX_JSON_BYTES): a server that streams without end
costs a bounded amount of memory and ends in BAD_RESPONSE. Strings that end up in labels or on a
terminal (version, write policy, speculative algorithm) are kept only when they look like one
(shown.server_token), else they read `unrecognised`.

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
import math
import re
import ssl
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import httpx

from .models import CachedTokens, CounterSnapshot, ErrorReason, GenerateResult, ServerFacts
from .secrets_loader import load_api_key  # noqa: F401 - the SGLang API key, for callers of the client
from .shown import display_url, server_token, shown_text
from .sglang_metrics import parse_snapshot

MAX_MESSAGE = 300
MAX_NOT_JSON = 80  # of a body that should have been JSON, quoted in the message
MAX_METRICS_BYTES = 16 << 20  # SGLang's /metrics with TP=8 and every histogram is well under 1 MiB
MAX_JSON_BYTES = 4 << 20  # /server_info, /generate with max_new_tokens=1
_CONTEXT_TOO_LONG = re.compile(
    r"longer than the model's context length|exceeds the maximum allowed length|context_length_exceeded"
    r"|maximum context length",
    re.IGNORECASE,
)
# Keys of /server_info that may hold credentials (SGLang returns admin_api_key unredacted).
_SECRET_PART = re.compile(r"(^|_)(key|secret|password|passwd|token|credentials?|auth|authorization)($|_)", re.I)
_ROUTER_KEYS = ("prefill", "decode", "workers", "worker_urls", "prefill_urls", "decode_urls")


class SGLangError(Exception):
    """A failed call to SGLang. `reason` is bounded; `status` is the HTTP status when there was one.

    `message` is what may be shown: `secrets` scrubbed from the whole text, then one line, then cut.
    The uncut text is kept (privately) so the client can scrub keys the raiser did not know.
    """

    def __init__(self, reason: ErrorReason, message: str, status: int | None = None, secrets: tuple[str, ...] = ()):
        self.reason = reason
        self.status = status
        self._raw = str(message)
        self.message = shown_text(self._raw, secrets, MAX_MESSAGE)
        super().__init__(self.message)

    def scrubbed(self, secrets: tuple[str, ...]) -> SGLangError:
        return SGLangError(self.reason, self._raw, self.status, secrets)

    def __repr__(self) -> str:
        return f"SGLangError({self.reason.value!r}, {self.message!r}, status={self.status!r})"


@dataclass(frozen=True)
class Timeouts:
    """Seconds. /generate and /v1/completions take their timeout per call (prefill can be long)."""

    connect: float = 5.0
    read_small: float = 10.0  # /server_info, /metrics, /health


def redact_server_info(body: Any, secrets: tuple[str, ...] = ()) -> Any:
    """Copy of a /server_info body without credential-like keys (recursively) or known secret values."""
    if isinstance(body, dict):
        return {
            k: redact_server_info(v, secrets)
            for k, v in body.items()
            if not (isinstance(k, str) and _is_secret_key(k))
        }
    if isinstance(body, list):
        return [redact_server_info(v, secrets) for v in body]
    if isinstance(body, str) and any(s and s in body for s in secrets):
        return "<redacted>"
    return body


def _is_secret_key(key: str) -> bool:
    # `max_total_num_tokens` is a count, `hf_token` a credential: match whole `_`-separated parts.
    return bool(_SECRET_PART.search(key)) or "api_key" in key.lower()


def parse_server_info(body: Any) -> ServerFacts:
    """Pure: /server_info JSON -> ServerFacts. Raises SGLangError(BAD_RESPONSE) on wrong types."""
    if not isinstance(body, dict):
        if isinstance(body, list):  # a router listing its workers
            return ServerFacts(looks_like_router=True)
        raise SGLangError(ErrorReason.BAD_RESPONSE, f"server_info is a JSON {type(body).__name__}, not an object")
    states = body.get("internal_states")
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}

    def pick(key: str) -> Any:
        value = body.get(key)
        return first.get(key) if value is None else value

    if any(isinstance(body.get(k), (list, dict)) for k in _ROUTER_KEYS) or not (
        {"model_path", "version", "enable_hierarchical_cache"} & body.keys()
    ):
        return ServerFacts(looks_like_router=True, version=_token(body, "version"))

    hybrid = pick("uses_mamba_radix_cache")
    if hybrid is None:
        for override in first.get("_resolved_overrides") or []:
            if isinstance(override, list) and len(override) == 2 and isinstance(override[1], dict):
                hybrid = override[1].get("uses_mamba_radix_cache", hybrid)
    return ServerFacts(
        version=_token(body, "version"),
        model_path=_str(body, "model_path"),
        served_model_name=_str(body, "served_model_name"),
        enable_hierarchical_cache=bool(body.get("enable_hierarchical_cache")),
        write_policy=_token(body, "hicache_write_policy"),
        page_size=_int(pick("page_size"), "page_size") or 1,
        chunked_prefill_size=_int(pick("chunked_prefill_size"), "chunked_prefill_size"),
        max_total_num_tokens=_int(pick("max_total_num_tokens"), "max_total_num_tokens"),
        max_req_input_len=_int(pick("max_req_input_len"), "max_req_input_len"),
        context_length=_int(pick("context_length"), "context_length"),
        speculative_algorithm=_token(body, "speculative_algorithm"),
        hybrid_model=bool(hybrid),
        dp_size=_int(pick("dp_size"), "dp_size") or 1,
        tp_size=_int(pick("tp_size"), "tp_size") or 1,
        enable_cache_report=bool(body.get("enable_cache_report")),
        enable_metrics=bool(body.get("enable_metrics")),
        looks_like_router=False,
    )


def parse_generate(body: Any, latency_s: float) -> GenerateResult:
    """Pure: native /generate JSON -> GenerateResult."""
    if not isinstance(body, dict):
        raise SGLangError(ErrorReason.BAD_RESPONSE, f"/generate returned a JSON {type(body).__name__}, not an object")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise SGLangError(ErrorReason.BAD_RESPONSE, "/generate response lacks meta_info")
    if meta.get("prompt_tokens") is None:
        raise SGLangError(ErrorReason.BAD_RESPONSE, "meta_info lacks prompt_tokens")
    return GenerateResult(
        latency_s=latency_s,
        prompt_tokens=_int(meta.get("prompt_tokens"), "meta_info.prompt_tokens") or 0,
        completion_tokens=_int(meta.get("completion_tokens"), "meta_info.completion_tokens") or 0,
        cached_tokens=_int(meta.get("cached_tokens"), "meta_info.cached_tokens"),
        details=_details(meta.get("cached_tokens_details"), "meta_info.cached_tokens_details"),
        request_id=meta.get("id") if isinstance(meta.get("id"), str) else None,
    )


def parse_completion(body: Any, latency_s: float) -> GenerateResult:
    """Pure: /v1/completions JSON -> GenerateResult (tier details from `sglext`)."""
    if not isinstance(body, dict):
        raise SGLangError(ErrorReason.BAD_RESPONSE, f"/v1/completions returned a JSON {type(body).__name__}")
    usage = body.get("usage")
    if not isinstance(usage, dict) or usage.get("prompt_tokens") is None:
        raise SGLangError(ErrorReason.BAD_RESPONSE, "/v1/completions response lacks usage.prompt_tokens")
    sglext = body.get("sglext")
    details = None
    if sglext is not None:
        if not isinstance(sglext, dict):
            raise SGLangError(ErrorReason.BAD_RESPONSE, "sglext is not an object")
        details = _details(sglext.get("cached_tokens_details"), "sglext.cached_tokens_details")
    ptd = usage.get("prompt_tokens_details")
    cached = None
    if isinstance(ptd, dict) and ptd.get("cached_tokens") is not None:
        cached = _int(ptd.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens")
    elif sglext is not None:
        # SGLang drops prompt_tokens_details when nothing was cached; sglext says it answered.
        cached = details.total if details else 0
    return GenerateResult(
        latency_s=latency_s,
        prompt_tokens=_int(usage.get("prompt_tokens"), "usage.prompt_tokens") or 0,
        completion_tokens=_int(usage.get("completion_tokens"), "usage.completion_tokens") or 0,
        cached_tokens=cached,
        details=details,
        request_id=body.get("id") if isinstance(body.get("id"), str) else None,
    )


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
        start = time.perf_counter()
        resp = await self._request("POST", "/generate", json_body=payload, timeout=self._long(timeout))
        body = self._json(resp, "POST /generate")
        return parse_generate(body, time.perf_counter() - start)

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
        start = time.perf_counter()
        resp = await self._request("POST", "/v1/completions", json_body=payload, timeout=self._long(timeout))
        body = self._json(resp, "POST /v1/completions")
        return parse_completion(body, time.perf_counter() - start)

    # --- plumbing ------------------------------------------------------------------------

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
        code = resp.status_code
        said = _server_message(resp)
        text = f"{where}: HTTP {code}" + (f": {said}" if said else "")
        if code in (401, 403):
            return self._err(ErrorReason.UNAUTHORIZED, text + " (check the API key)", code)
        if code == 429:
            return self._err(ErrorReason.RATE_LIMITED, text, code)
        if 400 <= code < 500:
            if _CONTEXT_TOO_LONG.search(said):
                return self._err(ErrorReason.CONTEXT_TOO_LONG, text, code)
            return self._err(ErrorReason.HTTP_4XX, text, code)
        if code >= 500:
            return self._err(ErrorReason.HTTP_5XX, text, code)
        return self._err(ErrorReason.BAD_RESPONSE, f"{where}: unexpected HTTP {code}", code)

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


def _server_message(resp: Reply) -> str:
    """SGLang's own error text: {"error": {"message"}}, {"message"}, FastAPI's {"detail"}, or the body.

    Never cut here: the caller scrubs the key from the whole text first, then cuts.
    """
    try:
        body = resp.json()
    except (ValueError, UnicodeDecodeError):
        return resp.text
    msg: Any = body
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            msg = err.get("message", err)
        elif err is not None:
            msg = err
        else:
            msg = body.get("message", body.get("detail", body))
    if not isinstance(msg, str):
        msg = json.dumps(msg)
    return msg


def _timeout_kind(exc: httpx.TimeoutException) -> str:
    return {httpx.ReadTimeout: "read", httpx.WriteTimeout: "write", httpx.PoolTimeout: "pool"}.get(type(exc), "request")


def _userinfo(url: str) -> str | None:
    return urlsplit(url).password


def _int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        # a number is quoted; other JSON is not (a string could be any length, even an echoed key)
        said = f": {value!r}" if isinstance(value, (int, float)) else f" but a JSON {_json_type(value)}"
        raise SGLangError(ErrorReason.BAD_RESPONSE, f"{name} is not an integer{said}")
    return int(value)


def _json_type(value: Any) -> str:
    return {str: "string", list: "array", dict: "object", bool: "boolean"}.get(type(value), type(value).__name__)


def _token(body: dict, key: str) -> str | None:
    """A short name-like string from /server_info; anything else (20 KB, markup, escapes) is UNRECOGNISED."""
    return server_token(_str(body, key))


def _str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise SGLangError(ErrorReason.BAD_RESPONSE, f"server_info.{key} is not a string")
    return value


def _details(value: Any, name: str) -> CachedTokens | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SGLangError(ErrorReason.BAD_RESPONSE, f"{name} is not an object")
    return CachedTokens(
        device=_int(value.get("device"), f"{name}.device") or 0,
        host=_int(value.get("host"), f"{name}.host") or 0,
        storage=_int(value.get("storage"), f"{name}.storage") or 0,
    )
