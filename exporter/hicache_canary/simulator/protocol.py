"""SGLang's request validation and response shapes, as pure functions (no IO).

Shapes follow shared/fixtures/sglang-0.5.23/generate_response_examples.json (meta_info key order)
and sglang-facts section 2. Bad input raises `BadRequest` with SGLang's message; the app turns it
into SGLang's 400 body: `{"error": {"message": ...}}` on native endpoints and the OpenAI error object
on `/v1/*`.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass

VOCAB = 151936  # Qwen-family vocabulary size; ids of the toy tokenizer stay below it


class BadRequest(ValueError):
    pass


def json_object(raw: bytes) -> dict:
    """A request body as the JSON object every endpoint expects, or BadRequest saying what it is not."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def tokenize(text: str) -> tuple[int, ...]:
    """Deterministic toy tokenizer: one id per whitespace word, so equal texts share a prefix."""
    return tuple(zlib.crc32(w.encode()) % VOCAB for w in text.split())


def detokenize(ids: list[int]) -> str:
    return "".join(f" w{i}" for i in ids)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int


def parse_sampling(params: object, default_max_new: int = 128) -> Sampling:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object.")
    max_new = params.get("max_new_tokens", default_max_new)
    if max_new is None:
        max_new = default_max_new
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
    temperature = params.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise BadRequest(f"temperature must be non-negative, got {temperature}.")
    top_p = params.get("top_p", 1.0)
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    top_k = params.get("top_k", -1)
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    return Sampling(max_new)


def _ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadRequest("input_ids must be a list of integers or a list of lists of integers.")
    if any(i < 0 or i >= VOCAB for i in value):
        raise BadRequest(f"input_ids contain a token id outside the vocabulary [0, {VOCAB}).")
    return tuple(value)


def parse_prompts(text: object, input_ids: object) -> tuple[list[tuple[int, ...]], bool]:
    """(token tuples, is_batch) from /generate's text or input_ids (exactly one of them)."""
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            return [tokenize(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenize(t) for t in text], True
        raise BadRequest("text must be a string or a list of strings.")
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return [_ids(x) for x in input_ids], True
    return [_ids(input_ids)], False


def check_length(tokens: tuple, max_new: int, max_req_input_len: int, context_len: int) -> None:
    n = len(tokens)
    if n == 0:
        raise BadRequest("The input is empty: send at least one token.")
    if n > max_req_input_len:
        raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({max_req_input_len} tokens).")
    if n + max_new > context_len:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {n + max_new} tokens: {n} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.")


def check_dp_rank(body: dict, dp_size: int) -> None:
    for key in ("routed_dp_rank", "data_parallel_rank"):
        rank = body.get(key)
        if rank is None:
            continue
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dp_size:
            raise BadRequest(f"{key} {rank} is out of range [0, {dp_size}).")


def cached_details(device: int, host: int) -> dict | None:
    """SGLang's get_cached_tokens_details: None when nothing was cached."""
    if device + host == 0:
        return None
    return {"device": device, "host": host}


def generate_response(rid: str, output_ids: list[int], prompt_tokens: int, device: int, host: int,
                      e2e_s: float) -> dict:
    meta: dict = {
        "id": rid,
        "finish_reason": {"type": "length", "length": len(output_ids)},
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": device + host,
    }
    details = cached_details(device, host)
    if details is not None:
        meta["cached_tokens_details"] = details
    meta["e2e_latency"] = e2e_s
    return {"text": detokenize(output_ids), "output_ids": output_ids, "meta_info": meta}


def completion_response(rid: str, model: str, output_ids: list[int], prompt_tokens: int, device: int, host: int,
                        cache_report: bool, want_details: bool) -> dict:
    """`/v1/completions` as SGLang's pydantic models serialise it with exclude_none."""
    usage: dict = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(output_ids),
                   "completion_tokens": len(output_ids)}
    if cache_report and device + host > 0:
        usage["prompt_tokens_details"] = {"cached_tokens": device + host}
    usage["reasoning_tokens"] = 0
    body: dict = {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": detokenize(output_ids), "finish_reason": "length"}],
        "usage": usage,
        "metadata": {"weight_version": "default"},
    }
    details = cached_details(device, host)
    if want_details and details is not None:
        body["sglext"] = {"cached_tokens_details": details}
    return body


def openai_prompts(prompt: object) -> list[tuple[int, ...]]:
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenize(p) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [_ids(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [_ids(p) for p in prompt]
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids.")


def native_error(message: str) -> dict:
    return {"error": {"message": message}}


def openai_error(message: str, code: int = 400, kind: str = "BadRequestError") -> dict:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}
