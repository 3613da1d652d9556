"""Namespace messages (draft-20 §"PUBLISH_NAMESPACE", §"NAMESPACE", §"NAMESPACE_DONE",
§"SUBSCRIBE_NAMESPACE", §"SUBSCRIBE_TRACKS", §"PUBLISH_SKIPPED"; draft 18 the same bytes,
with PUBLISH_SKIPPED named PUBLISH_BLOCKED).

::

    PUBLISH_NAMESPACE   { Type = 0x6,  Length (16), Request ID (vi64), Track Namespace (..),
                          Number of Parameters (vi64), Parameters (..) ... }
    SUBSCRIBE_NAMESPACE { Type = 0x50, ... Track Namespace Prefix (..) ... }   -- same layout
    SUBSCRIBE_TRACKS    { Type = 0x51, ... Track Namespace Prefix (..) ... }   -- same layout
    NAMESPACE           { Type = 0x8,  Length (16), Track Namespace Suffix (..) }
    NAMESPACE_DONE      { Type = 0xE,  Length (16), Track Namespace Suffix (..) }
    PUBLISH_SKIPPED     { Type = 0xF,  Length (16), Track Namespace Suffix (..),
                          Track Name Length (vi64), Track Name (..) }

Draft 22 renames PUBLISH_NAMESPACE's field "Track Namespace Prefix"; the bytes are the same
(moqt-reference §3). The three requests open request streams. NAMESPACE / NAMESPACE_DONE ride
the response half of a SUBSCRIBE_NAMESPACE stream, PUBLISH_SKIPPED that of SUBSCRIBE_TRACKS;
a prefix may have 0 fields, and so may a suffix (a namespace equal to the prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...wire.buffer import Reader, Writer
from ..version import Version
from ._base import SUBSCRIBE_NAMESPACE_TYPE, SUBSCRIBE_TRACKS_TYPE, Message, Sender
from ._fields import check_vi64
from .names import (
    TrackNamespace,
    check_full_track_name,
    check_track_namespace,
    read_track_name,
    read_track_namespace,
    write_full_track_name,
    write_track_namespace,
)
from .params import MessageParameters, ParamContext, read_parameters, write_parameters

__all__ = [
    "Namespace",
    "NamespaceDone",
    "PublishBlocked",
    "PublishNamespace",
    "PublishSkipped",
    "SubscribeNamespace",
    "SubscribeTracks",
]


class _NamespaceRequest(Message):
    """``Request ID, Track Namespace (Prefix), Number of Parameters, Parameters``; the
    subclass's namespace field is its second field."""

    __slots__ = ()
    FIRST = True

    def encode_body(self, w: Writer, version: Version) -> None:
        request_id, namespace, params = self._parts()
        w.push_vi64(request_id)
        write_track_namespace(w, namespace)
        write_parameters(w, version, self.PARAMS, params)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> Any:
        request_id = r.pull_vi64()
        namespace = read_track_namespace(r)
        params = read_parameters(r, version, cls.PARAMS)
        return cls(request_id, namespace, params)  # type: ignore[call-arg]

    def _parts(self) -> tuple[int, TrackNamespace, MessageParameters]:  # pragma: no cover
        raise NotImplementedError

    def _check(self, request_id: int, namespace: TrackNamespace, field: str) -> None:
        check_vi64("Request ID", request_id)
        object.__setattr__(self, field, check_track_namespace(namespace))


@dataclass(frozen=True, slots=True)
class PublishNamespace(_NamespaceRequest):
    """PUBLISH_NAMESPACE: advertises tracks under a namespace."""

    TYPE = 0x06
    NAME = "PUBLISH_NAMESPACE"
    PARAMS = ParamContext.PUBLISH_NAMESPACE

    request_id: int
    track_namespace: TrackNamespace
    parameters: MessageParameters = MessageParameters()

    def __post_init__(self) -> None:
        self._check(self.request_id, self.track_namespace, "track_namespace")

    def _parts(self) -> tuple[int, TrackNamespace, MessageParameters]:
        return self.request_id, self.track_namespace, self.parameters


@dataclass(frozen=True, slots=True)
class SubscribeNamespace(_NamespaceRequest):
    """SUBSCRIBE_NAMESPACE: asks for NAMESPACE / NAMESPACE_DONE under a prefix."""

    TYPE = SUBSCRIBE_NAMESPACE_TYPE
    NAME = "SUBSCRIBE_NAMESPACE"
    PARAMS = ParamContext.SUBSCRIBE_NAMESPACE

    request_id: int
    track_namespace_prefix: TrackNamespace
    parameters: MessageParameters = MessageParameters()

    def __post_init__(self) -> None:
        self._check(self.request_id, self.track_namespace_prefix, "track_namespace_prefix")

    def _parts(self) -> tuple[int, TrackNamespace, MessageParameters]:
        return self.request_id, self.track_namespace_prefix, self.parameters


@dataclass(frozen=True, slots=True)
class SubscribeTracks(_NamespaceRequest):
    """SUBSCRIBE_TRACKS: asks for PUBLISH of every track under a prefix."""

    TYPE = SUBSCRIBE_TRACKS_TYPE
    NAME = "SUBSCRIBE_TRACKS"
    PARAMS = ParamContext.SUBSCRIBE_TRACKS

    request_id: int
    track_namespace_prefix: TrackNamespace
    parameters: MessageParameters = MessageParameters()

    def __post_init__(self) -> None:
        self._check(self.request_id, self.track_namespace_prefix, "track_namespace_prefix")

    def _parts(self) -> tuple[int, TrackNamespace, MessageParameters]:
        return self.request_id, self.track_namespace_prefix, self.parameters


class _SuffixMessage(Message):
    """``Track Namespace Suffix`` only."""

    __slots__ = ()
    ON_REQUESTS = {SUBSCRIBE_NAMESPACE_TYPE: Sender.RESPONDER}

    def encode_body(self, w: Writer, version: Version) -> None:
        write_track_namespace(w, self.track_namespace_suffix)  # type: ignore[attr-defined]

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> Any:
        return cls(read_track_namespace(r))  # type: ignore[call-arg]


@dataclass(frozen=True, slots=True)
class Namespace(_SuffixMessage):
    """NAMESPACE: a namespace under the SUBSCRIBE_NAMESPACE prefix is published."""

    TYPE = 0x08
    NAME = "NAMESPACE"

    track_namespace_suffix: TrackNamespace

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "track_namespace_suffix", check_track_namespace(self.track_namespace_suffix)
        )


@dataclass(frozen=True, slots=True)
class NamespaceDone(_SuffixMessage):
    """NAMESPACE_DONE: a namespace under the prefix is no longer published."""

    TYPE = 0x0E
    NAME = "NAMESPACE_DONE"

    track_namespace_suffix: TrackNamespace

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "track_namespace_suffix", check_track_namespace(self.track_namespace_suffix)
        )


@dataclass(frozen=True, slots=True)
class PublishSkipped(Message):
    """PUBLISH_SKIPPED (PUBLISH_BLOCKED in draft 18): no PUBLISH will come for this track."""

    TYPE = 0x0F
    NAME = "PUBLISH_SKIPPED"
    ON_REQUESTS = {SUBSCRIBE_TRACKS_TYPE: Sender.RESPONDER}

    track_namespace_suffix: TrackNamespace
    track_name: bytes

    def __post_init__(self) -> None:
        check_full_track_name(self.track_namespace_suffix, self.track_name)
        object.__setattr__(
            self, "track_namespace_suffix", check_track_namespace(self.track_namespace_suffix)
        )
        object.__setattr__(self, "track_name", bytes(self.track_name))

    def encode_body(self, w: Writer, version: Version) -> None:
        write_full_track_name(w, self.track_namespace_suffix, self.track_name)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> PublishSkipped:
        suffix = read_track_namespace(r)
        return cls(suffix, read_track_name(r, suffix))


#: Draft-18 name of PUBLISH_SKIPPED (same type and bytes).
PublishBlocked = PublishSkipped
