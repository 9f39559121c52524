"""How often the canary's verdict is right: randomized simulator scenarios with a truth derived from each.

    python bench/accuracy.py             # 240 seeded scenarios (a few minutes on 2 cores)
    python bench/accuracy.py --quick     # 8 scenarios, one of each kind (CI smoke)

Each scenario is one `hicache-canary sim` configuration (write policy, hybrid or not, failure mode,
page size, device and host pool sizes, metrics profile, +-30% latency jitter, background traffic,
a warmed-up or fresh cache) plus probe settings (R's length, API, pressure cap). The simulator app
runs in this process and the canary reaches it through httpx's ASGI transport: no sockets, one
scenario after another in each of `--jobs` worker processes, each simulator freshly built.

The truth comes from the scenario's configuration alone, never from the probe (the rules are in
`truth()`, with the SGLang behaviour each one rests on). Targets: no false `silent` (a `silent` verdict
where the truth is not silent) and no missed `silent` where the probe confirmed eviction.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from _common import PREFILL_S_PER_TOKEN, in_process_sim, scaled_settings, table

from hicache_canary.probe.canary import run_probe
from hicache_canary.models import Verdict

IDLE_TIME_SCALE = 0.002
BG_TIME_SCALE = 0.01  # passive waits are timed on the wall clock: keep CPU overhead small against them
# Without per-tier details or tier counters (the OpenAI API on a 0.5.17 build) only latency is left to
# judge by, and it must be the simulated GPU's latency, not this process's ~50 ms of CPU per request:
# such scenarios run slower, with R >= 8K (a cold prefill of >= 3 simulated s) on a smaller pool.
LATENCY_TIME_SCALE = 0.25
LATENCY_MIN_R = 8192
LATENCY_MAX_DEVICE = 40_000
KINDS = ("general", "general", "general", "general", "general", "general", "capped", "disabled", "report_shape")
# The field report's pool geometry: 354,788 device tokens / chunked_prefill_size 8192 = ~43 filler
# requests per probe, R = 40,960 (11.5% of the pool); scaled down by keeping both ratios.
REPORT_FILLERS = 43
REPORT_R_SHARE = 40_960 / 354_788
QUICK_KINDS = ("healthy_write_back", "silent_mamba", "silent_chunked", "healthy_write_through", "capped", "disabled",
               "report_shape", "general")
BACKGROUND_SHARE = 0.3
WARM_SHARE = 0.5
SILENT_OK = frozenset({Verdict.SILENT})
NOT_EVICTED_OK = frozenset({Verdict.NOT_EVICTED, Verdict.INCONCLUSIVE})


@dataclass(frozen=True)
class Scenario:
    n: int
    seed: int
    kind: str
    flags: tuple[str, ...]
    context_tokens: int
    api: str = "native"
    max_pressure_tokens: int | None = None
    warm_tokens: int = 0
    background: bool = False
    truth: Verdict = Verdict.REUSED
    accept: frozenset[Verdict] = frozenset({Verdict.REUSED})
    why: str = ""

    def describe(self) -> str:
        fl = self.flags
        f = {a: b for a, b in zip(fl, fl[1:] + ("",)) if a.startswith("--") and not b.startswith("--")}
        bits = [f.get("--hicache-write-policy", "hicache off") if "--enable-hierarchical-cache" in self.flags else "hicache off",
                "hybrid" if "--hybrid-model" in self.flags else "dense", f"failure={f.get('--hybrid-failure', '-')}",
                f"device={f['--max-total-tokens']}", f"host={f.get('--hicache-host-tokens', '-')}",
                f"page={f['--page-size']}", f"chunk={f['--chunked-prefill-size']}", f"R={self.context_tokens}",
                f"profile={f['--metrics-profile']}", f"api={self.api}"]
        if self.max_pressure_tokens is not None:
            bits.append(f"cap={self.max_pressure_tokens}")
        if self.warm_tokens:
            bits.append(f"warm={self.warm_tokens}")
        if self.background:
            bits.append(f"bg={f['--background-rps']}rps x {f['--background-context-tokens']}")
        return " ".join(bits)


def truth(policy: str | None, hybrid: bool, failure: str, r: int, chunk: int) -> tuple[Verdict, frozenset[Verdict], str]:
    """What an honest probe must find once R has left the device, from the configuration alone.

    SGLang (its HiCache code; docs/simulator.md) and the simulator that follows it:
    - write_through_selective backs a node up on its second hit; the canary sends R twice before the
      pressure (as any returning context is hit twice), so it behaves as write_through below.
    - write_through on the report's build never backs up a hybrid model's late-attached Mamba
      state; the host KV alone fails the Mamba validator -> silent.
    - write_through never backs up a chunked prefill (R longer than chunked_prefill_size) under the
      chunked failure -> silent; a shorter R is backed up normally -> reused.
    - write_through with a host Mamba pool of 4 states and a host KV pool holding >= 8 contexts of R's
      length: any R-sized workload that evicts R from device backs up more than 4 states after R's
      and evicts it (LRU); host KV of such contexts is dead memory -> silent (scenarios keep R small).
    - otherwise the host tier holds R (KV and state; host pools >= 2x device) -> reused.
    """
    if policy is None:
        return Verdict.HICACHE_DISABLED, frozenset({Verdict.HICACHE_DISABLED}), "HiCache off"
    if policy in ("write_through", "write_through_selective"):
        if hybrid and failure == "mamba_state_not_backed_up":
            return Verdict.SILENT, SILENT_OK, "write_through drops the late-attached Mamba state"
        if failure == "chunked_prefill_not_backed_up" and r > chunk:
            return Verdict.SILENT, SILENT_OK, "write_through never backs up R's chunked prefill"
        if hybrid and failure == "host_mamba_pool_small" and policy == "write_through":
            # (selective backs up only contexts hit twice: one-off contexts after R take no state)
            return Verdict.SILENT, SILENT_OK, "4 host Mamba slots: later contexts evict R's state"
    return Verdict.REUSED, frozenset({Verdict.REUSED}), "host tier holds R"


def make_scenario(n: int, seed: int, kind: str, quick: bool) -> Scenario:
    rng = random.Random(seed * 100_003 + n)
    device = rng.randrange(12_000, 24_000) if quick else rng.randrange(16_000, 80_000)
    page = rng.choice((1, 1, 16, 64))
    chunk = rng.choice((2048, 4096, 8192, 8192))
    hybrid = rng.random() < 0.6
    policy: str | None = rng.choice(("write_back", "write_back", "write_through", "write_through", "write_through_selective"))
    failure = rng.choice(("mamba_state_not_backed_up", "chunked_prefill_not_backed_up", "host_mamba_pool_small", "none"))
    forced = {"healthy_write_back": ("write_back", "none"), "healthy_write_through": ("write_through", "none"),
              "silent_mamba": ("write_through", "mamba_state_not_backed_up"),
              "silent_chunked": ("write_through", "chunked_prefill_not_backed_up")}
    if kind in forced:
        policy, failure = forced[kind]
        hybrid = hybrid or kind == "silent_mamba"
    if kind == "disabled":
        policy = None
    if kind == "report_shape":  # a fixed build on the report's geometry: healthy, so host reuse must show
        policy, failure, hybrid = rng.choice(("write_back", "write_through")), "none", True
        chunk = rng.choice((1024, 2048))
        device = REPORT_FILLERS * chunk
    if policy == "write_back" and hybrid and failure == "host_mamba_pool_small":
        # Undecidable from the configuration: whether R's state survives 4 slots depends on how many
        # contexts are evicted after R before the rehost. Not a scenario with a truth.
        failure = "none"
    api = "openai" if rng.random() < 0.1 else "native"
    profile = "0.5.17" if rng.random() < 0.2 else "0.5.23"
    latency_only = api == "openai" and profile == "0.5.17"
    if latency_only:
        device = min(max(device, 2 * LATENCY_MIN_R + 2048), LATENCY_MAX_DEVICE)
    r_max = min(16_384, device // 2 - 64)
    r = rng.randrange(LATENCY_MIN_R if latency_only else 2048, r_max + 1)
    if kind == "report_shape":
        r = int(device * REPORT_R_SHARE)
    if kind == "silent_chunked":
        chunk = 2048
    if hybrid and failure == "host_mamba_pool_small":
        chunk = 2048 if device // 8 >= 2048 else 1024
        if not latency_only:  # (latency-only scenarios need R >= LATENCY_MIN_R for a visible cold prefill)
            r = min(r, device // 4)  # host (>= 2x device) holds >= 8 contexts of R: the Mamba pool is the bottleneck
    background = kind == "general" and rng.random() < BACKGROUND_SHARE
    warm = int(device * rng.uniform(0.2, 1.5)) if rng.random() < WARM_SHARE else 0
    cap = None
    if kind == "capped":
        cap = int((device - r) * rng.uniform(0.05, 0.5))  # below free + older: R is never reached
    flags = ["--enable-metrics", "--max-total-tokens", str(device), "--page-size", str(page),
             "--chunked-prefill-size", str(chunk), "--seed", str(seed * 1000 + n),
             "--latency-jitter", f"{rng.uniform(0.0, 0.3):.3f}",
             "--metrics-profile", profile, "--time-scale", str(time_scale(latency_only, background))]
    if policy is not None:
        host = int(device * rng.uniform(2.0, 4.0))
        flags += ["--enable-hierarchical-cache", "--hicache-write-policy", policy, "--hicache-host-tokens", str(host),
                  "--hybrid-failure", failure]
    if hybrid:
        flags.append("--hybrid-model")
    if background:
        ctx = rng.choice((1024, 2048, 4096))
        busy = rng.uniform(0.2, 0.5)  # share of the simulated GPU the server's own traffic keeps busy
        rps = busy / (0.1 + ctx * PREFILL_S_PER_TOKEN)  # 0.1 s: the simulator's per-request base
        flags += ["--background-rps", f"{rps:.3f}", "--background-context-tokens", str(ctx)]
    t, accept, why = truth(policy, hybrid, failure, r, chunk)
    if kind == "capped" and policy is not None:
        t, accept, why = Verdict.NOT_EVICTED, NOT_EVICTED_OK, "pressure capped below the LRU floor"
    return Scenario(n, seed, kind, tuple(flags), r, api, cap, warm, background, t, accept, why)


def time_scale(latency_only: bool, background: bool) -> float:
    return LATENCY_TIME_SCALE if latency_only else BG_TIME_SCALE if background else IDLE_TIME_SCALE


def scenarios(count: int, seed: int, quick: bool) -> list[Scenario]:
    rng = random.Random(seed)
    kinds = [QUICK_KINDS[i % len(QUICK_KINDS)] for i in range(count)] if quick else [rng.choice(KINDS) for _ in range(count)]
    return [make_scenario(i, seed, k, quick) for i, k in enumerate(kinds)]


@dataclass
class Outcome:
    scenario: Scenario
    verdict: Verdict
    cause: str
    evicted: bool
    evidence: str
    seconds: float
    error: str = ""

    @property
    def correct(self) -> bool:
        return self.verdict in self.scenario.accept


async def _warm(client, tokens: int, rng: random.Random, api: str) -> None:
    """Older traffic: evictable entries that LRU must push out before it reaches R."""
    while tokens > 0:
        n = min(tokens, rng.randrange(1024, 8192))
        await client.generate([rng.randint(1000, 30000) for _ in range(n)], timeout=60)
        tokens -= n


async def _run(sc: Scenario) -> Outcome:
    t0 = time.perf_counter()
    scale = float(dict(zip(sc.flags, sc.flags[1:]))["--time-scale"])
    settings = scaled_settings(scale, target=f"s{sc.n}", context_tokens=sc.context_tokens, api=sc.api,
                               max_pressure_tokens=sc.max_pressure_tokens)
    async with in_process_sim(list(sc.flags)) as (client, _sim):
        rng = random.Random(sc.seed * 7919 + sc.n)
        await _warm(client, sc.warm_tokens, rng, sc.api)
        rec = await run_probe(client, settings, rng=rng)
    return Outcome(sc, rec.verdict or Verdict.ERROR, rec.cause.value, rec.pressure.eviction_confirmed,
                   rec.evidence, time.perf_counter() - t0)


def run_one(sc: Scenario) -> Outcome:
    try:
        return asyncio.run(_run(sc))
    except Exception as exc:  # a crash is a result to report, not a reason to lose the other 239
        return Outcome(sc, Verdict.ERROR, "none", False, f"{type(exc).__name__}: {exc}"[:200], 0.0, error=type(exc).__name__)


def report(outcomes: list[Outcome], wall: float, jobs: int) -> tuple[str, int, int]:
    order = [v for v in Verdict]
    seen = [v for v in order if any(o.verdict == v for o in outcomes)]
    truths = [v for v in order if any(o.scenario.truth == v for o in outcomes)]
    rows = []
    for t in truths:
        mine = [o for o in outcomes if o.scenario.truth == t]
        counts = Counter(o.verdict for o in mine)
        right = sum(o.correct for o in mine)
        rows.append([f"truth {t.value}", *(counts.get(v, 0) or "." for v in seen), len(mine), f"{right}/{len(mine)}"])
    counts = Counter(o.verdict for o in outcomes)
    rows.append(["all", *(counts.get(v, 0) for v in seen), len(outcomes), f"{sum(o.correct for o in outcomes)}/{len(outcomes)}"])
    out = table(["truth \\ verdict", *(v.value for v in seen), "total", "correct"], rows, right=set(range(1, len(seen) + 3)))
    false_silent = [o for o in outcomes if o.verdict == Verdict.SILENT and o.scenario.truth != Verdict.SILENT]
    missed = [o for o in outcomes if o.scenario.truth == Verdict.SILENT and o.evicted and o.verdict != Verdict.SILENT]
    lines = [out, "", f"false silent (target 0): {len(false_silent)}",
             f"missed silent where eviction was confirmed (target 0): {len(missed)}"]
    wrong = [o for o in outcomes if not o.correct]
    if wrong:
        lines += ["", f"Not as expected ({len(wrong)}):"]
        for o in wrong:
            lines.append(f"  #{o.scenario.n} [{o.scenario.why}] {o.scenario.describe()}\n"
                         f"      -> {o.verdict.value} (cause {o.cause}, eviction confirmed {o.evicted}): {o.evidence[:220]}")
    by_kind = Counter((o.scenario.kind, o.correct) for o in outcomes)
    kinds = sorted({o.scenario.kind for o in outcomes})
    lines += ["", "By kind: " + ", ".join(f"{k} {by_kind[(k, True)]}/{by_kind[(k, True)] + by_kind[(k, False)]}" for k in kinds),
              f"{len(outcomes)} scenarios in {wall:.0f} s wall with {jobs} worker process(es); slowest "
              f"{max((o.seconds for o in outcomes), default=0):.1f} s; simulator in-process via httpx.ASGITransport"]
    return "\n".join(lines), len(false_silent), len(missed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 small scenarios, one of each kind (CI smoke)")
    ap.add_argument("--scenarios", type=int, default=None, help="how many (default 240, quick 8)")
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = ap.parse_args()
    count = args.scenarios if args.scenarios is not None else (8 if args.quick else 240)
    if count < 1 or args.jobs < 1:
        ap.error("--scenarios and --jobs must be at least 1")
    todo = scenarios(count, args.seed, args.quick)
    t0 = time.perf_counter()
    if args.jobs == 1:
        outcomes = [run_one(sc) for sc in todo]
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(run_one, todo))
    text, false_silent, missed = report(outcomes, time.perf_counter() - t0, args.jobs)
    print(f"Verdict accuracy over {count} seeded scenarios (seed {args.seed}{', quick' if args.quick else ''})\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
