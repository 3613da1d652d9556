"""PUBLISH, PUBLISH_DONE and PUBLISH_STATE_NOTIFY (draft-20 §"PUBLISH", §"PUBLISH_DONE",
§"PUBLISH_STATE_NOTIFY"; draft-18 §"PUBLISH", §"PUBLISH_DONE").

::

    PUBLISH { Type = 0x1D, Length (16), Request ID (vi64), Track Namespace (..),
              Track Name Length (vi64), Track Name (..), Track Alias (vi64),
              Number of Parameters (vi64), Parameters (..) ..., Track Properties (..) }
    PUBLISH_DONE { Type = 0xB, Length (16), Status Code (vi64), Stream Count (vi64),
                   Error Reason (Reason Phrase) }
    PUBLISH_STATE_NOTIFY { Type = 0x22, Length (16), Number of Parameters (vi64),
                           Parameters (..) ... }                               -- 20+ only

PUBLISH is answered by REQUEST_OK (PUBLISH_OK; 0x1E is reserved). PUBLISH_DONE and
PUBLISH_STATE_NOTIFY come from the publisher: the responder of a SUBSCRIBE, the requester of
a PUBLISH. Stream Count "unknown" is 2^62-1 in draft 18 and 2^64-1 from draft 20
(:func:`stream_count_unknown`). Unknown status codes read as INTERNAL_ERROR
(:attr:`PublishDone.code`) and do not close the session.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...wire.buffer import Reader, Writer
from ...wire.kvp import KeyValuePair
from ..errors import PublishDoneCode, publish_done_code
from ..version import Version
from ._base import PUBLISH_TYPE, SUBSCRIBE_TYPE, Message, Sender
from ._fields import (
    TrackProperties,
    check_vi64,
    read_reason_phrase,
    read_track_properties,
    write_reason_phrase,
    write_track_properties,
)
from .names import (
    TrackNamespace,
    check_track_namespace,
    read_full_track_name,
    write_full_track_name,
)
from .params import MessageParameters, ParamContext, read_parameters, write_parameters

__all__ = ["Publish", "PublishDone", "PublishStateNotify", "stream_count_unknown"]

_PUBLISHER = {SUBSCRIBE_TYPE: Sender.RESPONDER, PUBLISH_TYPE: Sender.REQUESTER}


def stream_count_unknown(version: Version) -> int:
    """The Stream Count a publisher sends when it cannot count (§"PUBLISH_DONE")."""
    return (1 << 62) - 1 if version < Version.DRAFT_20 else (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Publish(Message):
    """PUBLISH: opens a request stream to start a subscription from the publisher side."""

    TYPE = 0x1D
    NAME = "PUBLISH"
    FIRST = True
    PARAMS = ParamContext.PUBLISH

    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    track_alias: int
    parameters: MessageParameters = MessageParameters()
    track_properties: TrackProperties = ()

    def __post_init__(self) -> None:
        check_vi64("Request ID", self.request_id)
        check_vi64("Track Alias", self.track_alias)
        object.__setattr__(self, "track_namespace", check_track_namespace(self.track_namespace))
        object.__setattr__(self, "track_name", bytes(self.track_name))
        object.__setattr__(
            self, "track_properties", tuple(KeyValuePair(*kv) for kv in self.track_properties)
        )

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.request_id)
        write_full_track_name(w, self.track_namespace, self.track_name)
        w.push_vi64(self.track_alias)
        write_parameters(w, version, self.PARAMS, self.parameters)
        write_track_properties(w, self.track_properties)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> Publish:
        request_id = r.pull_vi64()
        namespace, name = read_full_track_name(r)
        alias = r.pull_vi64()
        params = read_parameters(r, version, cls.PARAMS)
        return cls(request_id, namespace, name, alias, params, read_track_properties(r))


@dataclass(frozen=True, slots=True)
class PublishDone(Message):
    """PUBLISH_DONE: the publisher's last message on a subscription's stream."""

    TYPE = 0x0B
    NAME = "PUBLISH_DONE"
    ON_REQUESTS = _PUBLISHER

    status_code: int
    stream_count: int
    error_reason: str = ""

    def __post_init__(self) -> None:
        check_vi64("Status Code", self.status_code)
        check_vi64("Stream Count", self.stream_count)

    @property
    def code(self) -> PublishDoneCode:
        """The status; unknown codes read as INTERNAL_ERROR."""
        return publish_done_code(self.status_code)

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.status_code)
        w.push_vi64(self.stream_count)
        write_reason_phrase(w, self.error_reason)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> PublishDone:
        status = r.pull_vi64()
        count = r.pull_vi64()
        return cls(status, count, read_reason_phrase(r))


@dataclass(frozen=True, slots=True)
class PublishStateNotify(Message):
    """PUBLISH_STATE_NOTIFY (20+): the publisher reports changed subscription state; no reply."""

    TYPE = 0x22
    NAME = "PUBLISH_STATE_NOTIFY"
    VERSIONS = frozenset({Version.DRAFT_20, Version.DRAFT_22})
    PARAMS = ParamContext.PUBLISH_STATE_NOTIFY
    ON_REQUESTS = _PUBLISHER

    parameters: MessageParameters = MessageParameters()

    def encode_body(self, w: Writer, version: Version) -> None:
        write_parameters(w, version, self.PARAMS, self.parameters)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> PublishStateNotify:
        return cls(read_parameters(r, version, cls.PARAMS))
