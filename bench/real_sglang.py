"""Conformance run of the canary against a real SGLang on this machine's GPU; prints a truth table.

    python bench/real_sglang.py --out ./rs                       # everything: about 3 min to start, 6 to run
    python bench/real_sglang.py --phase start --out ./rs         # build tiny models, start servers, wait /health
    python bench/real_sglang.py --phase probe --out ./rs         # >= 10 consecutive CLI probes per server
    python bench/real_sglang.py --phase serve --out ./rs         # the exporter for >= 3 rounds, report, stop
    python bench/real_sglang.py --phase report --out ./rs        # judge what the folder holds (no GPU needed)
    python bench/real_sglang.py --dry-run                        # print the plan: commands, exporter config

Builds two tiny random-weight models (a Qwen3-Next hybrid and a dense Qwen3, vocab 32768), starts the
server matrix of SERVERS below on one GPU (one port each), runs `hicache-canary probe --json` ten
times in a row on each (servers in parallel, one probe at a time per server), then `hicache-canary
serve` against all of them for three scheduled rounds, and judges every verdict against SERVERS'
expectation *and* against the tier details the record itself carries (a `reused` whose rehost came
from device is a FAIL). Everything lands in --out and in one `tar czf` archive (--archive).

Standard library only: it runs with the SGLang python (`--python`, for the servers and the model
build) and calls the canary as a command (`--canary`, e.g. /tmp/hc/bin/hicache-canary), so the two
never share an environment. Servers start in their own session (they survive between --phase calls;
their PIDs are in <out>/state.json) and are stopped by process group at the end of `serve`/`all`
(never by name). Every wait is bounded. See docs/real-sglang.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ------------------------------------------------------------------ the expectations (one table)

HOST_SHARE = 0.5  # rehost share of R served from host at/above which R was reused (the canary's default)
DEVICE_SHARE = 0.5  # rehost share of R still on device at/above which R never left the device
HOST_POOL_FULL = 0.9  # host pool used/total at/above which it counts as full (cause host_pool_pressure)
MANUAL_MULTIPLE = 13  # the seed's manual method: R cold + 10 contexts as long as R + R twice again
FLOOR_R_SENDS = 3  # one device pool of turnover plus R's three requests (cold, rehost, again)


@dataclass(frozen=True)
class Expect:
    verdicts: tuple[str, ...]  # any of these, each proven by the record's own tier details
    causes: tuple[str, ...] = ("none",)  # allowed suspected causes of a `silent`
    note: str = ""

    def label(self) -> str:
        parts = [v if v != "silent" else f"silent({'/'.join(self.causes)})" for v in self.verdicts]
        return " or ".join(parts)


@dataclass(frozen=True)
class ServerSpec:
    name: str  # target name: [a-z0-9_], never a YAML boolean word (off, on, yes, no)
    model: str  # "hybrid" or "dense"
    flags: tuple[str, ...]
    expect: Expect


HICACHE = ("--enable-hierarchical-cache", "--hicache-ratio", "4")
REUSED = Expect(("reused",), note="SGLang 0.5.17 backs R up and loads it back from host")
SERVERS: tuple[ServerSpec, ...] = (
    ServerSpec("wt", "hybrid", HICACHE + ("--hicache-write-policy", "write_through"), REUSED),
    ServerSpec("wb", "hybrid", HICACHE + ("--hicache-write-policy", "write_back"), REUSED),
    ServerSpec("wtsel", "hybrid", HICACHE + ("--hicache-write-policy", "write_through_selective"), REUSED),
    ServerSpec("nohicache", "hybrid", (), Expect(("hicache_disabled",), note="no --enable-hierarchical-cache: nothing sent")),
    ServerSpec(
        "wtsmall", "hybrid",
        ("--enable-hierarchical-cache", "--hicache-ratio", "1.2", "--hicache-write-policy", "write_through"),
        Expect(("silent", "reused"), causes=("host_pool_pressure",),
               note="host pool barely above the device pool: silent only with the pool full and R partly on host"),
    ),
    ServerSpec("page64", "hybrid", HICACHE + ("--hicache-write-policy", "write_through", "--page-size", "64"), REUSED),
    ServerSpec("dense_wt", "dense", HICACHE + ("--hicache-write-policy", "write_through"), REUSED),
)
BY_NAME = {s.name: s for s in SERVERS}

# Shared by every server: a 40K-token device pool and 2K prefill chunks (R of 16K spans 8 chunks, the
# chunked path where write_through used to lose backups), the tiny model's fast kernels, metrics on.
COMMON_FLAGS = (
    "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--max-total-tokens", "40000", "--chunked-prefill-size", "2048",
    "--max-prefill-tokens", "8192", "--enable-metrics", "--host", "127.0.0.1",
    "--max-running-requests", "4", "--context-length", "32768",
)
HYBRID_FLAGS = ("--max-mamba-cache-size", "32")


# ------------------------------------------------------------------ pure parts: commands and config


def server_command(spec: ServerSpec, port: int, model_path: str, python: str, mem_fraction: float) -> list[str]:
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(port),
           "--mem-fraction-static", str(mem_fraction), *COMMON_FLAGS]
    if spec.model == "hybrid":
        cmd += HYBRID_FLAGS
    return cmd + list(spec.flags)


def exporter_config(targets: list[tuple[str, int]], listen_port: int, interval_s: int) -> str:
    """The exporter's YAML for every server; every string quoted (a target named `off` is a boolean)."""
    lines = [
        "# generated by bench/real_sglang.py",
        "listen:",
        '  host: "127.0.0.1"',
        f"  port: {listen_port}",
        f"max_concurrent_probes: {max(1, len(targets))}",  # one per server: they share one GPU, not one cache
        "defaults:",
        f'  interval: "{interval_s}s"',
        "targets:",
    ]
    for name, port in targets:
        lines += [f'  - name: "{name}"', f'    url: "http://127.0.0.1:{port}"']
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ pure parts: reading a probe record


@dataclass(frozen=True)
class ProbeView:
    """What judging needs from one probe, read from a `probe --json` record or an /api/targets entry."""

    source: str
    verdict: str | None
    cause: str = "none"
    evidence: str = ""
    r_tokens: int = 0
    cacheable: int = 0  # R's tokens the radix cache can hold: what `again` hit, else R - 1
    rehost: tuple[int, int, int] | None = None  # device, host, storage tokens of R's rehost request
    eviction_confirmed: bool = False
    tokens_r: int = 0  # R's own requests (cold, prime, rehost, again)
    tokens_filler: int = 0  # pressure filler
    host_full: float | None = None  # highest host pool used/total seen during the probe
    pool: int | None = None  # device pool (max_total_num_tokens)
    hicache: bool | None = None
    problem: str = ""  # why there is no usable record (timeout, not JSON, ...)

    @property
    def tokens(self) -> int:
        return self.tokens_r + self.tokens_filler


def _int(x) -> int:
    try:
        return int(x or 0)
    except (TypeError, ValueError):
        return 0


def _snapshots(step: dict) -> list[dict]:
    return [s for s in (step.get("before"), step.get("after")) if isinstance(s, dict)]


def view_of(record: dict, source: str, host_total_hint: float | None = None) -> ProbeView:
    """Normalise either record shape; unknown or missing fields read as absent, never as a crash."""
    if not isinstance(record, dict) or not record.get("verdict"):
        problem = record.get("problem") if isinstance(record, dict) else None
        return ProbeView(source, None, problem=str(problem or "no verdict in the record"))
    steps = {s.get("phase"): s for s in record.get("steps") or [] if isinstance(s, dict)}
    r = _int(record.get("context_tokens"))
    rehost = None
    cached = (steps.get("rehost") or {}).get("cached")
    if isinstance(cached, dict):
        rehost = (_int(cached.get("device")), _int(cached.get("host")), _int(cached.get("storage")))
    again = (steps.get("again") or {}).get("cached")
    again_total = sum(_int(again.get(k)) for k in ("device", "host", "storage")) if isinstance(again, dict) else 0
    cacheable = again_total or max(0, r - 1)
    tokens = record.get("tokens") if isinstance(record.get("tokens"), dict) else {}
    filler = _int(record.get("tokens_pressure", tokens.get("pressure")))
    r_sent = record.get("tokens_canary", tokens.get("canary"))
    if r_sent is None:
        r_sent = sum(_int(s.get("prompt_tokens")) for p, s in steps.items() if p != "pressure")
    fulls = []
    for s in steps.values():
        for snap in _snapshots(s):
            used, total = snap.get("host_used_tokens"), snap.get("host_total_tokens")
            if used is not None and total:
                fulls.append(float(used) / float(total))
        if s.get("host_used_tokens_after") is not None and host_total_hint:  # /api/targets shape
            fulls.append(float(s["host_used_tokens_after"]) / host_total_hint)
    server = record.get("server") if isinstance(record.get("server"), dict) else {}
    hicache = server.get("enable_hierarchical_cache", server.get("hicache"))
    pressure = record.get("pressure") if isinstance(record.get("pressure"), dict) else {}
    return ProbeView(
        source=source, verdict=record.get("verdict"), cause=record.get("cause") or "none",
        evidence=str(record.get("evidence") or ""), r_tokens=r, cacheable=cacheable, rehost=rehost,
        eviction_confirmed=bool(pressure.get("eviction_confirmed")), tokens_r=_int(r_sent), tokens_filler=filler,
        host_full=max(fulls) if fulls else None, pool=_int(server.get("max_total_num_tokens")) or None,
        hicache=None if hicache is None else bool(hicache),
    )


def host_total_of(record: dict) -> float | None:
    """The host pool's size as a `probe --json` record saw it (for judging /api/targets entries)."""
    for s in record.get("steps") or []:
        for snap in _snapshots(s) if isinstance(s, dict) else []:
            if snap.get("host_total_tokens"):
                return float(snap["host_total_tokens"])
    return None


def tiers(v: ProbeView) -> str:
    if v.rehost is None:
        return "-"
    dev, host, sto = v.rehost
    return f"dev {dev:,} / host {host:,}" + (f" / storage {sto:,}" if sto else "") + f" of {v.cacheable:,}"


# ------------------------------------------------------------------ pure parts: judging


def judge(v: ProbeView, expect: Expect) -> tuple[bool, str]:
    """PASS/FAIL of one probe and why: the verdict must be expected *and* proven by its tier details."""
    if v.verdict is None:
        return False, v.problem or "no verdict"
    share = lambda n: n / v.cacheable if v.cacheable else 0.0  # noqa: E731
    dev, host, sto = v.rehost or (0, 0, 0)
    on_device = v.rehost is not None and share(dev) >= DEVICE_SHARE
    wrong_proof = f"eviction called confirmed while R stayed on device ({tiers(v)})"
    if v.verdict == "not_evicted":
        return False, "not_evicted on an idle server" + (f"; {wrong_proof}" if v.eviction_confirmed and on_device else "")
    if v.eviction_confirmed and on_device:
        return False, wrong_proof
    if v.verdict not in expect.verdicts:
        return False, f"expected {expect.label()}, got {v.verdict}" + (f" ({v.cause})" if v.cause != "none" else "")
    if v.verdict == "hicache_disabled":
        return (True, "nothing sent") if v.tokens == 0 else (False, f"hicache_disabled but {v.tokens:,} tokens sent")
    if v.rehost is None:
        return False, f"{v.verdict} without a rehost tier breakdown: nothing proves it"
    if on_device:
        return False, f"{v.verdict} while R stayed on device ({tiers(v)})"
    if v.verdict == "reused":
        ok = share(host + sto) >= HOST_SHARE
        return ok, (f"R came back from host ({share(host + sto):.0%})" if ok
                    else f"reused, but only {share(host + sto):.0%} of R came from host ({tiers(v)})")
    if v.verdict == "silent":
        if v.cause not in expect.causes:
            return False, f"silent with cause {v.cause}, expected {'/'.join(expect.causes)}"
        if share(host + sto) >= HOST_SHARE:
            return False, f"silent although {share(host + sto):.0%} of R came from host"
        if v.cause == "host_pool_pressure":
            if v.host_full is None:
                return False, "cause host_pool_pressure, but no host pool gauges in the record"
            if v.host_full < HOST_POOL_FULL:
                return False, f"cause host_pool_pressure, but the host pool was only {v.host_full:.0%} full"
            return True, f"host pool {v.host_full:.0%} full, {share(host + sto):.0%} of R from host"
        return True, f"{share(host + sto):.0%} of R from host"
    return True, v.verdict


@dataclass
class ServerResult:
    name: str
    expect: str
    views: list[ProbeView] = field(default_factory=list)
    judged: list[tuple[bool, str]] = field(default_factory=list)
    problem: str = ""  # the server never came up, etc.

    @property
    def passed(self) -> bool:
        return not self.problem and bool(self.judged) and all(ok for ok, _ in self.judged)


def judge_server(name: str, views: list[ProbeView], minimum: int, problem: str = "") -> ServerResult:
    spec = BY_NAME.get(name)
    res = ServerResult(name, spec.expect.label() if spec else "?", views, problem=problem)
    if spec is None:
        res.problem = res.problem or "not in SERVERS: no expectation"
        return res
    res.judged = [judge(v, spec.expect) for v in views]
    if not res.problem and len(views) < minimum:
        res.problem = f"{len(views)} probes of {minimum}"
    return res


# ------------------------------------------------------------------ pure parts: tables


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def short(text: str, n: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def probe_rows(results: list[ServerResult]) -> list[list[str]]:
    rows = []
    for res in results:
        if res.problem and not res.views:
            rows.append([res.name, "-", res.expect, "-", "-", "-", "-", "FAIL", short(res.problem)])
        for i, (v, (ok, why)) in enumerate(zip(res.views, res.judged), 1):
            rows.append([res.name, str(i), res.expect, v.verdict or "none", v.cause, tiers(v),
                         f"{v.tokens_r:,} + {v.tokens_filler:,}", "PASS" if ok else "FAIL",
                         short(why if not ok else f"{why}; {v.evidence or v.problem}")])
    return rows


def summary_rows(results: list[ServerResult]) -> list[list[str]]:
    rows = []
    for res in results:
        got = " ".join(v.verdict or "none" for v in res.views) or "-"
        n_ok = sum(ok for ok, _ in res.judged)
        rows.append([res.name, res.expect, short(got, 120), f"{n_ok}/{len(res.views)}",
                     "PASS" if res.passed else "FAIL", short(res.problem, 60)])
    return rows


def cost_rows(results: list[ServerResult]) -> list[list[str]]:
    """Canary tokens per probe against the seed's manual method (13 R) and a pool of turnover + 3 R."""
    rows = []
    for res in results:
        spent = [v for v in res.views if v.verdict in ("reused", "silent", "not_evicted", "inconclusive") and v.tokens]
        if not spent:
            continue
        r = max(v.r_tokens for v in spent)
        pool = max((v.pool for v in spent if v.pool), default=0)
        mean = sum(v.tokens for v in spent) / len(spent)
        manual, floor = MANUAL_MULTIPLE * r, pool + FLOOR_R_SENDS * r
        rows.append([res.name, str(len(spent)), f"{r:,}", f"{pool:,}", f"{mean:,.0f}", f"{manual:,}", f"{mean / manual:.2f}",
                     f"{floor:,}", f"{mean / floor:.2f}" if pool else "-"])
    return rows


# ------------------------------------------------------------------ IO helpers (bounded)


def http_get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError) as e:
        return None, str(e)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child of ours that exited stays a zombie until reaped: reap it so it reads as gone.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(pids: list[int], grace_s: float = 20.0) -> None:
    """SIGTERM the process groups we started (SGLang's scheduler and detokenizer are in them), then SIGKILL.

    By group id, which is the PID we started with a session of its own: never by name (a `pkill -f`
    pattern matches the caller's own shell too).
    """
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(alive(pid) for pid in pids):
        time.sleep(0.5)
    for pid in pids:  # stragglers, and children whose leader already left
        _signal_group(pid, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(alive(pid) for pid in pids):
        time.sleep(0.2)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tail(path: Path, lines: int = 300) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
    except OSError as e:
        return f"(no log: {e})\n"


# ------------------------------------------------------------------ state


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out).resolve()
        self.state_path = self.out / "state.json"
        self.canary = shlex.split(args.canary)
        self.python = args.python

    def load(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {"servers": {}}

    def save(self, state: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_path)

    def selected(self) -> list[ServerSpec]:
        if not self.args.only:
            return list(SERVERS)
        names = [n.strip() for n in self.args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            sys.exit(f"--only: unknown server(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
        return [BY_NAME[n] for n in names]

    def url(self, srv: dict) -> str:
        return f"http://127.0.0.1:{srv['port']}"

    # -------------------------------------------------------------- start

    def build_models(self, kinds: set[str]) -> dict[str, str]:
        paths = {}
        for kind in sorted(kinds):
            path = Path(self.args.model_dir) / f"tiny-{kind}"
            paths[kind] = str(path)
            if (path / "config.json").exists():
                continue
            log(f"building the tiny {kind} model in {path}")
            cmd = [self.python, str(HERE / "real_sglang" / "make_tiny.py"), kind, str(path), "32768"]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            (self.out / f"make_tiny_{kind}.log").write_text(p.stdout + p.stderr)
            if p.returncode != 0:
                sys.exit(f"building the {kind} model failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
        return paths

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state = self.load()
        specs = self.selected()
        state.setdefault("started_at", time.time())
        state["sglang_version"] = self.sglang_version()
        state["gpu_before"] = self.gpu_memory()
        if any((self.out / "probes").glob("*/probe_*.json")):
            log(f"warning: {self.out}/probes already holds probes of an earlier run; they count towards --probes")
        models = self.build_models({s.model for s in specs})
        for i, spec in enumerate(specs):
            if i and self.args.stagger:
                time.sleep(self.args.stagger)
            old = state["servers"].get(spec.name)
            if old and alive(old["pid"]):
                log(f"{spec.name}: already running (pid {old['pid']}, port {old['port']})")
                continue
            port = self.args.base_port + SERVERS.index(spec)
            cmd = server_command(spec, port, models[spec.model], self.python, self.args.mem_fraction)
            sdir = self.out / "servers" / spec.name
            sdir.mkdir(parents=True, exist_ok=True)
            logf = open(sdir / "server.log", "ab")
            # A session of its own: it outlives this call (setsid), and one killpg stops all its processes.
            p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
            logf.close()
            state["servers"][spec.name] = {"pid": p.pid, "port": port, "model": spec.model, "cmd": cmd,
                                           "started_at": time.time(), "healthy_at": None, "problem": ""}
            log(f"{spec.name}: pid {p.pid} port {port} {' '.join(spec.flags) or '(no HiCache)'}")
            self.save(state)
        self.save(state)
        self.wait_healthy(self.args.health_timeout)

    def wait_healthy(self, timeout_s: float) -> None:
        state = self.load()
        end = time.monotonic() + timeout_s
        pending = {n for n, s in state["servers"].items() if not s.get("healthy_at") and not s.get("problem")}
        while pending and time.monotonic() < end:
            for name in sorted(pending):
                srv = state["servers"][name]
                if http_get(self.url(srv) + "/health", timeout=5)[0] == 200:
                    srv["healthy_at"] = time.time()
                    log(f"{name}: healthy after {srv['healthy_at'] - srv['started_at']:.0f} s")
                    pending.discard(name)
                elif not alive(srv["pid"]):
                    srv["problem"] = "server exited before /health answered (see log_tail.txt)"
                    log(f"{name}: {srv['problem']}")
                    pending.discard(name)
            self.save(state)
            if pending:
                time.sleep(3)
        for name in pending:
            log(f"{name}: no /health within {timeout_s:.0f} s (still starting?)")
        state["gpu_after_start"] = self.gpu_memory()
        self.save(state)

    def sglang_version(self) -> str:
        try:
            p = subprocess.run([self.python, "-c", "import sglang; print(sglang.__version__)"],
                               capture_output=True, text=True, timeout=120)
            return p.stdout.strip() or f"unknown ({p.stderr.strip().splitlines()[-1:] or ''})"
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unknown ({e})"

    def gpu_memory(self) -> str:
        try:
            p = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=15)
            return p.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unknown ({e})"

    # -------------------------------------------------------------- probe

    def healthy(self) -> dict[str, dict]:
        state = self.load()
        if any(not s.get("healthy_at") and not s.get("problem") for s in state["servers"].values()):
            # start already waited its full timeout; a later call gives stragglers one more minute only
            self.wait_healthy(min(60.0, self.args.health_timeout))
            state = self.load()
        return {n: s for n, s in state["servers"].items() if s.get("healthy_at") and alive(s["pid"])}

    def probe(self) -> None:
        servers = self.healthy()
        if not servers:
            log("no healthy server to probe (run --phase start first)")
            return
        deadline = time.monotonic() + self.args.probe_budget
        threads = [threading.Thread(target=self.probe_server, args=(n, s, deadline), daemon=True)
                   for n, s in servers.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 75)
        for name, srv in servers.items():
            self.snapshot_server(name, srv, "after_probes")

    def probe_server(self, name: str, srv: dict, deadline: float) -> None:
        pdir = self.out / "probes" / name
        pdir.mkdir(parents=True, exist_ok=True)
        while time.monotonic() < deadline:
            n = len(list(pdir.glob("probe_*.json"))) + 1
            if n > self.args.probes:
                return
            cmd = [*self.canary, "probe", "--target", self.url(srv), "--json"]
            t0 = time.monotonic()
            # A probe started near the end of the budget may overrun it by a minute at most.
            limit = max(30.0, min(self.args.probe_timeout, deadline - t0 + 60))
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
                rc, out, err = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
                rc, out, err = None, "", f"probe ran past {limit:.0f} s\n{stderr}"
            except OSError as e:
                rc, out, err = None, "", f"cannot start {cmd[0]}: {e}"
            wall = time.monotonic() - t0
            try:
                record = json.loads(out)
            except ValueError:
                record = {"verdict": None, "problem": short(err.strip().splitlines()[-1] if err.strip() else "no output", 200)}
            record["bench"] = {"exit_code": rc, "wall_s": round(wall, 2), "command": cmd}
            (pdir / f"probe_{n:02d}.json").write_text(json.dumps(record, indent=1))
            (pdir / f"probe_{n:02d}.stderr.txt").write_text(err)
            log(f"{name} probe {n}: {record.get('verdict')} ({record.get('cause', '')}) in {wall:.1f} s")
        log(f"{name}: probe budget spent after {len(list(pdir.glob('probe_*.json')))} probes")

    def snapshot_server(self, name: str, srv: dict, when: str) -> None:
        sdir = self.out / "servers" / name
        sdir.mkdir(parents=True, exist_ok=True)
        code, body = http_get(self.url(srv) + "/metrics", timeout=10)
        (sdir / f"metrics_{when}.txt").write_text(body if code == 200 else f"(GET /metrics: {code} {body})\n")
        code, body = http_get(self.url(srv) + "/server_info", timeout=10)
        if code == 200:
            (sdir / "server_info.json").write_text(body)

    # -------------------------------------------------------------- serve

    def serve(self) -> None:
        servers = self.healthy()
        if not servers:
            log("no healthy server for the exporter (run --phase start first)")
            return
        edir = self.out / "exporter"
        edir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cfg = edir / "hicache-canary.yml"
        cfg.write_text(exporter_config([(n, s["port"]) for n, s in servers.items()], port, self.args.interval))
        logf = open(edir / "exporter.log", "ab")
        p = subprocess.Popen([*self.canary, "serve", "--config", str(cfg)], stdout=logf, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()
        base = f"http://127.0.0.1:{port}"
        log(f"exporter: pid {p.pid} on {base}, interval {self.args.interval} s, {len(servers)} targets")
        try:
            end = time.monotonic() + self.args.serve_budget
            body = ""
            while time.monotonic() < end and p.poll() is None:
                code, body = http_get(base + "/api/targets", timeout=10)
                if code == 200 and self.rounds_done(body) >= self.args.rounds:
                    break
                time.sleep(5)
            if p.poll() is not None:
                log(f"exporter exited with {p.returncode} (see exporter/exporter.log)")
            code, body = http_get(base + "/api/targets", timeout=10)
            (edir / "api_targets.json").write_text(body if code == 200 else json.dumps({"problem": f"{code} {body}"}))
            code, body = http_get(base + "/metrics", timeout=10)
            (edir / "metrics.txt").write_text(body if code == 200 else f"(GET /metrics: {code} {body})\n")
            log(f"exporter: {self.rounds_done((edir / 'api_targets.json').read_text())} rounds on every target")
        finally:
            stop_groups([p.pid], grace_s=10)
        for name, srv in servers.items():
            self.snapshot_server(name, srv, "after_serve")

    @staticmethod
    def rounds_done(body: str) -> int:
        try:
            targets = json.loads(body)["targets"]
            return min(len([h for h in t.get("history") or [] if h.get("finished_at")]) for t in targets)
        except (ValueError, KeyError, TypeError):
            return 0

    # -------------------------------------------------------------- stop, report, archive

    def stop(self) -> None:
        state = self.load()
        running = {n: s for n, s in state["servers"].items() if alive(s["pid"])}
        for name, srv in running.items():
            if srv.get("healthy_at"):
                self.snapshot_server(name, srv, "at_stop")
        names = ", ".join(f"{n} (pid {s['pid']})" for n, s in running.items())
        log(f"stopping {names or 'nothing'}")
        stop_groups([s["pid"] for s in state["servers"].values()])
        for name, srv in state["servers"].items():
            srv.setdefault("stopped_at", time.time())
            sdir = self.out / "servers" / name
            sdir.mkdir(parents=True, exist_ok=True)
            (sdir / "log_tail.txt").write_text(tail(sdir / "server.log"))
        state["gpu_after_stop"] = self.gpu_memory()
        self.save(state)

    def report(self) -> bool:
        state = self.load()
        names = list(state["servers"]) or sorted(p.name for p in (self.out / "probes").glob("*") if p.is_dir())
        for extra in sorted(p.name for p in (self.out / "probes").glob("*") if p.is_dir()):
            if extra not in names:
                names.append(extra)
        host_totals: dict[str, float] = {}
        probe_results = []
        for name in names:
            views = []
            for f in sorted((self.out / "probes" / name).glob("probe_*.json")):
                try:
                    rec = json.loads(f.read_text())
                except ValueError as e:
                    rec = {"verdict": None, "problem": f"not JSON: {e}"}
                views.append(view_of(rec, f.name))
                total = host_total_of(rec) if isinstance(rec, dict) else None
                if total and name not in host_totals:
                    host_totals[name] = total
            problem = (state["servers"].get(name) or {}).get("problem", "")
            probe_results.append(judge_server(name, views, self.args.probes, problem))
        serve_results = self.serve_results(host_totals)
        text = self.render(state, probe_results, serve_results)
        print(text)
        (self.out / "report.txt").write_text(text + "\n")
        verdict = all(r.passed for r in probe_results) and all(r.passed for r in serve_results)
        (self.out / "report.json").write_text(json.dumps({
            "passed": verdict, "sglang_version": state.get("sglang_version"),
            "probes": [{"server": r.name, "passed": r.passed, "problem": r.problem,
                        "probes": [dict(asdict(v), ok=ok, why=why) for v, (ok, why) in zip(r.views, r.judged)]}
                       for r in probe_results],
            "serve": [{"server": r.name, "passed": r.passed, "problem": r.problem,
                       "rounds": [dict(asdict(v), ok=ok, why=why) for v, (ok, why) in zip(r.views, r.judged)]}
                      for r in serve_results],
        }, indent=1))
        return verdict

    def serve_results(self, host_totals: dict[str, float]) -> list[ServerResult]:
        path = self.out / "exporter" / "api_targets.json"
        if not path.exists():
            return []
        try:
            targets = json.loads(path.read_text())["targets"]
        except (ValueError, KeyError, TypeError):
            return [ServerResult("exporter", "-", problem="exporter/api_targets.json is not /api/targets output")]
        exported = exported_verdicts((self.out / "exporter" / "metrics.txt").read_text(errors="replace")
                                     if (self.out / "exporter" / "metrics.txt").exists() else "")
        results = []
        for t in targets:
            name = (t.get("config") or {}).get("name", "?")
            hist = sorted((h for h in t.get("history") or [] if h.get("finished_at")), key=lambda h: h["started_at"])
            views = [view_of(h, f"round {i}", host_totals.get(name)) for i, h in enumerate(hist, 1)]
            res = judge_server(name, views, self.args.rounds)
            state_verdict = (t.get("state") or {}).get("verdict")
            if not res.problem and exported.get(name) != state_verdict:
                res.problem = f"/metrics says {exported.get(name)}, /api/targets says {state_verdict}"
            results.append(res)
        return results

    def render(self, state: dict, probes: list[ServerResult], serve: list[ServerResult]) -> str:
        out = [f"real SGLang conformance: sglang {state.get('sglang_version', '?')}, "
               f"GPU {state.get('gpu_before', '?')}", ""]
        out += ["expectations (SERVERS in bench/real_sglang.py):",
                table(["server", "model", "flags", "expected"],
                      [[s.name, s.model, " ".join(s.flags) or "(HiCache off)", s.expect.label()] for s in SERVERS]), ""]
        out += ["consecutive `hicache-canary probe --json` (R sends + filler = tokens of one probe):",
                table(["server", "#", "expected", "verdict", "cause", "rehost tiers of R", "tokens R + filler", "",
                       "why / evidence"], probe_rows(probes)), ""]
        out += ["per server:", table(["server", "expected", "verdicts in order", "right", "", "problem"],
                                     summary_rows(probes)), ""]
        if serve:
            out += ["`hicache-canary serve`, scheduled rounds (from /api/targets history):",
                    table(["target", "#", "expected", "verdict", "cause", "rehost tiers of R", "tokens R + filler", "",
                           "why / evidence"], probe_rows(serve)), "",
                    table(["target", "expected", "verdicts in order", "right", "", "problem"], summary_rows(serve)), ""]
        else:
            out += ["`hicache-canary serve`: not run yet (no exporter/api_targets.json)", ""]
        costs = cost_rows(probes)
        if costs:
            out += ["tokens per probe against the seed's manual method (R + 10 R + 2 R) and one device pool of "
                    "turnover + 3 R:",
                    table(["server", "probes", "R", "device pool", "canary mean", "manual 13 R", "canary/manual",
                           "pool + 3 R", "canary/floor"], costs), ""]
        ok = all(r.passed for r in probes) and all(r.passed for r in serve)
        n_fail = sum(not r.passed for r in probes + serve)
        out.append("RESULT: PASS" if ok and probes else f"RESULT: FAIL ({n_fail} row(s) failed)" if n_fail
                   else "RESULT: INCOMPLETE (no probes yet)")
        return "\n".join(out)

    def archive(self) -> Path:
        path = Path(self.args.archive).resolve() if self.args.archive else self.out.with_suffix(".tgz")
        tmp = path.with_name(path.name + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:  # what `tar czf` writes
            # full server logs stay out (log_tail.txt is in): a handful of MB per server is noise here
            tar.add(self.out, arcname=self.out.name, filter=lambda ti: None if ti.name.endswith("/server.log") else ti)
        tmp.replace(path)
        log(f"archive: {path} ({path.stat().st_size / 1024:.0f} KiB)")
        return path


def exported_verdicts(metrics: str) -> dict[str, str]:
    """target -> the verdict whose `hicache_canary_verdict` series is 1 in the exporter's /metrics."""
    out = {}
    for m in re.finditer(r'^hicache_canary_verdict\{target="([^"]+)",verdict="([^"]+)"\} 1(?:\.0)?\s*$', metrics, re.M):
        out[m.group(1)] = m.group(2)
    return out


# ------------------------------------------------------------------ CLI


PHASES = ("all", "start", "probe", "serve", "stop", "report")


def phases(text: str) -> list[str]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in chosen if x not in PHASES]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: phases are {', '.join(PHASES)}")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--phase", type=phases, default=["all"],
                   help="all, start, probe, serve, stop or report, or several comma-separated (probe,serve); "
                        "all = start,probe,serve; serve and all stop the servers afterwards unless --keep-servers; "
                        "every call ends with the report and the archive")
    p.add_argument("--dry-run", action="store_true", help="print the plan (commands, exporter config) and exit")
    p.add_argument("--out", default="real-sglang-run", help="output folder (default ./real-sglang-run)")
    p.add_argument("--archive", default=None, help="tar.gz of the output folder (default <out>.tgz)")
    p.add_argument("--python", default="python3", help="the python that has SGLang installed (default python3)")
    p.add_argument("--canary", default="hicache-canary", help="the hicache-canary command (default hicache-canary)")
    p.add_argument("--model-dir", default="/tmp/hicache-canary-tiny-models", help="where the tiny models are built")
    p.add_argument("--only", default="", help="comma-separated server names from SERVERS (default all)")
    p.add_argument("--base-port", type=int, default=30001, help="first server's port; the others follow")
    p.add_argument("--mem-fraction", type=float, default=0.1, help="--mem-fraction-static of each server")
    p.add_argument("--stagger", type=float, default=0.0, help="seconds between server starts (default 0: all at once)")
    p.add_argument("--health-timeout", type=float, default=420.0, help="seconds to wait for /health (first start compiles kernels)")
    p.add_argument("--probes", type=int, default=10, help="consecutive probes per server (default 10)")
    p.add_argument("--probe-timeout", type=float, default=180.0, help="seconds one probe may take")
    p.add_argument("--probe-budget", type=float, default=240.0, help="seconds for the whole probe phase")
    p.add_argument("--interval", type=int, default=20, help="exporter probe interval in seconds")
    p.add_argument("--rounds", type=int, default=3, help="scheduled rounds the exporter must finish on every target")
    p.add_argument("--serve-budget", type=float, default=180.0, help="seconds the exporter may run")
    p.add_argument("--keep-servers", action="store_true", help="leave the servers running after serve/all")
    return p.parse_args(argv)


def dry_run(run: Run) -> None:
    specs = run.selected()
    print("models:")
    for kind in sorted({s.model for s in specs}):
        print("  " + shlex.join([run.python, str(HERE / "real_sglang" / "make_tiny.py"), kind,
                                 str(Path(run.args.model_dir) / f"tiny-{kind}"), "32768"]))
    print("servers (each in its own session, log in <out>/servers/<name>/server.log):")
    for spec in specs:
        port = run.args.base_port + SERVERS.index(spec)
        print(f"  {spec.name}: " + shlex.join(server_command(spec, port, str(Path(run.args.model_dir) / f"tiny-{spec.model}"),
                                                            run.python, run.args.mem_fraction)))
    print(f"probes: {run.args.probes} x per server, one at a time: {shlex.join([*run.canary, 'probe', '--target', 'URL', '--json'])}")
    print("exporter config:")
    cfg = exporter_config([(s.name, run.args.base_port + SERVERS.index(s)) for s in specs], 0, run.args.interval)
    print("  " + cfg.replace("\n", "\n  ").rstrip())
    print("expectations:")
    print(table(["server", "expected", "note"], [[s.name, s.expect.label(), s.expect.note] for s in specs]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    if args.dry_run:
        dry_run(run)
        return 0
    run.out.mkdir(parents=True, exist_ok=True)
    chosen = set(args.phase)
    if "all" in chosen:
        chosen |= {"start", "probe", "serve"}
    t0 = time.monotonic()
    try:
        if "start" in chosen:
            run.start()
        if "probe" in chosen:
            run.probe()
        if "serve" in chosen:
            run.serve()
    finally:
        if "stop" in chosen or ("serve" in chosen and not args.keep_servers):
            run.stop()
        else:  # still running: the tails so far go into this call's archive anyway
            for name in run.load()["servers"]:
                sdir = run.out / "servers" / name
                sdir.mkdir(parents=True, exist_ok=True)
                (sdir / "log_tail.txt").write_text(tail(sdir / "server.log"))
    if chosen == {"start"}:
        state = run.load()
        status = [[n, str(s["port"]), str(s["pid"]), "healthy" if s.get("healthy_at") else s.get("problem") or "not healthy"]
                  for n, s in state["servers"].items()]
        print(table(["server", "port", "pid", "status"], status))
        ok = bool(status) and all(r[3] == "healthy" for r in status)
    else:
        ok = run.report()
    run.archive()
    log(f"phase {','.join(args.phase)} took {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
