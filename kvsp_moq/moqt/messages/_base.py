"""The base class of control messages and the stream rules each one declares.

Every message class is a frozen dataclass with

* ``TYPE`` — its Message Type (draft-20 §"Control Messages", table; same codes in 18);
* ``NAME`` — the draft-20 name (PUBLISH_SKIPPED is PUBLISH_BLOCKED in draft 18);
* ``VERSIONS`` — the wire versions where it exists (21 is 20 on the wire);
* stream rules for the session state machine, which this package does not implement:

  - ``STREAM`` — CONTROL (the uni control stream, 17+), REQUEST (a bidi request stream), or
    both (GOAWAY);
  - ``FIRST`` — it MUST be the first message of its stream: of a new request stream for
    the requests (§"Session initialization": TRACK_STATUS, SUBSCRIBE, PUBLISH, FETCH,
    PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS; any other first message →
    PROTOCOL_VIOLATION), of the control stream for SETUP;
  - ``ON_REQUESTS`` — for the other request-stream messages, the message types that open the
    streams it may appear on, each with who sends it: the endpoint that opened the stream
    (REQUESTER), the other (RESPONDER) or either;
* ``PARAMS`` — the parameter context the codec checks (:class:`ParamContext`).

and implements ``encode_body(w, version)`` / ``decode_body(r, version)``. Use
``codec.encode_message`` / ``codec.decode_message`` rather than these directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from ...wire.buffer import Reader, Writer
from ..version import Version
from ._fields import check_vi64
from .names import (
    TrackNamespace,
    check_track_namespace,
    read_full_track_name,
    write_full_track_name,
)
from .params import MessageParameters, ParamContext, read_parameters, write_parameters

__all__ = [
    "ALL_VERSIONS",
    "FETCH_TYPE",
    "PUBLISH_NAMESPACE_TYPE",
    "PUBLISH_TYPE",
    "REQUEST_TYPES",
    "SUBSCRIBE_NAMESPACE_TYPE",
    "SUBSCRIBE_TRACKS_TYPE",
    "SUBSCRIBE_TYPE",
    "TRACK_STATUS_TYPE",
    "Message",
    "Sender",
    "StreamUse",
    "TrackRequest",
]

#: Wire versions (21 shares 20's bytes).
ALL_VERSIONS = frozenset({Version.DRAFT_18, Version.DRAFT_20, Version.DRAFT_22})


class StreamUse(Enum):
    CONTROL = "control"
    REQUEST = "request"
    CONTROL_OR_REQUEST = "control or request"


class Sender(Enum):
    """Who sends a message on a request stream, relative to the stream's opener."""

    REQUESTER = "requester"
    RESPONDER = "responder"
    EITHER = "either"


# Message types that open request streams (values repeated here to avoid import cycles).
SUBSCRIBE_TYPE = 0x03
PUBLISH_TYPE = 0x1D
FETCH_TYPE = 0x16
TRACK_STATUS_TYPE = 0x0D
PUBLISH_NAMESPACE_TYPE = 0x06
SUBSCRIBE_NAMESPACE_TYPE = 0x50
SUBSCRIBE_TRACKS_TYPE = 0x51
REQUEST_TYPES = (
    SUBSCRIBE_TYPE,
    PUBLISH_TYPE,
    FETCH_TYPE,
    TRACK_STATUS_TYPE,
    PUBLISH_NAMESPACE_TYPE,
    SUBSCRIBE_NAMESPACE_TYPE,
    SUBSCRIBE_TRACKS_TYPE,
)


class Message:
    """Base of every control message (a frozen dataclass in each subclass)."""

    __slots__ = ()

    TYPE: ClassVar[int]
    NAME: ClassVar[str]
    VERSIONS: ClassVar[frozenset[Version]] = ALL_VERSIONS
    STREAM: ClassVar[StreamUse] = StreamUse.REQUEST
    FIRST: ClassVar[bool] = False
    ON_REQUESTS: ClassVar[Mapping[int, Sender]] = {}
    PARAMS: ClassVar[ParamContext] = ParamContext.NONE

    @classmethod
    def exists_in(cls, version: Version) -> bool:
        return version.wire_version in cls.VERSIONS

    def encode_body(self, w: Writer, version: Version) -> None:  # pragma: no cover
        raise NotImplementedError

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> Any:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class TrackRequest(Message):
    """The body shared by SUBSCRIBE, TRACK_STATUS and (20+) FETCH::

        Request ID (vi64), Track Namespace (..), Track Name Length (vi64), Track Name (..),
        Number of Parameters (vi64), Parameters (..) ...
    """

    FIRST = True

    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    parameters: MessageParameters = MessageParameters()

    def __post_init__(self) -> None:
        check_vi64("Request ID", self.request_id)
        object.__setattr__(self, "track_namespace", check_track_namespace(self.track_namespace))
        object.__setattr__(self, "track_name", bytes(self.track_name))

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.request_id)
        write_full_track_name(w, self.track_namespace, self.track_name)
        write_parameters(w, version, self.PARAMS, self.parameters)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> Any:
        request_id = r.pull_vi64()
        namespace, name = read_full_track_name(r)
        return cls(request_id, namespace, name, read_parameters(r, version, cls.PARAMS))
