"""Pure: SGLang's response bodies -> typed results and error reasons (no IO, no clock).

/server_info -> ServerFacts, native /generate -> GenerateResult (tier details from
`meta_info.cached_tokens_details`), /v1/completions -> GenerateResult (tier details from `sglext`),
an error body -> SGLang's own message, and a /server_info copy without credentials. Wrong types raise
SGLangError(BAD_RESPONSE) naming the field; the client (sglang_client.py) does the HTTP around them.

Strings that end up in labels or on a terminal (version, write policy, speculative algorithm) are
kept only when they look like one (shown.server_token), else they read `unrecognised`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hicache_canary.models import CachedTokens, ErrorReason, GenerateResult, ServerFacts
from hicache_canary.shown import server_token
from hicache_canary.probe.sglang_errors import SGLangError

# Keys of /server_info that may hold credentials (SGLang returns admin_api_key unredacted).
_SECRET_PART = re.compile(r"(^|_)(key|secret|password|passwd|token|credentials?|auth|authorization)($|_)", re.I)
_CONTEXT_TOO_LONG = re.compile(
    r"longer than the model's context length|exceeds the maximum allowed length|context_length_exceeded"
    r"|maximum context length",
    re.IGNORECASE,
)
_ROUTER_KEYS = ("prefill", "decode", "workers", "worker_urls", "prefill_urls", "decode_urls")


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


def status_failure(where: str, code: int, content: bytes, text: str) -> tuple[ErrorReason, str]:
    """Pure: a non-2xx answer -> (reason, message quoting SGLang's own text). The caller scrubs and cuts."""
    said = server_message(content, text)
    said_text = f"{where}: HTTP {code}" + (f": {said}" if said else "")
    if code in (401, 403):
        return ErrorReason.UNAUTHORIZED, said_text + " (check the API key)"
    if code == 429:
        return ErrorReason.RATE_LIMITED, said_text
    if 400 <= code < 500:
        if _CONTEXT_TOO_LONG.search(said):
            return ErrorReason.CONTEXT_TOO_LONG, said_text
        return ErrorReason.HTTP_4XX, said_text
    if code >= 500:
        return ErrorReason.HTTP_5XX, said_text
    return ErrorReason.BAD_RESPONSE, f"{where}: unexpected HTTP {code}"


def server_message(content: bytes, text: str) -> str:
    """SGLang's own error text: {"error": {"message"}}, {"message"}, FastAPI's {"detail"}, or the body.

    Never cut here: the caller scrubs the key from the whole text first, then cuts.
    """
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return text
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
