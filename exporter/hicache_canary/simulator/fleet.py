"""Many independent simulated servers in one process, one per port (`hicache-canary sim --ports`).

A fleet benchmark needs 200 SGLang servers on a 2-core machine; 200 Python processes would cost
~10 GB and drown the exporter being measured. Here every port gets its own `Sim` (own engine,
cache, counters, seed and fault switches), and one uvicorn server listens on all the ports: a
request goes to the app of the port it arrived on. A `--fault-down-after` fault stops the whole
process (all ports), since they share one server loop.
"""

from __future__ import annotations

import re
from dataclasses import replace

from starlette.types import ASGIApp, Receive, Scope, Send

from .config import SimConfig

_PART = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_PORTS = 1000


def parse_ports(spec: str) -> list[int]:
    """`31000-31199` or `40001,40007,41000-41003` -> the ports, in order, no repeats."""
    ports: list[int] = []
    for part in spec.split(","):
        m = _PART.match(part.strip())
        if m is None:
            raise ValueError(f"--ports: {part.strip()!r} is not a port or a range like 31000-31199")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"--ports: {part.strip()!r} is not within 1-65535 (low-high)")
        ports += [p for p in range(lo, hi + 1) if p not in ports]
    if len(ports) > MAX_PORTS:
        raise ValueError(f"--ports: {len(ports)} ports; at most {MAX_PORTS}")
    return ports


def fleet_configs(base: SimConfig, ports: list[int]) -> list[SimConfig]:
    """One config per port: the same flags, a different seed each (independent random streams)."""
    return [replace(base, port=p, seed=base.seed + i) for i, p in enumerate(ports)]


class PortDispatch:
    """ASGI: each request to the app of its local port; lifespan starts and stops every Sim."""

    def __init__(self, apps: dict[int, ASGIApp]):
        self.apps = apps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    for app in self.apps.values():
                        app.state.sim.start()  # type: ignore[attr-defined]
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    for app in self.apps.values():
                        await app.state.sim.stop()  # type: ignore[attr-defined]
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        server = scope.get("server") or (None, None)
        app = self.apps.get(server[1]) if server else None
        if app is None:  # a socket we did not bind ourselves: cannot happen, but never guess a server
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"no simulated server on this port"})
            return
        await app(scope, receive, send)
