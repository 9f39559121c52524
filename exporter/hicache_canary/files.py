"""Reading the few files we take in (config, API key, probe token) with a size limit.

`Path.read_text` reads until EOF: `api_key_file: /dev/zero` (or a log file given by mistake) would
eat all memory and end in a MemoryError traceback. Reading at most `limit + 1` bytes tells "too
large" apart from "exactly the limit" without ever holding more.
"""

from __future__ import annotations

import os

MAX_CONFIG_BYTES = 1 << 20  # a config of a thousand targets is ~150 KB
MAX_SECRET_BYTES = 4096  # API keys and tokens are tens of characters


class FileTooLarge(Exception):
    def __init__(self, path: str | os.PathLike[str], limit: int):
        self.path, self.limit = str(path), limit
        super().__init__(f"{path} is larger than {_size(limit)}")


def read_text(path: str | os.PathLike[str], limit: int) -> str:
    """UTF-8 text of `path`; raises OSError, UnicodeDecodeError or FileTooLarge (never reads past limit+1)."""
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(path, limit)
    return data.decode("utf-8")


def _size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} bytes"
