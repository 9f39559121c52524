"""`hicache-canary check-config FILE`: validate an exporter config and exit.

Exit 0 with a one-line summary, or 2 with one line per problem (never a traceback), the same
check `serve` runs before it starts anything.
"""

from __future__ import annotations

import argparse
import os
import sys

from hicache_canary.settings.config import ConfigError, Settings, load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="FILE", help="exporter config (YAML); HICACHE_CANARY_* env overrides apply")


def summary(settings: Settings) -> str:
    names = ", ".join(t.name for t in settings.targets) or "none"
    on = settings.discovery_names
    docker = f"{' + '.join(on)} discovery on" if on else "no discovery"
    if settings.shard.count > 1:
        docker += f", shard {settings.shard}"
    api = "probe API enabled" if settings.probe_api_token else "probe API disabled (no token)"
    return (
        f"config OK: {len(settings.targets)} target(s) ({names}), {docker}, "
        f"listen {settings.listen_host}:{settings.listen_port}, {api}"
    )


def report(exc: ConfigError) -> None:
    """One line per problem on stderr, nothing else: easy to read in `docker logs` and to grep."""
    for line in exc.problems:
        print(line, file=sys.stderr)


def load_or_report(path: str | None) -> Settings | None:
    """The settings, or None after reporting every problem (exit 2: the caller's to return)."""
    try:
        return load_settings(path, os.environ)
    except ConfigError as exc:
        report(exc)
        return None


def run(args: argparse.Namespace) -> int:
    settings = load_or_report(args.config)
    if settings is None:
        return 2
    print(summary(settings))
    return 0
