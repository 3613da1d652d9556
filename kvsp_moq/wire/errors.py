"""Errors raised by the wire codecs.

Two kinds of outcome are kept strictly apart:

* :class:`BufferUnderflow` — *not an error of the peer*: the bytes seen so far end inside a
  field. Incremental parsers catch it, keep what they have and wait for more; ``needed`` is the
  minimum number of extra bytes after the end of the buffer that the current field requires
  (exact for fixed-size fields and vi64s, so a caller can append exactly that much).
* :class:`WireError` — the peer sent something the draft forbids. ``code`` is the session
  termination code the draft names (almost always ``PROTOCOL_VIOLATION``); the session layer
  turns it into CONNECTION_CLOSE / CLOSE_WEBTRANSPORT_SESSION in one place.
  :class:`LimitExceeded` is the special case of well-formed input beyond a *local* resource
  limit that the draft does not fix (e.g. the size of Object Properties): the draft asks the
  endpoint to cancel the stream (draft-20 §"Resource Exhaustion"), so it carries a
  ``stream_code`` (EXCESSIVE_LOAD) as well, for STOP_SENDING / RESET_STREAM.

Code registries (draft-ietf-moq-transport editor's copy §"Session Termination Error Codes"
and §"Stream Reset Error Codes"; identical in draft-18 except for TOO_MANY_REQUEST_UPDATES,
new in 19). The REQUEST_ERROR and PUBLISH_DONE registries live in ``kvsp_moq.moqt.errors``.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "BufferUnderflow",
    "LimitExceeded",
    "SessionErrorCode",
    "StreamResetCode",
    "WireError",
    "is_grease",
]


class SessionErrorCode(IntEnum):
    """Session termination codes (draft-20 §"Termination"; IANA §"Session Termination Error
    Codes")."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    UNAUTHORIZED = 0x2
    PROTOCOL_VIOLATION = 0x3
    INVALID_REQUEST_ID = 0x4
    DUPLICATE_TRACK_ALIAS = 0x5
    KEY_VALUE_FORMATTING_ERROR = 0x6
    INVALID_PATH = 0x8
    MALFORMED_PATH = 0x9
    GOAWAY_TIMEOUT = 0x10
    CONTROL_MESSAGE_TIMEOUT = 0x11
    DATA_STREAM_TIMEOUT = 0x12
    AUTH_TOKEN_CACHE_OVERFLOW = 0x13
    DUPLICATE_AUTH_TOKEN_ALIAS = 0x14
    VERSION_NEGOTIATION_FAILED = 0x15
    MALFORMED_AUTH_TOKEN = 0x16
    UNKNOWN_AUTH_TOKEN_ALIAS = 0x17
    EXPIRED_AUTH_TOKEN = 0x18
    INVALID_AUTHORITY = 0x19
    MALFORMED_AUTHORITY = 0x1A
    #: Draft 19+ (MAX_REQUEST_UPDATES); never sent on a draft-18 session.
    TOO_MANY_REQUEST_UPDATES = 0x1B


class StreamResetCode(IntEnum):
    """RESET_STREAM / STOP_SENDING codes (draft-20 §"Stream Reset Error Codes"; same in 18)."""

    INTERNAL_ERROR = 0x0
    CANCELLED = 0x1
    DELIVERY_TIMEOUT = 0x2
    SESSION_CLOSED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    UNKNOWN_OBJECT_STATUS = 0x6
    EXPIRED_AUTH_TOKEN = 0x7
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


def is_grease(code: int) -> bool:
    """True for the reserved GREASE values ``0x7f * N + 0x9D`` (draft-20 §"Grease")."""
    return code >= 0x9D and (code - 0x9D) % 0x7F == 0


class BufferUnderflow(Exception):
    """More bytes are needed to finish the current field. Not an error of the peer."""

    __slots__ = ("needed",)

    def __init__(self, needed: int = 1) -> None:
        super().__init__(needed)
        #: Minimum number of further bytes (after the end of the buffer) the field needs.
        self.needed = needed

    def __str__(self) -> str:
        return f"need {self.needed} more byte(s)"


class WireError(Exception):
    """The peer violated the wire format; close the session with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason

    def __str__(self) -> str:
        try:
            name = SessionErrorCode(self.code).name
        except ValueError:
            name = hex(self.code)
        return f"{name}: {self.reason}"


class LimitExceeded(WireError):
    """Well-formed input beyond a local resource limit the draft leaves to the implementation.

    The session may cancel just the stream (``stream_code``) instead of closing the session;
    ``code`` is what to use if it closes the session anyway.
    """

    def __init__(
        self,
        reason: str,
        *,
        code: int = SessionErrorCode.INTERNAL_ERROR,
        stream_code: int = StreamResetCode.EXCESSIVE_LOAD,
    ) -> None:
        super().__init__(code, reason)
        self.stream_code = stream_code
