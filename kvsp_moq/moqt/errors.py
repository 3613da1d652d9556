"""MOQT error code registries (draft-20 §"Error Codes" IANA tables; draft-18 differences noted).

The session and stream-reset registries are defined in :mod:`kvsp_moq.wire.errors` (the wire
codecs raise :class:`WireError` with a session code) and re-exported here, so that MOQT code
imports every registry from one place. Unknown codes received in REQUEST_ERROR, PUBLISH_DONE
or a reset are treated as INTERNAL_ERROR, never as a reason to close (moqt-reference §2.9);
:func:`request_error_code` and friends map them so.
"""

from __future__ import annotations

from enum import IntEnum

from ..wire.errors import (
    BufferUnderflow,
    LimitExceeded,
    SessionErrorCode,
    StreamResetCode,
    WireError,
    is_grease,
)

__all__ = [
    "BufferUnderflow",
    "LimitExceeded",
    "PublishDoneCode",
    "RequestErrorCode",
    "SessionErrorCode",
    "StreamResetCode",
    "WireError",
    "is_grease",
    "publish_done_code",
    "request_error_code",
    "stream_reset_code",
]


class RequestErrorCode(IntEnum):
    """REQUEST_ERROR codes (draft-20 §"REQUEST_ERROR Codes")."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    MALFORMED_AUTH_TOKEN = 0x4
    EXPIRED_AUTH_TOKEN = 0x5
    GOING_AWAY = 0x6
    EXCESSIVE_LOAD = 0x9
    DOES_NOT_EXIST = 0x10
    INVALID_RANGE = 0x11
    MALFORMED_TRACK = 0x12
    #: Draft 18 only (removed in 19).
    DUPLICATE_SUBSCRIPTION = 0x19
    UNINTERESTED = 0x20
    PREFIX_OVERLAP = 0x30
    NAMESPACE_TOO_LARGE = 0x31
    #: Drafts <= 19 (joining FETCH); removed in 20.
    INVALID_JOINING_REQUEST_ID = 0x32
    UNSUPPORTED_EXTENSION = 0x33
    REDIRECT = 0x34
    #: Draft 19+.
    CONFLICTING_FILTERS = 0x35
    #: Draft 19+.
    INVALID_FILTER = 0x36


class PublishDoneCode(IntEnum):
    """PUBLISH_DONE status codes (draft-20 §"PUBLISH_DONE Codes"; same in 18)."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    SUBSCRIPTION_ENDED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    EXPIRED = 0x6
    UPDATE_FAILED = 0x8
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


def request_error_code(code: int) -> RequestErrorCode:
    """A received REQUEST_ERROR code; unknown values read as INTERNAL_ERROR."""
    try:
        return RequestErrorCode(code)
    except ValueError:
        return RequestErrorCode.INTERNAL_ERROR


def publish_done_code(code: int) -> PublishDoneCode:
    """A received PUBLISH_DONE status; unknown values read as INTERNAL_ERROR."""
    try:
        return PublishDoneCode(code)
    except ValueError:
        return PublishDoneCode.INTERNAL_ERROR


def stream_reset_code(code: int) -> StreamResetCode:
    """A received RESET_STREAM / STOP_SENDING code; unknown values read as INTERNAL_ERROR."""
    try:
        return StreamResetCode(code)
    except ValueError:
        return StreamResetCode.INTERNAL_ERROR
