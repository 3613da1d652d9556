"""SUBSCRIBE, SUBSCRIBE_OK and REQUEST_UPDATE (draft-20 §"SUBSCRIBE", §"SUBSCRIBE_OK",
§"REQUEST_UPDATE"; draft 18 the same bytes — only the parameters they may carry differ, see
``params``).

::

    SUBSCRIBE { Type = 0x3, Length (16), Request ID (vi64), Track Namespace (..),
                Track Name Length (vi64), Track Name (..), Number of Parameters (vi64),
                Parameters (..) ... }
    SUBSCRIBE_OK { Type = 0x4, Length (16), Track Alias (vi64), Number of Parameters (vi64),
                   Parameters (..) ..., Track Properties (..) }
    REQUEST_UPDATE { Type = 0x2, Length (16), Request ID (vi64), Number of Parameters (vi64),
                     Parameters (..) ... }

REQUEST_UPDATE is sent on the stream of the request it updates (SUBSCRIBE, PUBLISH, FETCH,
PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS; never TRACK_STATUS) and consumes a
new Request ID. The codec checks its parameters against the union over those requests;
:func:`check_request_update` checks the precise list once the session knows the request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...wire.buffer import Reader, Writer
from ...wire.kvp import KeyValuePair
from ..version import Version
from ._base import (
    FETCH_TYPE,
    PUBLISH_NAMESPACE_TYPE,
    PUBLISH_TYPE,
    SUBSCRIBE_NAMESPACE_TYPE,
    SUBSCRIBE_TRACKS_TYPE,
    SUBSCRIBE_TYPE,
    Message,
    Sender,
    TrackRequest,
)
from ._fields import (
    TrackProperties,
    check_vi64,
    read_track_properties,
    violation,
    write_track_properties,
)
from .params import (
    MessageParameters,
    ParamContext,
    check_parameters,
    read_parameters,
    write_parameters,
)

__all__ = ["RequestUpdate", "Subscribe", "SubscribeOk", "check_request_update"]


@dataclass(frozen=True, slots=True)
class Subscribe(TrackRequest):
    """SUBSCRIBE: opens a request stream to subscribe to a track."""

    TYPE = 0x03
    NAME = "SUBSCRIBE"
    PARAMS = ParamContext.SUBSCRIBE


@dataclass(frozen=True, slots=True)
class SubscribeOk(Message):
    """SUBSCRIBE_OK: the publisher's first response on a SUBSCRIBE stream."""

    TYPE = 0x04
    NAME = "SUBSCRIBE_OK"
    PARAMS = ParamContext.SUBSCRIBE_OK
    ON_REQUESTS = {SUBSCRIBE_TYPE: Sender.RESPONDER}

    track_alias: int
    parameters: MessageParameters = MessageParameters()
    track_properties: TrackProperties = ()

    def __post_init__(self) -> None:
        check_vi64("Track Alias", self.track_alias)
        object.__setattr__(
            self, "track_properties", tuple(KeyValuePair(*kv) for kv in self.track_properties)
        )

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.track_alias)
        write_parameters(w, version, self.PARAMS, self.parameters)
        write_track_properties(w, self.track_properties)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> SubscribeOk:
        alias = r.pull_vi64()
        params = read_parameters(r, version, cls.PARAMS)
        return cls(alias, params, read_track_properties(r))


@dataclass(frozen=True, slots=True)
class RequestUpdate(Message):
    """REQUEST_UPDATE: changes the parameters of the request on its stream."""

    TYPE = 0x02
    NAME = "REQUEST_UPDATE"
    PARAMS = ParamContext.REQUEST_UPDATE
    # The requester updates its request; on a PUBLISH stream the subscriber (responder) does.
    ON_REQUESTS = {
        SUBSCRIBE_TYPE: Sender.REQUESTER,
        FETCH_TYPE: Sender.REQUESTER,
        PUBLISH_NAMESPACE_TYPE: Sender.REQUESTER,
        SUBSCRIBE_NAMESPACE_TYPE: Sender.REQUESTER,
        SUBSCRIBE_TRACKS_TYPE: Sender.REQUESTER,
        PUBLISH_TYPE: Sender.RESPONDER,
    }

    request_id: int
    parameters: MessageParameters = MessageParameters()

    def __post_init__(self) -> None:
        check_vi64("Request ID", self.request_id)

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.request_id)
        write_parameters(w, version, self.PARAMS, self.parameters)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> RequestUpdate:
        request_id = r.pull_vi64()
        return cls(request_id, read_parameters(r, version, cls.PARAMS))


_UPDATE_CONTEXT = {
    SUBSCRIBE_TYPE: ParamContext.REQUEST_UPDATE_SUBSCRIPTION,
    PUBLISH_TYPE: ParamContext.REQUEST_UPDATE_SUBSCRIPTION,
    FETCH_TYPE: ParamContext.REQUEST_UPDATE_FETCH,
    PUBLISH_NAMESPACE_TYPE: ParamContext.REQUEST_UPDATE_PUBLISH_NAMESPACE,
    SUBSCRIBE_NAMESPACE_TYPE: ParamContext.REQUEST_UPDATE_SUBSCRIBE_NAMESPACE,
    SUBSCRIBE_TRACKS_TYPE: ParamContext.REQUEST_UPDATE_SUBSCRIBE_TRACKS,
}


def check_request_update(version: Version, msg: RequestUpdate, request_type: int, *,
                         strict: bool = False) -> RequestUpdate:
    """Session check of a REQUEST_UPDATE on the stream opened by ``request_type``: the request
    must be updatable (draft-20 §"REQUEST_UPDATE": otherwise PROTOCOL_VIOLATION); returns the
    message without the parameters not listed for that request (ignored and logged, see
    :func:`~.params.check_parameters`; ``strict``, for our own: PROTOCOL_VIOLATION)."""
    context = _UPDATE_CONTEXT.get(request_type)
    if context is None:
        raise violation(f"REQUEST_UPDATE on a stream opened by message type {request_type:#x}")
    params = check_parameters(version, context, msg.parameters, strict=strict)
    return msg if params is msg.parameters else dataclasses.replace(msg, parameters=params)
