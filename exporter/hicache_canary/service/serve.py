"""`hicache-canary serve`: load the config, wire scheduler + collector + app, run uvicorn (one worker).

A bad config exits 2 with one line per problem before anything starts. The probe function is
canary.run_probe and clients are SGLangClient; both are named here only (and imported only by the
probe worker process, probe_worker.py), so the rest of the exporter can be tested with fakes. Logs carry target names, verdicts and reasons, never an API
key or the probe token.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from hicache_canary.settings.config import ConfigError, Settings, Target, load_settings

log = logging.getLogger("hicache_canary.service.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=os.environ.get("HICACHE_CANARY_CONFIG"),
                        help="exporter config (YAML); without it, HICACHE_CANARY_TARGET_URL etc. from the environment")
    parser.add_argument("--host", help="listen address (overrides listen.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _client_factory(target: Target) -> Any:
    from hicache_canary.probe.sglang_client import SGLangClient

    key = target.api_key.get_secret_value() if target.api_key else None
    return SGLangClient(target.url, api_key=key)


async def _estimate(client: Any, target: Target) -> int:
    """Tokens the next probe will send on an idle server (the budget check); raises if unreachable."""
    from hicache_canary.probe.pressure import estimate_probe_tokens
    from hicache_canary.probe.sglang_client import SGLangError

    facts = await client.server_info()
    try:
        snap = await client.metrics()
    except SGLangError:
        snap = None  # metrics disabled: estimate from /server_info alone
    return estimate_probe_tokens(target.probe, facts, snap)


def build(settings: Settings, config_path: str | None = None, env: Mapping[str, str] = os.environ) -> Any:
    """The ASGI app for these settings, with the real canary behind it; SIGHUP re-reads
    `config_path` (and `env`) as load_settings did for `settings`."""
    from prometheus_client import CollectorRegistry

    from hicache_canary.service.app import create_app
    from hicache_canary.service.collector import CanaryCollector
    from hicache_canary.service.config_reload import ConfigReloader
    from hicache_canary.service.scheduler import Scheduler
    from hicache_canary.service.sharding import ShardView

    shard = ShardView(settings.shard)
    # By name: only the probe worker process imports the canary, httpx and the SGLang parsers.
    scheduler = Scheduler(
        [],
        "hicache_canary.probe.canary:run_probe",
        "hicache_canary.service.serve:_client_factory",
        estimate_fn="hicache_canary.service.serve:_estimate",
        max_concurrent=settings.max_concurrent_probes,
        probe_spacing=settings.probe_spacing,
        history_limit=settings.history_limit,
        secrets=settings.secrets(),
        offload=True,
    )
    reloader = ConfigReloader(config_path, env, settings, scheduler, shard)
    for t in reloader.targets:  # the static targets, this replica's share of them
        scheduler.add_target(t)
    registry = CollectorRegistry(auto_describe=True)
    collector = CanaryCollector(scheduler.snapshot, lambda: reloader.status)
    registry.register(collector)
    sources: list[Any] = []
    if settings.docker is not None:
        from hicache_canary.service.discovery import DockerDiscovery

        sources.append(DockerDiscovery(settings, scheduler, shard))
    if settings.prometheus_sd is not None or settings.file_sd is not None:
        from hicache_canary.service.prometheus_sd import FileSDDiscovery, PrometheusDiscovery

        if settings.file_sd is not None:
            sources.append(FileSDDiscovery(settings, scheduler, shard))
        if settings.prometheus_sd is not None:
            sources.append(PrometheusDiscovery(settings, scheduler, shard))
    return create_app(settings, scheduler, registry, background=[d.run for d in sources], discovery=sources, shard=shard,
                      collector=collector, reloader=reloader)


def run(args: argparse.Namespace) -> int:
    from hicache_canary.commands.config_cli import report

    try:
        settings = load_settings(args.config, os.environ)
    except ConfigError as exc:
        report(exc)
        return 2
    if args.port is not None and not 1 <= args.port <= 65535:
        print(f"--port: {args.port} is not a port number", file=sys.stderr)
        return 2
    import uvicorn

    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a line per /metrics poll of every probe drowns the verdicts
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    # Probes run in their own process (probe_worker.py); what threads remain here (gzip of a large
    # /metrics, docker discovery) hand the GIL back to the serving loop every 1 ms, not 5.
    sys.setswitchinterval(0.001)
    host = args.host or settings.listen_host
    port = args.port or settings.listen_port
    found_by = [n for n, on in (("docker", settings.docker), ("prometheus", settings.prometheus_sd), ("file_sd", settings.file_sd)) if on]
    log.info(
        "serving on http://%s:%d: %d target(s) [%s]%s%s; probe API %s",
        host,
        port,
        len(settings.targets),
        ", ".join(f"{t.name}={t.url}" for t in settings.targets),
        f", discovery: {', '.join(found_by)}" if found_by else "",
        f", shard {settings.shard}" if settings.shard.count > 1 else "",
        "enabled" if settings.probe_api_token else "disabled (no token)",
    )
    config = uvicorn.Config(
        build(settings, args.config, os.environ),
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        lifespan="on",
        workers=1,
        timeout_graceful_shutdown=5,
        server_header=False,
    )
    server = uvicorn.Server(config)
    # Everything imported and built so far lives as long as the process. A full collection walks it
    # all (~60,000 objects: 15-20 ms, during which no scrape is answered); frozen, the collector
    # only walks what the exporter creates from now on.
    import gc

    gc.collect()
    gc.freeze()
    server.run()
    return 0 if server.started else 1
