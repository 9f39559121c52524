"""The simulator-only control API under `/_sim/`, which SGLang does not have: the state snapshot,
fault switches, and a restart with new launch flags (docs/simulator.md, "Simulator-only control API").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import protocol as P
from .config import Faults, SimConfig
from .server_state import Sim


def add_control_routes(app: FastAPI, sim: Sim, reparse: Callable[[list[str]], SimConfig] | None) -> None:
    """Mount `/_sim/state`, `/_sim/faults` and `/_sim/restart` on `app`; `reparse` turns launch flags
    into a SimConfig (without it, restart answers 400)."""

    @app.get("/_sim/state")
    async def sim_state():
        return sim.state()

    @app.post("/_sim/faults")
    async def sim_faults(request: Request):
        try:
            body = P.json_object(await request.body())
            known = {f.name for f in dataclasses.fields(Faults)}
            unknown = sorted(set(body) - known)
            if unknown:
                raise P.BadRequest(f"unknown fault switch(es) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            sim.faults = dataclasses.replace(sim.faults, **body)
        except (P.BadRequest, TypeError) as exc:
            return JSONResponse(P.native_error(str(exc)), status_code=400)
        return dataclasses.asdict(sim.faults)

    @app.post("/_sim/restart")
    async def sim_restart(request: Request):
        try:
            body = P.json_object(await request.body())
            args = body.get("args", [])
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise P.BadRequest("args must be a list of launch flags, e.g. [\"--hicache-write-policy\", \"write_back\"]")
            if reparse is None:
                raise P.BadRequest("this simulator was started without a flag parser; restart is unavailable")
            cfg = reparse(args)
        except (P.BadRequest, ValueError) as exc:
            return JSONResponse(P.native_error(str(exc)), status_code=400)
        await sim.restart(dataclasses.replace(cfg, host=sim.cfg.host, port=sim.cfg.port))
        return sim.state()
