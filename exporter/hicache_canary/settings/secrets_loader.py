"""One way to load a secret (an SGLang API key, the probe API token): an environment variable or a
file read with a size limit, stripped. Callers differ only in policy (is an unset variable an
error?) and in how they prefix the message; the messages name the path, never the content.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hicache_canary.files import MAX_SECRET_BYTES, FileTooLarge, read_text


class SecretError(ValueError):
    """A secret that cannot be used; the message names where it came from, never its value."""


def read_secret_file(path: str, what: str = "") -> str:
    """The stripped, non-empty text of `path`. `what` (e.g. "API key file ") goes before the path."""
    try:
        value = read_text(path, MAX_SECRET_BYTES).strip()
    except OSError as exc:
        raise SecretError(f"cannot read {what}{path}: {exc.strerror or exc}") from None
    except FileTooLarge as exc:
        raise SecretError(f"{what}{exc} (a secret file holds one key)") from None
    except UnicodeDecodeError:
        # Never echo the bytes: they are (part of) a secret.
        raise SecretError(f"{what}{path} is not UTF-8 text") from None
    if not value:
        raise SecretError(f"{what}{path} is empty")
    return value


def load_api_key(env: str | None, file: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key from the environment variable named `env`, else from `file` (stripped).

    An unset or empty variable falls through to the file; no source at all gives None. A file that
    cannot be read, is empty, or holds a key with whitespace or control characters raises
    SecretError (a ValueError) naming the path, never the content.
    """
    if env:
        value = environ.get(env, "").strip()
        if value:
            _check_key(value, f"environment variable {env}")
            return value
    if file:
        value = read_secret_file(file, "API key file ")
        _check_key(value, f"API key file {file}")
        return value
    return None


def _check_key(value: str, source: str) -> None:
    # A Bearer header cannot carry them; two words in a key file are a mistake, not a key.
    if any(c.isspace() or not c.isprintable() for c in value):
        raise SecretError(f"{source}: the API key contains whitespace or control characters")
