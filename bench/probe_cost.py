"""What one conclusive reuse probe costs the GPU: the report's manual method vs our canary vs the floor.

    python bench/probe_cost.py            # full: the report's pool sizes, R = 40,960 tokens (~2 min)
    python bench/probe_cost.py --quick    # the same rows on a 10x smaller server (seconds; CI smoke)

Every row runs against `hicache-canary sim` as its own process over real HTTP on 127.0.0.1, a hybrid
GDN/Mamba model with the report's host pool (709,577 tokens) and a device pool of half that
(SGLang's default --hicache-ratio 2.0). Rows:

  (a) the report's manual method, driven by this script: R cold, 10 unique contexts as long as R,
      R again (rehost), R once more;
  (b) our canary (`canary.run_probe`, shipped defaults) on the same idle server, right after (a);
  (c) our canary on a server with its own traffic (the simulator's --background-rps load generator),
      with the shipped passive wait (300 s) and with the old default (60 s);
  (d) the floor: what LRU needs to push R out of the device pool, read from the server's own gauges
      at the start of each (b) probe (`kv_available_tokens + kv_evictable_tokens`: the free slots,
      every evictable entry older than R and R itself), plus R's three requests as (b) sent them.

Prefill tokens are prompt tokens no cache tier served; simulated GPU-seconds come from the
simulator's latency model at time scale 1 (see _common.py), cross-checked against the simulator's
own `sglang:forward_execution_seconds_total` on the idle servers. R has the same length in every row.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import dataclass, field

from _common import PREFILL_S_PER_TOKEN, Cost, MeteredClient, SimServer, fmt_int, scaled_settings, table

from hicache_canary.probe.canary import run_probe
from hicache_canary.models import Phase, ProbeRecord, ProbeSettings
from hicache_canary.probe.pressure import cached_len

FULL = dict(device=354_788, host=709_577, r=40_960, chunk=8192, probes=3, bg_context=4096, bg_rps=0.5)
# The report's server scaled down 10x: same shape, seconds instead of minutes.
QUICK = dict(device=35_478, host=70_958, r=4096, chunk=1024, probes=1, bg_context=1024, bg_rps=1.0)
MANUAL_PRESSURE_CONTEXTS = 10
IDLE_TIME_SCALE = 0.001
BG_TIME_SCALE = 0.02  # the passive wait is timed on the wall clock: keep CPU overhead small against it
OLD_PASSIVE_WAIT_S = 60.0  # the default before 300 s: too short for a busy node to turn its pool over
TARGET_FLOOR = 1.1
TARGET_BACKGROUND = 0.1


@dataclass
class Row:
    label: str
    policy: str
    method: str
    outcomes: list[str] = field(default_factory=list)
    total: Cost = field(default_factory=Cost)
    conclusive: int = 0
    runs: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def per_probe(self) -> Cost | None:
        return self.total.per(self.conclusive) if self.conclusive else None


def server_flags(p: dict, policy: str, time_scale: float, extra: tuple[str, ...] = ()) -> list[str]:
    flags = ["--enable-hierarchical-cache", "--enable-metrics", "--hybrid-model", "--hicache-write-policy", policy,
             "--max-total-tokens", str(p["device"]), "--hicache-host-tokens", str(p["host"]),
             "--chunked-prefill-size", str(p["chunk"]), "--time-scale", str(time_scale), "--seed", "1"]
    if policy == "write_through":
        flags += ["--hybrid-failure", "mamba_state_not_backed_up"]  # the report's build: silent
    return flags + list(extra)


async def forward_seconds(c: MeteredClient) -> float:
    """The simulator's own busy-time counter (simulated seconds)."""
    text = await c.metrics_text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:forward_execution_seconds_total"))


async def manual_method(c: MeteredClient, r_len: int, rng: random.Random, row: Row) -> None:
    """The field report's procedure, one request at a time, exactly as a person would send it."""
    ids = lambda: [rng.randint(1000, 30000) for _ in range(r_len)]  # noqa: E731
    r = ids()
    mark = c.mark()
    await c.generate(r, timeout=120)
    for _ in range(MANUAL_PRESSURE_CONTEXTS):
        await c.generate(ids(), timeout=120)
    await c.generate(r, timeout=120)
    await c.generate(r, timeout=120)
    sent = c.since(mark)
    rehost, again = sent[-2], sent[-1]
    share = rehost.host / max(1, again.device)
    row.outcomes.append(f"rehost {share:.0%} from host")
    row.total += Cost.of(sent)
    row.runs += 1
    row.conclusive += 1  # a person reads the latencies: every manual run answers the question


async def canary_probes(c: MeteredClient, settings: ProbeSettings, n: int, seed: int, row: Row,
                        floors: tuple[Row, Row] | None = None) -> None:
    for i in range(n):
        start = await c.metrics()
        free_evictable = (start.kv_available_tokens or 0) + (start.kv_evictable_tokens or 0)
        mark = c.mark()
        rec = await run_probe(c, settings, rng=random.Random(seed * 1000 + i))
        sent = c.since(mark)
        row.runs += 1
        row.outcomes.append(rec.verdict.value if rec.verdict else "none")
        row.total += Cost.of(sent)
        if rec.verdict is not None and rec.verdict.conclusive:
            row.conclusive += 1
        p = rec.pressure
        row.notes.append(f"probe {i + 1}: {rec.verdict.value if rec.verdict else '?'}, filler {fmt_int(p.synthetic_tokens)} "
                         f"in {p.chunks} requests, passive {fmt_int(p.passive_tokens)}, planned {fmt_int(p.planned_tokens)}, "
                         f"floor {fmt_int(free_evictable)}; {rec.evidence[:160]}")
        if floors is not None and len(sent) >= 3:
            r_three = Cost.of([sent[0], sent[-2], sent[-1]])
            for floor, tokens in zip(floors, (free_evictable, strict_minimum(rec))):
                floor.total += r_three + Cost(0, int(tokens), int(tokens), tokens * PREFILL_S_PER_TOKEN)
                floor.runs += 1
                floor.conclusive += 1


def strict_minimum(rec: ProbeRecord) -> float:
    """Allocations that make LRU evict R: the free slots and every evictable entry older than R once R
    is planted, plus one page. SGLang evicts whole leaves and R is one leaf, so the allocation that
    first reaches into R frees all of it; the brief's floor (d) counts all of R instead."""
    cold = rec.step(Phase.COLD)
    snap = cold.after if cold else None
    if snap is None or snap.kv_available_tokens is None or snap.kv_evictable_tokens is None:
        return float("nan")
    page = rec.server.page_size if rec.server else 1
    older = max(0.0, snap.kv_evictable_tokens - cached_len(rec.context_tokens, page))
    return snap.kv_available_tokens + older + page


async def idle_rows(p: dict, policy: str, seed: int) -> list[Row]:
    manual = Row("(a)", policy, f"manual: R cold, {MANUAL_PRESSURE_CONTEXTS}x R-sized pressure, rehost, again")
    canary = Row("(b)", policy, "canary, idle server")
    floor = Row("(d)", policy, "floor: free + evictable at start, + R's 3 sends")
    strict = Row("(d')", policy, "strict LRU minimum: free + older than R + 1 page after R, + R's 3 sends")
    with SimServer(server_flags(p, policy, IDLE_TIME_SCALE)) as sim:
        async with MeteredClient(sim.url) as c:
            for row, run in ((manual, manual_method(c, p["r"], random.Random(seed), manual)),
                             (canary, canary_probes(c, scaled_settings(IDLE_TIME_SCALE, context_tokens=p["r"]),
                                                    p["probes"], seed, canary, (floor, strict)))):
                before, mark = await forward_seconds(c), c.mark()
                await run
                own, metered = await forward_seconds(c) - before, Cost.of(c.since(mark)).gpu_s
                if abs(own - metered) > 1e-3 * max(1.0, metered):
                    row.notes.append(f"GPU-s check: metered {metered:.2f} s, simulator's counter {own:.2f} s")
    return [manual, canary, floor, strict]


async def background_rows(p: dict, seed: int) -> list[Row]:
    """Both passive waits on one server with its own traffic: first the shipped one, then the old 60 s."""
    extra = ("--background-rps", str(p["bg_rps"]), "--background-context-tokens", str(p["bg_context"]))
    shipped = ProbeSettings(target="sim").passive_wait_s
    rows = []
    with SimServer(server_flags(p, "write_back", BG_TIME_SCALE, extra)) as sim:
        async with MeteredClient(sim.url) as c:
            for wait in (shipped, OLD_PASSIVE_WAIT_S):
                label = (f"canary, server traffic {p['bg_rps']} rps x {fmt_int(p['bg_context'])} tokens, "
                         f"passive wait {wait:.0f} s{' (shipped)' if wait == shipped else ' (old default)'}")
                row = Row("(c)", "write_back", label)
                settings = scaled_settings(BG_TIME_SCALE, context_tokens=p["r"], passive_wait_s=wait)
                await canary_probes(c, settings, p["probes"], seed + len(rows), row)
                rows.append(row)
    return rows


def render(p: dict, rows: list[Row]) -> tuple[str, list[str]]:
    per = {(r.label, r.policy): r.per_probe for r in rows}
    body = []
    for r in rows:
        c, floor_row = r.per_probe, r.label.startswith("(d")  # floors are priced for the idle (b) rows only
        vs = [ratio(c, per.get((ref, r.policy))) for ref in ("(a)", "(d)", "(d')")]
        outcome = ", ".join(sorted(set(r.outcomes), key=r.outcomes.index)) or "-"
        body.append([r.label, r.policy, r.method, "-" if floor_row else outcome, f"{r.conclusive}/{r.runs}",
                     fmt_int(c.prompt) if c else "n/a", fmt_int(c.prefill) if c else "n/a",
                     f"{c.gpu_s:,.1f}" if c else "n/a",
                     *(f"{v:.2f}x" if v is not None and (i == 0 or r.label == "(b)") else "-" for i, v in enumerate(vs))])
    head = ["row", "policy", "method", "outcome", "conclusive", "prompt tokens", "prefill tokens", "sim GPU-s",
            "vs (a)", "vs (d)", "vs (d')"]
    return table(head, body, right=set(range(4, 11))), targets(rows, per)


def ratio(a: Cost | None, b: Cost | None) -> float | None:
    return a.prefill / b.prefill if a and b and b.prefill else None


def targets(rows: list[Row], per: dict) -> list[str]:
    out = []
    for r in rows:
        c = r.per_probe
        if r.label == "(b)":
            out.append(_check(f"(b) {r.policy}: within {TARGET_FLOOR}x of the floor (d)", ratio(c, per.get(("(d)", r.policy))),
                              TARGET_FLOOR))
            out.append(_check(f"(b) {r.policy}: below the manual method (a)", ratio(c, per.get(("(a)", r.policy))), 1.0,
                              strict=True))
            strict = ratio(c, per.get(("(d')", r.policy)))
            if strict is not None:
                out.append(f"INFO  (b) {r.policy}: vs the strict LRU minimum (d'): {strict:.3f}x")
        if r.label == "(c)":
            out.append(_check(f"(c) {r.method}: at most {TARGET_BACKGROUND}x of (a)",
                              ratio(c, per.get(("(a)", r.policy))), TARGET_BACKGROUND))
    return out


def _check(what: str, value: float | None, limit: float, strict: bool = False) -> str:
    if value is None:
        return f"MISS  {what}: no conclusive probe to measure"
    ok = value < limit if strict else value <= limit
    how = f"{value:.3f}x" if ok else f"{value:.3f}x, over by {(value / limit - 1):.0%}"
    return f"{'PASS' if ok else 'MISS'}  {what}: {how}"


async def main(quick: bool, seed: int) -> int:
    p = QUICK if quick else FULL
    rows = []
    for policy in ("write_back", "write_through"):
        rows += await idle_rows(p, policy, seed)
    rows += await background_rows(p, seed)
    out, checks = render(p, rows)
    print(f"Probe cost per conclusive probe ({'quick' if quick else 'full'} run): hybrid GDN/Mamba model, device pool "
          f"{fmt_int(p['device'])} tokens, host pool {fmt_int(p['host'])} tokens, chunked_prefill_size {fmt_int(p['chunk'])}, "
          f"R = {fmt_int(p['r'])} tokens in every row; write_through runs the report's build "
          f"(--hybrid-failure mamba_state_not_backed_up). {p['probes']} canary probe(s) per row.\n")
    print(out)
    print("\nTargets (prefill tokens per conclusive probe):")
    print("\n".join("  " + c for c in checks))
    print("\nPer-probe details:")
    for r in rows:
        for n in r.notes:
            print(f"  {r.label} {r.policy}: {n}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 10x smaller server and one probe per row (CI smoke)")
    ap.add_argument("--seed", type=int, default=1, help="random seed for R and the manual method's contexts")
    args = ap.parse_args()
    try:
        sys.exit(asyncio.run(main(args.quick, args.seed)))
    except (RuntimeError, OSError) as exc:
        print(f"probe_cost: error: {exc}", file=sys.stderr)
        sys.exit(1)
