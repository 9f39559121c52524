"""Pre-serialised /metrics: byte for byte what prometheus_client renders, in both formats, fresh
after every change, and a large exposition never rebuilt inside a scrape."""

from __future__ import annotations

import asyncio
import gzip
from dataclasses import replace

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from hicache_canary.service import exposition
from hicache_canary.service.exposition import Exposition
from test_collector import apply, collector, make, silent_record

OPENMETRICS = b"application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def fleet(n: int):
    sched, reg = make()
    base = sched.targets()[0]
    for i in range(n):
        sched.add_target(replace(base, name=f"t{i:02d}", probe=replace(base.probe, target=f"t{i:02d}")))
    for i in range(0, n, 3):  # some probed, some never: both kinds of fragment
        rec = silent_record(1000.0 + i)
        rec.target = f"t{i:02d}"
        if i == 3:  # a server's own strings end up in label values: escaped as prometheus_client does
            rec.server = replace(rec.server, version='0.5.23"rc\\1\nx', speculative_algorithm="é")
        apply(sched, rec)
    return sched, reg


async def scrape(exp: Exposition, accept: bytes = b"", gz: bool = False) -> tuple[dict, bytes]:
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    headers = [(b"accept", accept)] + ([(b"accept-encoding", b"gzip")] if gz else [])
    await exp({"type": "http", "method": "GET", "path": "/metrics", "headers": headers, "query_string": b""}, None, send)
    head = dict(sent[0]["headers"])
    body = sent[1]["body"]
    return head, gzip.decompress(body) if gz else body


@pytest.mark.parametrize("accept,render,content_type", [
    pytest.param(b"", generate_latest, b"text/plain; version=0.0.4; charset=utf-8", id="text"),
    pytest.param(OPENMETRICS, generate_openmetrics, b"application/openmetrics-text; version=1.0.0; charset=utf-8", id="openmetrics"),
])
async def test_the_spliced_body_is_what_prometheus_client_renders(accept, render, content_type):
    sched, reg = fleet(12)
    exp = Exposition(sched, None, collector(sched))
    head, body = await scrape(exp, accept)
    assert head[b"content-type"].startswith(content_type)
    assert body == render(reg)
    _, zipped = await scrape(exp, accept, gz=True)
    assert zipped == body

    rec = silent_record(5000.0)  # one target changes: the next scrape shows it
    rec.target = "t01"
    apply(sched, rec)
    _, after = await scrape(exp, accept)
    assert after == render(reg) and after != body
    sched.remove_target("t02")  # and a target that goes takes its lines with it
    _, after = await scrape(exp, accept)
    assert after == render(reg) and b'target="t02"' not in after


async def test_a_large_exposition_is_rebuilt_in_the_background_never_in_the_scrape(monkeypatch):
    sched, reg = fleet(6)
    exp = Exposition(sched, None, collector(sched))
    await scrape(exp)  # the first body is always built
    monkeypatch.setattr(exposition, "INLINE_MAX_TARGETS", 2)  # as if it had 200 targets
    renders = 0
    real = exposition.Exposition.render

    def counting(self, name, s):
        nonlocal renders
        renders += 1
        real(self, name, s)

    monkeypatch.setattr(exposition.Exposition, "render", counting)
    before = generate_latest(reg)
    rec = silent_record(9000.0)
    rec.target = "t04"
    apply(sched, rec)
    _, stale = await scrape(exp)
    assert stale == before and renders == 0  # served at once, from the last body
    for _ in range(100):
        await asyncio.sleep(0.01)
        _, now = await scrape(exp)
        if now != before:
            break
    assert now == generate_latest(reg) and renders == 1  # only the target that changed was rendered again
    await exp.aclose()
