"""Errors of the pubsub API: every MOQT failure carries the code the draft names."""

from __future__ import annotations

from enum import Enum

__all__ = ["ErrorKind", "MoqtError", "SessionClosedError"]


class ErrorKind(Enum):
    """Which code registry :attr:`MoqtError.code` belongs to (moqt-reference §2.9)."""

    REQUEST = "REQUEST_ERROR"
    SESSION = "session termination"
    STREAM = "stream reset"
    PUBLISH_DONE = "PUBLISH_DONE status"
    LOCAL = "local"


class MoqtError(Exception):
    """A request failed or a subscription/fetch ended abnormally.

    ``code`` is the MOQT code (REQUEST_ERROR code, session close code, stream reset code or
    PUBLISH_DONE status, per ``kind``); ``reason`` the peer's or our text.
    """

    def __init__(self, code: int, reason: str = "", kind: ErrorKind = ErrorKind.REQUEST) -> None:
        super().__init__(code, reason)
        self.code = int(code)
        self.reason = reason
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.kind.value} 0x{self.code:x}: {self.reason}"


class SessionClosedError(MoqtError):
    """The session is closed; ``code`` is the session termination code."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(code, reason, ErrorKind.SESSION)
