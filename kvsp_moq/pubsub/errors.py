"""Errors of the pubsub API: every MOQT failure carries the code the draft names."""

from __future__ import annotations

from enum import Enum

__all__ = ["DatagramTooLargeError", "ErrorKind", "MoqtError", "SessionClosedError"]


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


class DatagramTooLargeError(ValueError):
    """An object does not fit in one OBJECT_DATAGRAM to a subscriber's session: ``size``
    octets (header and payload) against that session's ``limit`` (the largest QUIC DATAGRAM
    payload the peer's ``max_datagram_frame_size`` and the path allow). Nothing was sent;
    publish the object on a stream instead (draft-22 §"Datagrams": a datagram larger than
    the session's maximum would be dropped without notice)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"OBJECT_DATAGRAM of {size} octets exceeds the peer's maximum "
                         f"datagram payload of {limit} octets")
        self.size = size
        self.limit = limit
