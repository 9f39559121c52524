"""The one way text that came from outside (a server's error body, a URL) becomes text we show.

Order matters: secrets are replaced on the WHOLE text first, then it is folded onto one line and
cut. Cutting first can split a secret the server echoed, and a split secret no longer matches the
scrub, so half of it would be shown (issue 14: 47 of a 64-character key survived a 200-character
cut). Every path that shows server text (probe output, /api/targets, the status page, logs) goes
through `shown_text`; URLs go through `display_url`, which drops `user:password@`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

REDACTED = "<redacted>"
# A version, write policy or algorithm name as SGLang prints them (0.5.23, 0.5.10.post1, write_back, EAGLE3).
SERVER_TOKEN_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$")
UNRECOGNISED = "unrecognised"


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """`text` with every known secret replaced; longest first, so a secret containing another goes whole."""
    for s in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return text


def shown_text(text: object, secrets: Iterable[str | None] = (), limit: int | None = None) -> str:
    """Scrub, then one line, then at most `limit` characters (with `...` when cut)."""
    out = " ".join(scrub(str(text), secrets).split())
    if limit is not None and len(out) > limit:
        out = out[: max(0, limit - 3)] + "..."
    return out


def display_url(url: str) -> str:
    """`url` without `user:password@`, query or fragment: safe to print, log and store."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid URL>"
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def server_token(value: str | None) -> str | None:
    """A short name-like string a server sent, or UNRECOGNISED (20 KB, markup, terminal escapes)."""
    if value is None or SERVER_TOKEN_RE.match(value):
        return value
    return UNRECOGNISED
