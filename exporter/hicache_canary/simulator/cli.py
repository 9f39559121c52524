"""`hicache-canary sim`: launch flags (SGLang's names where SGLang has them) -> SimConfig -> uvicorn.

Bad flags end with one line on stderr naming what is wrong and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import copy
import sys

from .cache import HYBRID_FAILURES, WRITE_POLICIES
from .config import PROFILES, Faults, SimConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("SGLang launch flags")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--ports", default=None, metavar="LIST",
                   help="simulator-only: one independent server per port, e.g. 31000-31199 or 40001,40005 (overrides --port)")
    g.add_argument("--model-path", default="Qwen3.8-27B-abliterated-AWQ-MTP")
    g.add_argument("--served-model-name", default="Qwen3.8-27B-AWQ")
    g.add_argument("--tp-size", type=int, default=1, help="TP ranks: radix-cache series repeat on every rank")
    g.add_argument("--dp-size", type=int, default=1, help="only 1 is modelled")
    g.add_argument("--page-size", type=int, default=1)
    g.add_argument("--max-total-tokens", type=int, default=400000, help="device KV pool in tokens")
    g.add_argument("--context-length", type=int, default=262144)
    g.add_argument("--chunked-prefill-size", type=int, default=4096)
    g.add_argument("--max-running-requests", type=int, default=8)
    g.add_argument("--enable-hierarchical-cache", action="store_true")
    g.add_argument("--hicache-write-policy", choices=WRITE_POLICIES, default="write_through")
    g.add_argument("--hicache-ratio", type=float, default=2.0, help="host pool = ratio x device pool (when no size)")
    g.add_argument("--hicache-size", type=float, default=0.0, help="host pool in GB per rank (16 KiB per token)")
    g.add_argument("--max-mamba-cache-size", type=int, default=15, help="device Mamba state slots (hybrid)")
    g.add_argument("--enable-metrics", action="store_true")
    g.add_argument("--enable-cache-report", action="store_true")
    g.add_argument("--api-key", default=None)
    g.add_argument("--speculative-algorithm", default=None)
    s = parser.add_argument_group("simulator-only flags")
    s.add_argument("--hicache-host-tokens", type=int, default=None,
                   help="host pool in tokens (overrides --hicache-size and --hicache-ratio)")
    s.add_argument("--hybrid-model", action="store_true", help="a hybrid GDN/Mamba model (UnifiedRadixCache + Mamba)")
    s.add_argument("--hybrid-failure", choices=HYBRID_FAILURES, default="mamba_state_not_backed_up",
                   help="which silent failure the simulated build has (none = a fixed build)")
    s.add_argument("--hicache-mamba-states", type=int, default=None,
                   help="host Mamba pool slots (default 30; 4 under host_mamba_pool_small)")
    s.add_argument("--metrics-profile", choices=PROFILES, default="0.5.23")
    s.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per simulated second")
    s.add_argument("--warmup-seconds", type=float, default=10.0,
                   help="kernel warm-up paid by a fresh server's first request (simulated s; live 0.5.17: ~10)")
    s.add_argument("--latency-jitter", type=float, default=0.0, help="+- fraction of each request's latency")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--background-rps", type=float, default=0.0, help="the server's own traffic (simulated rps)")
    s.add_argument("--background-context-tokens", type=int, default=2048)
    f = parser.add_argument_group("fault switches (also settable at runtime: POST /_sim/faults)")
    f.add_argument("--fault-down-after", type=int, default=None, help="stop serving after N generate requests")
    f.add_argument("--fault-5xx-rate", type=float, default=0.0)
    f.add_argument("--fault-429-rate", type=float, default=0.0)
    f.add_argument("--fault-slow", type=float, default=0.0, metavar="SECONDS", help="wall seconds added per reply")
    f.add_argument("--fault-malformed-json", action="store_true")
    f.add_argument("--fault-metrics-missing", action="store_true", help="drop radix-cache/hicache families")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Raises ValueError with one line naming every bad flag."""
    faults = Faults(down_after=args.fault_down_after, rate_5xx=args.fault_5xx_rate, rate_429=args.fault_429_rate,
                    slow_s=args.fault_slow, malformed_json=args.fault_malformed_json,
                    metrics_missing=args.fault_metrics_missing)
    for name, rate in (("--fault-5xx-rate", faults.rate_5xx), ("--fault-429-rate", faults.rate_429)):
        if not 0 <= rate <= 1:
            raise ValueError(f"{name} must be a fraction in [0, 1]")
    return SimConfig(
        host=args.host, port=args.port, model_path=args.model_path, served_model_name=args.served_model_name,
        tp_size=args.tp_size, dp_size=args.dp_size, page_size=args.page_size, max_total_tokens=args.max_total_tokens,
        context_length=args.context_length, chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests, enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_write_policy=args.hicache_write_policy, hicache_ratio=args.hicache_ratio,
        hicache_size=args.hicache_size, hicache_host_tokens=args.hicache_host_tokens, hybrid_model=args.hybrid_model,
        hybrid_failure=args.hybrid_failure, hicache_mamba_states=args.hicache_mamba_states,
        max_mamba_cache_size=args.max_mamba_cache_size, enable_metrics=args.enable_metrics,
        enable_cache_report=args.enable_cache_report, api_key=args.api_key,
        speculative_algorithm=args.speculative_algorithm, metrics_profile=args.metrics_profile,
        time_scale=args.time_scale, warmup_seconds=args.warmup_seconds, latency_jitter=args.latency_jitter, seed=args.seed,
        background_rps=args.background_rps, background_context_tokens=args.background_context_tokens, faults=faults,
    )


class _FlagError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    """Raises instead of exiting, so /_sim/restart can answer 400 with argparse's message."""

    def error(self, message):
        raise _FlagError(message)


def reparser(base: argparse.Namespace):
    """A function turning extra launch flags into a new config, starting from `base`'s values."""

    def reparse(extra: list[str]) -> SimConfig:
        parser = _Parser(prog="hicache-canary sim", add_help=False)
        add_arguments(parser)
        # argparse leaves attributes already on the namespace alone: only the given flags change.
        return config_from_args(parser.parse_args(extra, namespace=copy.copy(base)))

    return reparse


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"hicache-canary sim: error: {exc}", file=sys.stderr)
        return 2
    if args.ports:
        return run_fleet(args, cfg)
    import uvicorn

    from .app import create_app

    app = create_app(cfg, reparse=reparser(args))
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=1))

    def shutdown() -> None:
        server.should_exit = True

    app.state.sim.shutdown = shutdown
    print(f"hicache-canary sim: SGLang {cfg.metrics_profile} simulator on http://{cfg.host}:{cfg.port} "
          f"(hicache={'on' if cfg.enable_hierarchical_cache else 'off'}, policy={cfg.hicache_write_policy}, "
          f"hybrid={cfg.hybrid_model}, time_scale={cfg.time_scale})", flush=True)
    try:
        server.run()
    except OSError as exc:  # e.g. the port is taken
        print(f"hicache-canary sim: error: cannot serve on {cfg.host}:{cfg.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def run_fleet(args: argparse.Namespace, base: SimConfig) -> int:
    """`--ports`: one uvicorn server on every port, each port its own simulated server."""
    import socket

    import uvicorn

    from .app import create_app
    from .fleet import PortDispatch, fleet_configs, parse_ports

    try:
        ports = parse_ports(args.ports)
    except ValueError as exc:
        print(f"hicache-canary sim: error: {exc}", file=sys.stderr)
        return 2
    sockets = []
    try:
        for p in ports:
            sock = socket.socket(socket.AF_INET6 if ":" in base.host else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sockets.append(sock)
            sock.bind((base.host, p))
    except OSError as exc:
        print(f"hicache-canary sim: error: cannot serve on {base.host}:{p}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    apps = {c.port: create_app(c) for c in fleet_configs(base, ports)}
    server = uvicorn.Server(uvicorn.Config(PortDispatch(apps), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=1, lifespan="on"))

    def shutdown() -> None:
        server.should_exit = True

    for app in apps.values():
        app.state.sim.shutdown = shutdown
    print(f"hicache-canary sim: {len(ports)} SGLang {base.metrics_profile} simulators on http://{base.host}:"
          f"{ports[0]}..{ports[-1]} (hicache={'on' if base.enable_hierarchical_cache else 'off'}, "
          f"policy={base.hicache_write_policy}, hybrid={base.hybrid_model}, time_scale={base.time_scale})", flush=True)
    server.run(sockets=sockets)
    return 0
