"""sglang_client: response shapes from real SGLang fixtures, error mapping, secret hygiene, and real
loopback servers (a uvicorn app serving SGLang's answers; raw sockets that stall, cut or garble)."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from hicache_canary.models import CachedTokens, ErrorReason
from hicache_canary.probe.sglang_client import SGLangClient, SGLangError, load_api_key
from hicache_canary.probe.sglang_responses import parse_server_info
from procs import free_port
from fixtures import sglang_json, sglang_text

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-canary-SECRET-4f9a1c"


fixture = sglang_text


fixture_json = sglang_json


GEN = "sglang-0.5.23/generate_response_examples.json"


def mock_client(handler, **kw) -> SGLangClient:
    return SGLangClient("http://sglang.test:30000", transport=httpx.MockTransport(handler), **kw)


def assert_no_secret(exc: BaseException, *secrets: str) -> None:
    for text in (str(exc), repr(exc), exc.args[0] if exc.args else ""):
        for secret in secrets:
            assert secret not in text
    assert "\n" not in str(exc) and len(str(exc)) <= 300


# --- /server_info ---------------------------------------------------------------------------


async def test_server_info_from_sglang_0523_write_back():
    seen = []

    def handler(req: httpx.Request):
        seen.append(req.url.path)
        return httpx.Response(200, json=fixture_json("sglang-0.5.23/server_info_seed.json"))

    async with mock_client(handler) as c:
        facts = await c.server_info()
    assert seen == ["/server_info"]
    assert facts.version == "0.5.23"
    assert facts.enable_hierarchical_cache is True
    assert facts.write_policy == "write_back"
    assert facts.hybrid_model is True
    assert facts.tp_size == 2 and facts.dp_size == 1
    assert facts.max_total_num_tokens == 400000
    assert facts.max_req_input_len == 262135
    assert facts.chunked_prefill_size == 4096
    assert facts.page_size == 1
    assert facts.speculative_algorithm == "DFLASH"
    assert facts.served_model_name == "Qwen3.8-27B-AWQ"
    assert facts.enable_metrics is True and facts.enable_cache_report is False
    assert facts.looks_like_router is False


def test_server_info_write_through_and_live_0517():
    wt = parse_server_info(fixture_json("sglang-0.5.23/server_info_seed_write_through.json"))
    assert wt.write_policy == "write_through" and wt.hybrid_model
    live = parse_server_info(fixture_json("sglang-0.5.17-live/server_info_write_through.json"))
    assert (live.version, live.context_length, live.max_req_input_len, live.max_total_num_tokens) == (
        "0.5.17",
        32768,
        23994,
        24000,
    )
    assert live.chunked_prefill_size == 2048 and live.speculative_algorithm is None and live.hybrid_model


def test_server_info_reads_internal_states_when_top_level_lacks_fields():
    body = fixture_json("sglang-0.5.17-live/server_info_write_through.json")
    del body["uses_mamba_radix_cache"], body["max_req_input_len"]
    body["internal_states"][0].pop("uses_mamba_radix_cache", None)
    body["internal_states"][0]["max_req_input_len"] = 1234
    facts = parse_server_info(body)
    assert facts.hybrid_model is True  # from internal_states[0]._resolved_overrides
    assert facts.max_req_input_len == 1234
    body["internal_states"][0]["_resolved_overrides"] = []
    assert parse_server_info(body).hybrid_model is False


async def test_server_info_falls_back_to_get_server_info_on_404():
    seen = []

    def handler(req: httpx.Request):
        seen.append(req.url.path)
        if req.url.path == "/server_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json=fixture_json("sglang-0.5.17-live/server_info_write_through.json"))

    async with mock_client(handler) as c:
        facts = await c.server_info()
    assert seen == ["/server_info", "/get_server_info"]
    assert facts.version == "0.5.17"


@pytest.mark.parametrize(
    "body",
    [
        {"prefill": [{"url": "http://a"}], "decode": [{"url": "http://b"}]},
        {"status": "ok"},
        [{"model_path": "m"}, {"model_path": "m"}],
    ],
    ids=["pd-router", "no-server-args", "worker-list"],
)
def test_router_answers_are_flagged_not_misread(body):
    assert parse_server_info(body).looks_like_router is True


@pytest.mark.parametrize("field,value", [("page_size", "big"), ("max_total_num_tokens", 1.5), ("tp_size", True)])
def test_server_info_wrong_types_are_bad_response(field, value):
    body = fixture_json("sglang-0.5.23/server_info_seed.json")
    body[field] = value
    with pytest.raises(SGLangError) as ei:
        parse_server_info(body)
    assert ei.value.reason == ErrorReason.BAD_RESPONSE and field in str(ei.value)


async def test_raw_server_info_strips_secrets_everywhere_and_keeps_counts():
    body = fixture_json("sglang-0.5.23/server_info_seed.json")
    body["api_key"] = KEY
    body["admin_api_key"] = "admin-" + KEY
    body["hf_token"] = "hf_abc"
    body["internal_states"][0]["api_key"] = KEY
    body["launch_command"] = f"python -m sglang.launch_server --api-key {KEY}"

    async with mock_client(lambda r: httpx.Response(200, json=body), api_key=KEY) as c:
        raw = await c.raw_server_info()
    text = json.dumps(raw)
    assert KEY not in text and "hf_abc" not in text
    assert "admin_api_key" not in raw and "api_key" not in raw["internal_states"][0]
    assert raw["max_total_num_tokens"] == 400000 and raw["hicache_write_policy"] == "write_back"
    assert raw["launch_command"] == "<redacted>"


# --- /generate and /v1/completions ---------------------------------------------------------


async def test_generate_sends_sglang_request_and_parses_meta_info():
    requests = []

    def handler(req: httpx.Request):
        requests.append(req)
        return httpx.Response(200, json=fixture_json(GEN)["generate_response"])

    async with mock_client(handler, api_key=KEY) as c:
        res = await c.generate([5, 6, 7], max_new_tokens=1)
        await c.generate([1], routed_dp_rank=1)
    first, second = (json.loads(r.content) for r in requests)
    assert requests[0].url.path == "/generate" and requests[0].method == "POST"
    assert requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert first == {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    assert second["routed_dp_rank"] == 1
    assert res.prompt_tokens == 41230 and res.completion_tokens == 256
    assert res.cached_tokens == 41216
    assert res.details == CachedTokens(device=256, host=40960, storage=0)
    assert res.request_id == "8f1c2a7b9d3e4f5a8b6c7d0e1f2a3b4c"
    assert res.latency_s > 0


async def test_generate_measures_latency_client_side():
    async def handler(req):
        await asyncio.sleep(0.2)
        return httpx.Response(200, json=fixture_json(GEN)["generate_response"])

    async with mock_client(handler) as c:
        res = await c.generate([1])
    assert 0.2 <= res.latency_s < 2


async def test_generate_without_details_gives_none():
    body = fixture_json(GEN)["generate_response"]
    del body["meta_info"]["cached_tokens_details"], body["meta_info"]["cached_tokens"]
    async with mock_client(lambda r: httpx.Response(200, json=body)) as c:
        res = await c.generate([1])
    assert res.details is None and res.cached_tokens is None


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda b: b["meta_info"].pop("prompt_tokens"), "meta_info lacks prompt_tokens"),
        (lambda b: b.pop("meta_info"), "lacks meta_info"),
        (lambda b: b["meta_info"].update(cached_tokens="many"), "meta_info.cached_tokens is not an integer"),
        (lambda b: b["meta_info"].update(cached_tokens_details=[1, 2]), "cached_tokens_details is not an object"),
    ],
    ids=["no-prompt-tokens", "no-meta-info", "cached-not-int", "details-not-object"],
)
async def test_generate_bad_shapes_are_bad_response(mutate, expect):
    body = fixture_json(GEN)["generate_response"]
    mutate(body)
    async with mock_client(lambda r: httpx.Response(200, json=body)) as c:
        with pytest.raises(SGLangError) as ei:
            await c.generate([1])
    assert ei.value.reason == ErrorReason.BAD_RESPONSE
    assert expect in str(ei.value)


async def test_generate_non_json_body_is_bad_response():
    async with mock_client(lambda r: httpx.Response(200, text="<html>oops</html>")) as c:
        with pytest.raises(SGLangError) as ei:
            await c.generate([1])
    assert ei.value.reason == ErrorReason.BAD_RESPONSE and "not JSON" in str(ei.value)


@pytest.mark.parametrize("variant", ["v1_completions_response", "v1_completions_response_exclude_none"])
async def test_completion_reads_usage_and_sglext(variant):
    requests = []

    def handler(req):
        requests.append(json.loads(req.content))
        return httpx.Response(200, json=fixture_json(GEN)[variant])

    async with mock_client(handler) as c:
        res = await c.completion("hello", model="Qwen3.8-27B-AWQ")
    assert requests[0]["return_cached_tokens_details"] is True
    assert requests[0]["max_tokens"] == 1 and requests[0]["model"] == "Qwen3.8-27B-AWQ"
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (41230, 256, 41216)
    assert res.details == CachedTokens(device=256, host=40960)


async def test_completion_cached_tokens_absent_unless_sglext_answers():
    body = fixture_json(GEN)["v1_completions_response_exclude_none"]
    del body["usage"]["prompt_tokens_details"]
    async with mock_client(lambda r: httpx.Response(200, json=body)) as c:
        res = await c.completion("x")
    assert res.cached_tokens == 41216  # from sglext's breakdown
    del body["sglext"]
    async with mock_client(lambda r: httpx.Response(200, json=body)) as c:
        res = await c.completion("x")
    assert res.cached_tokens is None and res.details is None


# --- /metrics and /health -------------------------------------------------------------------


async def test_metrics_parses_sglang_exposition():
    text = fixture("sglang-0.5.23/metrics_write_back_healthy.txt")
    async with mock_client(lambda r: httpx.Response(200, text=text)) as c:
        snap = await c.metrics()
    assert snap.load_back_tokens == {"kv": 40960, "mamba": 3}
    assert snap.cached_tokens["host"] == 40960
    assert snap.taken_at > time.time() - 60


async def test_metrics_404_says_metrics_are_disabled():
    async with mock_client(lambda r: httpx.Response(404, json={"detail": "Not Found"})) as c:
        with pytest.raises(SGLangError) as ei:
            await c.metrics()
    assert ei.value.reason == ErrorReason.BAD_RESPONSE and ei.value.status == 404
    assert "metrics disabled (--enable-metrics)" in str(ei.value)


@pytest.mark.parametrize("status,expect", [(200, True), (503, False), (500, False)])
async def test_health(status, expect):
    async with mock_client(lambda r: httpx.Response(status, text="")) as c:
        assert await c.health() is expect


# --- error mapping and secret hygiene ------------------------------------------------------

CTX_MSG = "The input (300000 tokens) is longer than the model's context length (262144 tokens)."
TRUNC_MSG = (
    "Input length (300000 tokens) exceeds the maximum allowed length (262135 tokens). "
    "Use a shorter input or enable --allow-auto-truncate."
)


@pytest.mark.parametrize(
    "status,body,reason,fragment",
    [
        (401, {"error": "Unauthorized"}, ErrorReason.UNAUTHORIZED, "HTTP 401"),
        (403, {"detail": "Forbidden"}, ErrorReason.UNAUTHORIZED, "check the API key"),
        (429, {"error": {"message": "slow down"}}, ErrorReason.RATE_LIMITED, "slow down"),
        (400, {"error": {"message": "input_ids must be ints"}}, ErrorReason.HTTP_4XX, "input_ids must be ints"),
        (400, {"error": {"message": CTX_MSG}}, ErrorReason.CONTEXT_TOO_LONG, "longer than the model's context"),
        (400, {"object": "error", "message": TRUNC_MSG, "code": 400}, ErrorReason.CONTEXT_TOO_LONG, "Input length"),
        (404, {"detail": "Not Found"}, ErrorReason.HTTP_4XX, "HTTP 404"),
        (500, "Internal Server Error", ErrorReason.HTTP_5XX, "Internal Server Error"),
        (503, {"error": "x" * 5000}, ErrorReason.HTTP_5XX, "xxx..."),
    ],
    ids=["401", "403", "429", "400", "400-context", "400-max-input", "404", "500", "503-long"],
)
async def test_status_mapping(status, body, reason, fragment):
    def handler(req):
        return httpx.Response(status, json=body) if isinstance(body, dict) else httpx.Response(status, text=body)

    async with mock_client(handler, api_key=KEY) as c:
        with pytest.raises(SGLangError) as ei:
            await c.generate([1, 2])
    assert ei.value.reason == reason and ei.value.status == status
    assert fragment in str(ei.value)
    assert_no_secret(ei.value, KEY)


async def test_server_echoing_the_key_never_reaches_error_text():
    def handler(req):
        return httpx.Response(401, json={"error": f"bad token {req.headers['authorization']}"})

    c = mock_client(handler, api_key=KEY)
    async with c:
        for call in (c.generate([1]), c.completion("x"), c.server_info(), c.raw_server_info(), c.metrics()):
            with pytest.raises(SGLangError) as ei:
                await call
            assert ei.value.reason == ErrorReason.UNAUTHORIZED
            assert_no_secret(ei.value, KEY)
    assert KEY not in repr(c) and "api_key=set" in repr(c)


async def test_password_in_url_is_not_shown():
    c = SGLangClient("http://user:pw-SECRET@127.0.0.1:1", connect_timeout=1)
    with pytest.raises(SGLangError) as ei:
        await c.generate([1])
    await c.aclose()
    assert ei.value.reason == ErrorReason.CONNECT_FAILED
    assert_no_secret(ei.value, "pw-SECRET")
    assert "pw-SECRET" not in repr(c)


def test_load_api_key(tmp_path, monkeypatch):
    keyfile = tmp_path / "key"
    keyfile.write_text(f"  {KEY}\n")
    monkeypatch.delenv("HC_TEST_KEY", raising=False)
    assert load_api_key(None, None) is None
    assert load_api_key("HC_TEST_KEY", None) is None
    assert load_api_key("HC_TEST_KEY", str(keyfile)) == KEY  # unset env falls through to the file
    monkeypatch.setenv("HC_TEST_KEY", "from-env")
    assert load_api_key("HC_TEST_KEY", str(keyfile)) == "from-env"

    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"cannot read API key file {missing}"):
        load_api_key(None, str(missing))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_api_key(None, str(tmp_path / "empty"))
    bad = tmp_path / "two"
    bad.write_text(f"{KEY} second-{KEY}")
    with pytest.raises(ValueError) as ei:
        load_api_key(None, str(bad))
    assert str(bad) in str(ei.value) and KEY not in str(ei.value)
    unreadable = tmp_path / "bin"
    unreadable.write_bytes(b"\xff\xfe" + KEY.encode())
    with pytest.raises(ValueError) as ei:
        load_api_key(None, str(unreadable))
    assert KEY not in str(ei.value)


# --- real servers on 127.0.0.1 ----------------------------------------------------------------


def canned_sglang_app() -> FastAPI:
    """Answers like SGLang with its real payloads, and enforces the API key like SGLang does
    (everything but /health and /metrics needs it)."""
    app = FastAPI()
    gen = fixture_json(GEN)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if request.url.path not in ("/health", "/metrics") and request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(fixture("sglang-0.5.23/metrics_write_through_silent.txt"))

    @app.get("/server_info")
    async def server_info():
        return fixture_json("sglang-0.5.23/server_info_seed_write_through.json")

    @app.post("/generate")
    async def generate(request: Request):
        payload = await request.json()
        body = copy.deepcopy(gen["generate_response"])
        body["meta_info"]["prompt_tokens"] = len(payload["input_ids"])
        body["meta_info"]["completion_tokens"] = payload["sampling_params"]["max_new_tokens"]
        if len(payload["input_ids"]) > 1000:
            return JSONResponse({"error": {"message": CTX_MSG}}, status_code=400)
        return body

    @app.post("/v1/completions")
    async def completions():
        return gen["v1_completions_response"]

    return app


@pytest.fixture
def canned_server():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(canned_sglang_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("canned SGLang server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


async def test_real_http_round_trip(canned_server):
    async with SGLangClient(canned_server, api_key=KEY) as c:
        assert await c.health() is True
        facts = await c.server_info()
        snap = await c.metrics()
        res = await c.generate(list(range(100)))
        comp = await c.completion("hi")
        with pytest.raises(SGLangError) as too_long:
            await c.generate(list(range(2000)))
    assert facts.write_policy == "write_through" and facts.hybrid_model
    assert snap.host_used_tokens == 592658 and snap.backup_tokens["kv"] == 600112
    assert res.prompt_tokens == 100 and res.details.host == 40960
    assert comp.cached_tokens == 41216
    assert too_long.value.reason == ErrorReason.CONTEXT_TOO_LONG
    assert_no_secret(too_long.value, KEY)

    async with SGLangClient(canned_server, api_key="wrong-" + KEY) as c:
        assert await c.health() is True  # /health needs no key
        with pytest.raises(SGLangError) as ei:
            await c.server_info()
    assert ei.value.reason == ErrorReason.UNAUTHORIZED
    assert_no_secret(ei.value, KEY)


async def test_connection_refused_is_connect_failed():
    port = free_port()  # nothing listens here
    async with SGLangClient(f"http://127.0.0.1:{port}", api_key=KEY) as c:
        with pytest.raises(SGLangError) as ei:
            await c.server_info()
        assert await c.health() is False
    assert ei.value.reason == ErrorReason.CONNECT_FAILED and ei.value.status is None
    assert f"127.0.0.1:{port}" in str(ei.value)
    assert_no_secret(ei.value, KEY)


async def _raw_server(behaviour):
    """A TCP server on 127.0.0.1 that reads the request head and then misbehaves."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            await reader.readuntil(b"\r\n\r\n")
            await behaviour(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _stall(writer):
    await asyncio.sleep(5)


async def _cut_body(writer):
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"meta_info\": {")
    await writer.drain()


async def _garbage(writer):
    writer.write(b"\x00\x01 SSH-2.0-OpenSSH_9.6 not http at all\r\n\r\n")
    await writer.drain()


async def _hang_up(writer):
    pass  # close without a byte


@pytest.mark.parametrize(
    "behaviour,reason,fragment",
    [
        (_stall, ErrorReason.TIMEOUT, "read timed out after 0.3s"),
        (_cut_body, ErrorReason.CONNECTION_LOST, "closed the connection mid-answer"),
        (_garbage, ErrorReason.BAD_RESPONSE, "broken HTTP response"),
        (_hang_up, ErrorReason.CONNECTION_LOST, "closed the connection before answering"),
    ],
    ids=["stall", "truncated-body", "garbage", "hang-up"],
)
async def test_misbehaving_real_server(behaviour, reason, fragment):
    server, url = await _raw_server(behaviour)
    try:
        async with SGLangClient(url, api_key=KEY, small_timeout=0.3) as c:
            start = time.monotonic()
            with pytest.raises(SGLangError) as ei:
                await c.generate([1, 2, 3], timeout=0.3)
            assert time.monotonic() - start < 3
    finally:
        server.close()
    assert ei.value.reason == reason, str(ei.value)
    assert fragment in str(ei.value)
    assert_no_secret(ei.value, KEY)
