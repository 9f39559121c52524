"""`hicache-canary probe`: one reuse canary against a live SGLang server, for a human on call.

Live progress goes to stderr (one updating line on a TTY, plain lines otherwise); the table, the
verdict, the suspected cause and the evidence go to stdout (or the whole record as JSON with --json).

Exit codes (docs/verdicts.md):
  0 reused; 1 silent or device_cache_broken (the server reused nothing it should have);
  2 inconclusive: not_evicted, inconclusive, skipped_busy (probe again later);
  3 error (target trouble or bad input: one line on stderr, never a traceback); 4 HiCache disabled.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from urllib.parse import urlsplit

from hicache_canary.models import ProbeRecord, ProbeSettings, Verdict
from hicache_canary.shown import display_url

EXIT_CODES = {
    Verdict.REUSED: 0,
    Verdict.SILENT: 1,
    Verdict.DEVICE_CACHE_BROKEN: 1,
    Verdict.NOT_EVICTED: 2,
    Verdict.INCONCLUSIVE: 2,
    Verdict.SKIPPED_BUSY: 2,
    Verdict.SKIPPED_BUDGET: 2,
    Verdict.ERROR: 3,
    Verdict.HICACHE_DISABLED: 4,
}
EXIT_BAD_INPUT = 3


def _usage_error(prog: str):
    def error(message: str):  # argparse's own error exits 2, which here means "inconclusive"
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.exit(EXIT_BAD_INPUT)

    return error


def _number(kind, minimum: float, strict: bool):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (value > minimum if strict else value >= minimum) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'positive' if strict else 'zero or more'}")
        return value

    return parse


positive_int = _number(int, 0, True)
non_negative_int = _number(int, 0, False)
positive_float = _number(float, 0.0, True)
non_negative_float = _number(float, 0.0, False)


def target_url(text: str) -> str:
    """The URL as given (its `user:password@`, if any, authenticates to a proxy in front of SGLang);
    messages and everything printed use display_url(), which drops it."""
    shown = display_url(text)
    try:
        parts = urlsplit(text)
        parts.port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown!r} is not a valid URL (bad host or port)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{shown!r} is not an http(s)://host[:port] URL")
    return text.rstrip("/")


def add_probe_options(p: argparse.ArgumentParser) -> None:
    """Options shared with `demo --target`."""
    p.add_argument("--context-tokens", type=positive_int, default=None, help="length of R (default 16384; clamped to the server)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key-env", metavar="NAME", help="environment variable holding the API key")
    key.add_argument("--api-key-file", metavar="PATH", help="file holding the API key")
    p.add_argument("--api", choices=("auto", "native", "openai"), default="auto", help="/generate, /v1/completions, or auto (default)")
    p.add_argument("--max-pressure-tokens", type=non_negative_int, default=None, help="cap on synthetic filler (default 4x device pool)")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds per request (default 300)")
    p.add_argument("--poll-interval", type=positive_float, default=1.0, help="seconds between /metrics polls while evicting")
    p.add_argument("--passive-wait", type=non_negative_float, default=ProbeSettings.passive_wait_s,
                   help=f"seconds the server's own traffic may take to evict R before filler covers the rest (default {ProbeSettings.passive_wait_s:.0f})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.error = _usage_error(p.prog)  # type: ignore[method-assign]
    p.add_argument("--target", type=target_url, required=True, help="SGLang server URL (a worker, not a router)")
    p.add_argument("--json", action="store_true", help="print the whole probe record as JSON")
    add_probe_options(p)


def settings_from_args(args: argparse.Namespace, target: str) -> ProbeSettings:
    kw = dict(
        target=target,
        api=args.api,
        max_pressure_tokens=args.max_pressure_tokens,
        timeout_s=args.timeout,
        poll_interval_s=args.poll_interval,
        passive_wait_s=args.passive_wait,
    )
    if args.context_tokens:
        kw["context_tokens"] = args.context_tokens
    return ProbeSettings(**kw)


async def probe_once(url: str, settings: ProbeSettings, api_key: str | None, progress) -> ProbeRecord:
    from hicache_canary.probe.canary import run_probe
    from hicache_canary.probe.sglang_client import SGLangClient

    async with SGLangClient(url, api_key=api_key, connect_timeout=min(5.0, settings.timeout_s)) as client:
        return await run_probe(client, settings, progress=progress)


def load_key(args: argparse.Namespace) -> str | None:
    """The API key, or exit 3 with one line naming the problem (never the key)."""
    from hicache_canary.settings.secrets_loader import load_api_key

    try:
        key = load_api_key(args.api_key_env, args.api_key_file)
    except ValueError as exc:
        sys.stderr.write(f"hicache-canary probe: error: {exc}\n")
        sys.exit(EXIT_BAD_INPUT)
    if args.api_key_env and key is None:
        sys.stderr.write(f"hicache-canary probe: error: environment variable {args.api_key_env} is not set or empty\n")
        sys.exit(EXIT_BAD_INPUT)
    return key


def run(args: argparse.Namespace) -> int:
    from hicache_canary.commands.render import ProgressLine, record_json, render_table

    key = load_key(args)
    settings = settings_from_args(args, display_url(args.target))  # the record (printed, --json) names the URL without userinfo
    rec = asyncio.run(probe_once(args.target, settings, key, ProgressLine(sys.stderr)))
    if args.json:
        print(record_json(rec))
    else:
        print(render_table(rec))
    if rec.verdict == Verdict.ERROR:
        sys.stderr.write(f"hicache-canary probe: error ({rec.reason.value if rec.reason else 'internal'}): {rec.evidence}\n")
    return EXIT_CODES.get(rec.verdict, 3) if rec.verdict else 3
