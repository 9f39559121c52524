"""Small misbehaving servers on 127.0.0.1 for the fault and security tests.

`FaultProxy` sits in front of a real simulator and misbehaves on cue in one phase of a probe: it
follows the canary's request sequence the way a packet capture would (a `/server_info` starts a
probe, the first `/generate` is R, R again is rehost then again, anything else is pressure) and
then stalls, hangs up, answers 5xx/429, garbles JSON, strips `meta_info` fields, corrupts or thins
`/metrics`, slows down, or restarts the simulator behind it (SGLang restarting mid-probe). Faults
are raw bytes on a raw socket, so the client sees exactly what a broken server would send.

`Recorder` is a listener that must never be contacted: it records whatever reaches it.

Both run their own event loop in a daemon thread, so async tests (and other processes, such as
the exporter) can talk to them over real HTTP while the test drives them.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

import httpx
from hicache_canary.probe.canary import WARMUP_TOKENS

PHASES = ("preflight", "metrics", "cold", "pressure", "rehost", "again")
KINDS = (
    "stall",  # never answer (until the client gives up)
    "hangup",  # close the connection without a byte (the server died)
    "http_500",
    "http_429",
    "garbage_json",  # 200 with a body that is not JSON
    "truncated",  # 200 whose body stops half way (a server killed while writing)
    "no_cached_fields",  # meta_info without cached_tokens / cached_tokens_details
    "no_prompt_tokens",  # meta_info without prompt_tokens
    "metrics_garbage",  # /metrics with unparsable lines mixed in
    "metrics_no_sglang",  # /metrics with every sglang: family gone
    "restart",  # restart the simulator once (caches and counters reset), then answer
    "restart_after",  # answer, but restart the simulator before the reply reaches the client (lost just after)
    "slow",  # answer correctly, late
    "echo_key_error",  # HTTP 400 whose JSON message echoes the Authorization header across the 200-character cut
    "echo_key_garbage",  # 200 whose non-JSON body echoes the Authorization header across the 80-character cut
    "endless_body",  # 200 that never stops sending (a broken proxy, or a hostile server)
    "hostile_server_info",  # /server_info whose strings are 20 KB, label syntax and terminal escapes
)

# Where an echoed key starts in the message: it straddles the client's old cut (200 and 80 characters).
ECHO_AT = {"echo_key_error": 185, "echo_key_garbage": 70}
# What a hostile /server_info says instead of the simulator's own strings.
HOSTILE_SERVER_INFO = {
    "version": "0.5.23" + "9" * 20_000,
    "hicache_write_policy": 'write_through"} evil{x="',
    "speculative_algorithm": "\x1b[31mEAGLE\x1b[0m",
}


@dataclass
class Seen:
    method: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class _LoopThread:
    """An asyncio loop in a daemon thread serving one raw TCP handler on 127.0.0.1."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def boot() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            await self._setup()
            self._ready.set()

        self.loop.run_until_complete(boot())
        self.loop.run_forever()

    async def _setup(self) -> None:
        pass

    async def _teardown(self) -> None:
        pass

    def start(self) -> _LoopThread:
        self.thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{type(self).__name__} did not start")
        return self

    def stop(self) -> None:
        async def down() -> None:
            assert self._server is not None
            self._server.close()
            await self._teardown()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req = await _read_request(reader)
            if req is not None:
                await self._serve(req, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _serve(self, req: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


async def _read_request(reader: asyncio.StreamReader) -> Seen | None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
    return Seen(method, path, body, headers)


def _response(status: int, body: bytes, ctype: str = "application/json", *, length: int | None = None) -> bytes:
    reason = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}.get(status, "X")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Recorder(_LoopThread):
    """A listener nobody should call: records every request and answers 404."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Seen] = []

    async def _serve(self, req: Seen, reader, writer) -> None:
        self.requests.append(req)
        writer.write(_response(404, b'{"detail":"Not Found"}'))
        await writer.drain()


class FaultProxy(_LoopThread):
    """A proxy to `upstream` (a simulator) that misbehaves in one phase: `set(phase, kind)`."""

    def __init__(self, upstream: str, *, stall_s: float = 10.0, slow_s: float = 0.3):
        super().__init__()
        self.upstream = upstream.rstrip("/")
        self.stall_s, self.slow_s = stall_s, slow_s
        self.fault: tuple[str, str] | None = None
        self.requests: list[Seen] = []
        self.phases: list[str] = []  # the phase of every request, in order (for the tests' own checks)
        self.triggered = 0  # how many requests the fault hit
        self._r: list[int] | None = None
        self._r_sends = 0
        self._http: httpx.AsyncClient | None = None

    async def _setup(self) -> None:
        self._http = httpx.AsyncClient(base_url=self.upstream, timeout=60)

    async def _teardown(self) -> None:
        assert self._http is not None
        await self._http.aclose()

    def set(self, phase: str, kind: str) -> None:
        if phase not in PHASES or kind not in KINDS:
            raise ValueError(f"unknown fault {phase}/{kind}")
        self.fault, self.triggered = (phase, kind), 0

    def clear(self) -> None:
        self.fault = None

    def _phase(self, req: Seen) -> str:
        path = req.path.split("?", 1)[0]
        if path in ("/server_info", "/get_server_info"):
            self._r, self._r_sends = None, 0  # every probe starts by reading the server
            return "preflight"
        if path == "/metrics":
            return "metrics"
        if path == "/generate":
            try:
                ids = json.loads(req.body).get("input_ids")
            except ValueError:
                return "other"
            if self._r is None:
                if ids is not None and len(ids) <= WARMUP_TOKENS:
                    return "warmup"  # a fresh server's first request, before R
                self._r, self._r_sends = ids, 1
                return "cold"
            if ids == self._r:
                self._r_sends += 1
                return "rehost" if self._r_sends == 2 else "again"
            return "pressure"
        return "other"

    async def _serve(self, req: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests.append(req)
        phase = self._phase(req)
        self.phases.append(phase)
        kind = self.fault[1] if self.fault and self.fault[0] == phase else None
        if kind in ("restart", "restart_after") and self.triggered:
            kind = None  # one restart per fault, not one per pressure chunk
        if kind is not None:
            self.triggered += 1
        if kind == "stall":
            # hold the connection until the client gives up (EOF) or stall_s passes
            try:
                await asyncio.wait_for(reader.read(1), self.stall_s)
            except TimeoutError:
                pass
            return
        if kind == "hangup":
            return
        if kind == "http_500":
            writer.write(_response(500, b'{"error": {"message": "Internal Server Error"}}'))
            return await writer.drain()
        if kind == "http_429":
            writer.write(_response(429, b'{"error": {"message": "Too many requests, retry later"}}'))
            return await writer.drain()
        if kind == "garbage_json":
            writer.write(_response(200, b"<html><body>502 Bad Gateway</body></html>"))
            return await writer.drain()
        if kind in ECHO_AT:
            key = req.headers.get("authorization", "").removeprefix("Bearer ")
            said = "x" * ECHO_AT[kind] + key + " is not a valid API key for this server"
            if kind == "echo_key_error":
                writer.write(_response(400, json.dumps({"error": {"message": said}}).encode()))
            else:
                writer.write(_response(200, said.encode(), "text/plain"))
            return await writer.drain()
        if kind == "endless_body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
            chunk = b"sglang:junk 1\n" * 65536
            while True:  # until the client hangs up (ConnectionError ends the handler)
                writer.write(chunk)
                await writer.drain()
        if kind == "slow":
            await asyncio.sleep(self.slow_s)
        if kind == "restart":
            await self._restart_upstream(req)
        status, ctype, body = await self._forward(req)
        if kind == "restart_after":
            await self._restart_upstream(req)
        if kind == "truncated":
            writer.write(_response(status, body[: len(body) // 2], ctype, length=len(body)))
            return await writer.drain()
        if kind == "hostile_server_info" and status == 200:
            body = json.dumps({**json.loads(body), **HOSTILE_SERVER_INFO}).encode()
        if kind in ("no_cached_fields", "no_prompt_tokens") and status == 200:
            doc = json.loads(body)
            meta = doc.get("meta_info", {})
            drop = ("cached_tokens", "cached_tokens_details") if kind == "no_cached_fields" else ("prompt_tokens",)
            for key in drop:
                meta.pop(key, None)
            body = json.dumps(doc).encode()
        if kind == "metrics_garbage" and status == 200:
            lines = body.decode().splitlines()
            junk = ["!!! garbage \xff\xfe", 'sglang:num_queue_reqs{tp_rank="0"', "sglang:prompt_tokens_total not-a-number", "}{"]
            body = "\n".join(line for pair in zip(lines, junk * len(lines)) for line in pair).encode() + b"\n"
        if kind == "metrics_no_sglang" and status == 200:
            body = b"".join(line + b"\n" for line in body.splitlines() if b"sglang:" not in line)
        writer.write(_response(status, body, ctype))
        await writer.drain()

    async def _forward(self, req: Seen) -> tuple[int, str, bytes]:
        assert self._http is not None
        headers = {k: v for k, v in req.headers.items() if k in ("authorization", "content-type", "accept")}
        resp = await self._http.request(req.method, req.path, content=req.body, headers=headers)
        return resp.status_code, resp.headers.get("content-type", "application/json"), resp.content

    async def _restart_upstream(self, req: Seen) -> None:
        assert self._http is not None
        headers = {k: v for k, v in req.headers.items() if k == "authorization"}
        resp = await self._http.post("/_sim/restart", json={"args": []}, headers=headers)
        resp.raise_for_status()
