"""/metrics as pre-serialised bytes: a scrape is a bytes copy, whatever the number of targets.

Rendering through prometheus_client costs ~17 us per sample, ~2 ms per target (about 117 samples
each): at 200 targets a full render is ~400 ms of the serving loop, and gzip at level 9 another
50 ms. So each target's sample lines are written once per snapshot of that target (the scheduler
swaps a target's snapshot only when something about it changed), family by family; a body is the
family headers (prometheus_client's own, per format) with every target's lines spliced in,
gzipped (level 1) on a worker thread, where zlib runs without the interpreter lock. The sample
lines are the same in the text format and in OpenMetrics for every family we export (both
prometheus_client encoders write `name{sorted labels} value`); tests/test_exposition.py holds the
result byte for byte to prometheus_client's output in both.

A scrape serves the newest body at once. When state has changed since that body was built, a small
exposition (up to 20 targets) is rebuilt on the spot, so it is always fresh; a large one is kept
up to date by a background task (at most every half second, one target per slice), so no scrape
waits for it, and a scrape may lag a state change by about half a second.
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
from prometheus_client.utils import floatToGoString

from hicache_canary.service.collector import CanaryCollector
from hicache_canary.service.config_reload import ReloadStatus
from hicache_canary.service.target_state import TargetSnapshot

log = logging.getLogger("hicache_canary.service.exposition")
# Up to this many targets (a few ms to write them all, ~250 kB) a scrape after a change rebuilds the
# body itself, so it is always fresh; beyond, bodies are rebuilt in the background.
INLINE_MAX_TARGETS = 20
GZIP_LEVEL = 1  # 2 MB in ~3 ms (level 9: ~55 ms) for 20% more bytes
REBUILD_GAP_S = 0.5  # a large body lags a change by at most this plus one rebuild
# What Prometheus 2.x and 3.x send first; warm() builds that format and plain text at startup.
PROMETHEUS_ACCEPT = b"application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


class _Families:
    """A registry-like object: what prometheus_client's encoders take."""

    def __init__(self, fams: Iterable[Metric]):
        self._fams = fams

    def collect(self) -> Iterable[Metric]:
        return iter(self._fams)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def sample_lines(fams: Iterable[Metric]) -> list[str]:
    """Each family's sample lines, as both prometheus_client encoders write them for our names."""
    out = []
    for fam in fams:
        lines = []
        for s in fam.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
                lines.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}\n")
            else:
                lines.append(f"{s.name} {floatToGoString(s.value)}\n")
        out.append("".join(lines))
    return out


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
    """One exposition format (text 0.0.4, OpenMetrics): its family headers and its newest body."""

    def __init__(self, encoder: Callable[[Any], bytes], content_type: str, collector: CanaryCollector):
        self.content_type = content_type
        self._encoder = encoder
        self._collector = collector
        self.status: ReloadStatus | None = None  # the config status `globals` show
        self.body: Body | None = None
        self.first = asyncio.Event()  # set once a body exists

    def current(self, snaps: Mapping[str, TargetSnapshot]) -> bool:
        """The body shows these snapshots and the config status as it is now."""
        return self.body is not None and self.body.version is snaps and self.status is self._collector.config_status()

    def assemble(self, names: list[str], frags: Mapping[str, tuple[TargetSnapshot, list[str]]]) -> bytes:
        status = self._collector.config_status()
        if status is not self.status:  # the global lines change only on a config reload
            text = self._encoder(_Families(self._collector.global_families(status))).decode()
            self.heads, self.globals = split_families(text)
            self.trailer = "# EOF\n" if text.rstrip().endswith("# EOF") else ""
            self.status = status
        parts: list[str] = []
        for i, head in enumerate(self.heads):
            parts.append(head)
            parts.extend([frags[n][1][i] for n in names])
            parts.append(self.globals[i])
        parts.append(self.trailer)
        return "".join(parts).encode()


class Exposition:
    """The /metrics ASGI endpoint. Requests with a query string (`name[]=`) go to `fallback`."""

    def __init__(self, snapshots: Callable[[], Mapping[str, TargetSnapshot]], fallback: Callable[..., Any],
                 collector: CanaryCollector):
        self.snapshots = snapshots
        self.fallback = fallback
        self.collector = collector  # the registry's own: one config status for both paths
        self.frags: dict[str, tuple[TargetSnapshot, list[str]]] = {}  # target -> (its snapshot, its lines)
        self._formats: dict[str, Format] = {}  # by content type
        self._by_accept: dict[bytes, Format] = {}
        self._task: asyncio.Task[None] | None = None

    def format_for(self, accept: bytes) -> Format:
        fmt = self._by_accept.get(accept)
        if fmt is None:
            encoder, content_type = choose_encoder(accept.decode("latin-1"))
            fmt = self._formats.get(content_type) or Format(encoder, content_type, self.collector)
            self._formats[content_type] = fmt
            if len(self._by_accept) < 64:  # Accept headers come from a handful of scrapers
                self._by_accept[accept] = fmt
        return fmt

    def stale(self, snaps: Mapping[str, TargetSnapshot]) -> list[str]:
        return [n for n, s in snaps.items() if (f := self.frags.get(n)) is None or f[0] is not s]

    def render(self, name: str, s: TargetSnapshot) -> None:
        self.frags[name] = (s, sample_lines(self.collector.target_families(name, s)))

    def _names(self, snaps: Mapping[str, TargetSnapshot]) -> list[str]:
        for gone in [n for n in self.frags if n not in snaps]:
            del self.frags[gone]
        return sorted(snaps)

    def build_inline(self, fmt: Format, snaps: Mapping[str, TargetSnapshot]) -> Body:
        for name in self.stale(snaps):
            self.render(name, snaps[name])
        raw = fmt.assemble(self._names(snaps), self.frags)
        fmt.body = Body(snaps, raw, gzip.compress(raw, GZIP_LEVEL))
        fmt.first.set()
        return fmt.body

    async def body(self, fmt: Format) -> Body:
        snaps = self.snapshots()
        body = fmt.body
        if body is not None and fmt.current(snaps):
            return body
        if len(snaps) <= INLINE_MAX_TARGETS:
            return self.build_inline(fmt, snaps)
        self._start()
        if body is None:
            # The very first body of a large exposition is waited for, once per format (warm()
            # builds Prometheus' format and plain text at startup, before anyone scrapes).
            await fmt.first.wait()
            assert fmt.body is not None
            return fmt.body
        return body

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._rebuild(), name="metrics-rebuild")

    def warm(self, *accepts: bytes) -> None:
        """Keep these formats' bodies built from now on, in the background (called at startup)."""
        for accept in accepts:
            self.format_for(accept)
        self._start()

    async def _rebuild(self) -> None:
        """Keeps every format's body following the snapshots, whether or not anyone scrapes."""
        while True:
            snaps = self.snapshots()
            todo = [f for f in self._formats.values() if not f.current(snaps)]
            if todo:
                try:
                    for name in self.stale(snaps):
                        self.render(name, snaps[name])
                        await asyncio.sleep(0)  # one target at a time: a scrape waits at most one target
                    names = self._names(snaps)
                    for fmt in todo:
                        raw = fmt.assemble(names, self.frags)
                        gz = await asyncio.to_thread(gzip.compress, raw, GZIP_LEVEL)
                        fmt.body = Body(snaps, raw, gz)
                        fmt.first.set()
                except Exception as exc:  # a rendering bug must not end /metrics: keep the last bodies
                    log.error("rebuilding /metrics failed: %s", type(exc).__name__)
            # Polling the snapshots' identity costs nothing; a rebuild of 200 targets a few ms.
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
        if self._task is not None:
            self._task.cancel()
