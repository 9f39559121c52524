"""SGLangError: the one exception a call to SGLang raises, bounded and scrubbed of secrets.

`reason` is a closed models.ErrorReason (safe as a label); the text is one line, cut to MAX_MESSAGE
after the secrets it was given are scrubbed from the whole text (shown.shown_text).
"""

from __future__ import annotations

from hicache_canary.models import ErrorReason
from hicache_canary.shown import shown_text

MAX_MESSAGE = 300


class SGLangError(Exception):
    """A failed call to SGLang. `reason` is bounded; `status` is the HTTP status when there was one.

    `message` is what may be shown: `secrets` scrubbed from the whole text, then one line, then cut.
    The uncut text is kept (privately) so the client can scrub keys the raiser did not know.
    """

    def __init__(self, reason: ErrorReason, message: str, status: int | None = None, secrets: tuple[str, ...] = ()):
        self.reason = reason
        self.status = status
        self._raw = str(message)
        self.message = shown_text(self._raw, secrets, MAX_MESSAGE)
        super().__init__(self.message)

    def scrubbed(self, secrets: tuple[str, ...]) -> SGLangError:
        return SGLangError(self.reason, self._raw, self.status, secrets)

    def __repr__(self) -> str:
        return f"SGLangError({self.reason.value!r}, {self.message!r}, status={self.status!r})"
