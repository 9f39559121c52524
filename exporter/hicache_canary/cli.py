"""`hicache-canary` entry point: dispatches to one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`, and is imported
only when chosen, so `hicache-canary sim` never pays for the exporter's imports and vice versa.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys

from hicache_canary import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("hicache_canary.service.serve", "run the exporter: scheduled canaries, /metrics, status page"),
    "probe": ("hicache_canary.commands.probe_cli", "run one reuse canary against an SGLang server and print the table"),
    "demo": ("hicache_canary.commands.demo", "probe two built-in simulators (write_through vs write_back), or --target"),
    "sim": ("hicache_canary.simulator.cli", "run the SGLang HiCache simulator (SGLang's API and metric names)"),
    "check-config": ("hicache_canary.commands.config_cli", "validate an exporter config file and exit"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-canary", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hicache-canary {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = next((a for a in sys.argv[1:] if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen subcommand's module is imported; the others keep a bare parser.
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except (KeyboardInterrupt, asyncio.CancelledError):
        # asyncio's runner turns Ctrl-C into KeyboardInterrupt only when the main task did not
        # swallow the cancellation; a probe that cleaned up and re-raised ends as CancelledError.
        return 130


if __name__ == "__main__":
    sys.exit(main())
