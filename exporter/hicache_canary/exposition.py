"""/metrics as pre-serialised bytes: a scrape is a bytes copy, whatever the number of targets.

Rendering through prometheus_client costs ~17 us per sample, ~2 ms per target (about 117 samples
each): at 200 targets a full render is ~400 ms of the serving loop, and gzip at level 9 another
50 ms. So each target's samples are rendered once per snapshot of that target (the scheduler
swaps a target's snapshot only when something about it changed), family by family, with
prometheus_client's own encoders; a body is the family headers with every target's pre-rendered
lines spliced in, gzipped (level 1) on a worker thread, where zlib runs without the interpreter
lock.

A scrape serves the newest body at once. When state has changed since that body was built, a small
exposition (a few targets) is rebuilt on the spot, so it is always fresh; a large one is rebuilt by
a background task in slices of one target, so no scrape ever waits for it, and a scrape may lag a
state change by one rebuild (tens of milliseconds; Prometheus scrapes every 15 s or so).
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from .collector import CanaryCollector
from .scheduler import TargetSnapshot

log = logging.getLogger("hicache_canary.exposition")
INLINE_MAX_BYTES = 256 * 1024  # up to ~20 targets: rebuilt inside the scrape, so always fresh
INLINE_MAX_TARGETS = 20  # more than this and even the first body is built in slices
GZIP_LEVEL = 1  # 2 MB in ~3 ms (level 9: ~55 ms) for 20% more bytes
# What Prometheus 2.x and 3.x send first; warm() builds that format and plain text at startup.
PROMETHEUS_ACCEPT = b"application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
REBUILD_GAP_S = 0.05  # at most ~20 background rebuilds a second, however fast state changes


class _Families:
    """A registry-like object: what prometheus_client's encoders take."""

    def __init__(self, fams: Iterable[Metric]):
        self._fams = fams

    def collect(self) -> Iterable[Metric]:
        return iter(self._fams)


def split_families(text: str) -> tuple[list[str], list[str]]:
    """An encoder's output -> (each family's header lines, each family's sample lines)."""
    heads: list[str] = []
    samples: list[list[str]] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("# HELP "):
            heads.append(line)
            samples.append([])
        elif line.startswith("# EOF"):
            continue
        elif line.startswith("#"):
            heads[-1] += line
        else:
            samples[-1].append(line)
    return heads, ["".join(s) for s in samples]


@dataclass(frozen=True)
class Body:
    version: object  # the snapshot mapping it was built from (identity is the key)
    raw: bytes
    gz: bytes


class Format:
    """One exposition format (text 0.0.4, OpenMetrics): per-target fragments and the newest body."""

    def __init__(self, encoder: Callable[[Any], bytes], content_type: str, collector: CanaryCollector):
        self.encoder = encoder
        self.content_type = content_type
        self.collector = collector
        text = encoder(_Families(collector.global_families())).decode()
        self.heads, self.globals = split_families(text)
        self.trailer = "# EOF\n" if text.rstrip().endswith("# EOF") else ""
        self.frags: dict[str, tuple[TargetSnapshot, list[str]]] = {}
        self.body: Body | None = None
        self.wake = asyncio.Event()
        self.first = asyncio.Event()  # set once a body exists
        self.task: asyncio.Task[None] | None = None

    def stale(self, snaps: Mapping[str, TargetSnapshot]) -> list[str]:
        return [n for n, s in snaps.items() if (f := self.frags.get(n)) is None or f[0] is not s]

    def render(self, name: str, s: TargetSnapshot) -> None:
        text = self.encoder(_Families(self.collector.target_families(name, s))).decode()
        heads, samples = split_families(text)
        self.frags[name] = (s, samples)

    def assemble(self, snaps: Mapping[str, TargetSnapshot]) -> bytes:
        for gone in set(self.frags) - set(snaps):
            del self.frags[gone]
        names = sorted(snaps)
        parts: list[str] = []
        for i, head in enumerate(self.heads):
            parts.append(head)
            parts.extend(self.frags[n][1][i] for n in names)
            parts.append(self.globals[i])
        parts.append(self.trailer)
        return "".join(parts).encode()

    def build_inline(self, snaps: Mapping[str, TargetSnapshot]) -> Body:
        for name in self.stale(snaps):
            self.render(name, snaps[name])
        raw = self.assemble(snaps)
        self.body = Body(snaps, raw, gzip.compress(raw, GZIP_LEVEL))
        self.first.set()
        return self.body

    async def build_in_slices(self, snaps: Mapping[str, TargetSnapshot]) -> None:
        for name in self.stale(snaps):
            self.render(name, snaps[name])
            await asyncio.sleep(0)  # one target at a time: a scrape waits at most one target's render
        raw = self.assemble(snaps)
        gz = await asyncio.to_thread(gzip.compress, raw, GZIP_LEVEL)
        self.body = Body(snaps, raw, gz)


class Exposition:
    """The /metrics ASGI endpoint. Requests with a query string (`name[]=`) go to `fallback`."""

    def __init__(self, snapshots: Callable[[], Mapping[str, TargetSnapshot]], fallback: Callable[..., Any],
                 collector: CanaryCollector | None = None):
        self.snapshots = snapshots
        self.fallback = fallback
        self.collector = collector or CanaryCollector(snapshots)
        self._formats: dict[str, Format] = {}  # by content type
        self._by_accept: dict[bytes, Format] = {}

    def format_for(self, accept: bytes) -> Format:
        fmt = self._by_accept.get(accept)
        if fmt is None:
            encoder, content_type = choose_encoder(accept.decode("latin-1"))
            fmt = self._formats.get(content_type) or Format(encoder, content_type, self.collector)
            self._formats[content_type] = fmt
            if len(self._by_accept) < 64:  # Accept headers come from a handful of scrapers
                self._by_accept[accept] = fmt
        return fmt

    async def body(self, fmt: Format) -> Body:
        snaps = self.snapshots()
        body = fmt.body
        if body is not None and body.version is snaps:
            return body
        if body is None and len(snaps) > INLINE_MAX_TARGETS:
            # The very first body of a large exposition: built in slices like any rebuild, and
            # waited for (once per format; warm() builds Prometheus' format at startup).
            self._kick(fmt)
            await fmt.first.wait()
            assert fmt.body is not None
            return fmt.body
        if body is None or len(body.raw) <= INLINE_MAX_BYTES:
            return fmt.build_inline(snaps)
        self._kick(fmt)
        return body

    def _kick(self, fmt: Format) -> None:
        if fmt.task is None or fmt.task.done():
            fmt.task = asyncio.get_running_loop().create_task(self._rebuild(fmt), name=f"metrics-rebuild:{fmt.content_type}")
        fmt.wake.set()

    def warm(self, *accepts: bytes) -> None:
        """Build these formats' first bodies now, in the background (called at startup)."""
        for accept in accepts:
            self._kick(self.format_for(accept))

    async def _rebuild(self, fmt: Format) -> None:
        """Keeps `fmt.body` following the snapshots while scrapes ask for it."""
        while True:
            await fmt.wake.wait()
            fmt.wake.clear()
            snaps = self.snapshots()
            if fmt.body is not None and fmt.body.version is snaps:
                continue
            try:
                await fmt.build_in_slices(snaps)
            except Exception as exc:  # a rendering bug must not end /metrics: keep the last body
                log.error("rebuilding /metrics failed: %s", type(exc).__name__)
            if fmt.body is not None:
                fmt.first.set()
            await asyncio.sleep(REBUILD_GAP_S)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("query_string"):
            await self.fallback(scope, receive, send)
            return
        accept = b""
        gz = False
        for k, v in scope.get("headers", []):
            if k == b"accept":
                accept = v
            elif k == b"accept-encoding" and b"gzip" in v:
                gz = True
        fmt = self.format_for(accept)
        body = await self.body(fmt)
        data = body.gz if gz else body.raw
        headers = [(b"content-type", fmt.content_type.encode()), (b"content-length", str(len(data)).encode())]
        if gz:
            headers.append((b"content-encoding", b"gzip"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else data})

    async def aclose(self) -> None:
        for fmt in self._formats.values():
            if fmt.task is not None:
                fmt.task.cancel()
