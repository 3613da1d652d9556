"""MOQT control messages of drafts 18, 20/21 and 22: typed messages, their per-version
codecs, and the framing (DESIGN.md §3; ``docs/moqt-messages.md``).

* :func:`encode_message` / :func:`decode_message` / :class:`ControlStreamReader` — framing
  (``codec``);
* one frozen dataclass per message (``setup``, ``subscribe``, ``request``, ``publish``,
  ``fetch``, ``track_status``, ``namespace``), each declaring its type, the versions it exists
  in and the stream rules the session enforces (``_base``; the Message Types of the requests,
  ``SUBSCRIBE_TYPE`` ..., for the session's stream rules);
* :func:`violation` — the PROTOCOL_VIOLATION :class:`~kvsp_moq.wire.errors.WireError` the
  session raises too (``_fields``);
* :class:`MessageParameters` and the per-message allow-lists (``params``), the filter values
  (``filters``), the Token (``token``), Track Namespace / Full Track Name limits (``names``).

Malformed input raises :class:`~kvsp_moq.wire.errors.WireError` carrying the session error
code the draft names; nothing else escapes a decoder.
"""

from ._base import (
    ALL_VERSIONS,
    FETCH_TYPE,
    PUBLISH_NAMESPACE_TYPE,
    PUBLISH_TYPE,
    REQUEST_TYPES,
    SUBSCRIBE_NAMESPACE_TYPE,
    SUBSCRIBE_TRACKS_TYPE,
    SUBSCRIBE_TYPE,
    TRACK_STATUS_TYPE,
    Message,
    Sender,
    StreamUse,
    TrackRequest,
)
from ._fields import MAX_REASON_PHRASE_LENGTH, Location, TrackProperties, violation
from .codec import (
    MAX_MESSAGE_LENGTH,
    ControlStreamReader,
    decode_message,
    encode_message,
    message_class,
    message_classes,
)
from .fetch import Fetch, FetchOk, FetchType, FetchWithType, JoiningFetch, StandaloneFetch
from .filters import LocationFilter, LocationFilterType, Range, RangeFilter
from .names import (
    MAX_FULL_TRACK_NAME_LENGTH,
    MAX_NAMESPACE_FIELDS,
    TrackNamespace,
    read_full_track_name,
    read_track_namespace,
    write_full_track_name,
    write_track_namespace,
)
from .namespace import (
    Namespace,
    NamespaceDone,
    PublishBlocked,
    PublishNamespace,
    PublishSkipped,
    SubscribeNamespace,
    SubscribeTracks,
)
from .params import (
    PARAMETER_SPECS,
    MessageParameters,
    ParamContext,
    ParameterSpec,
    ParameterType,
    allowed_parameter_types,
    check_parameters,
    defined_parameter_types,
)
from .publish import Publish, PublishDone, PublishStateNotify, stream_count_unknown
from .request import (
    PublishOk,
    Redirect,
    RequestError,
    RequestOk,
    check_redirect,
    check_request_ok,
)
from .setup import MAX_GOAWAY_URI_LENGTH, GoAway, Setup, SetupOptionType, known_setup_options
from .subscribe import RequestUpdate, Subscribe, SubscribeOk, check_request_update
from .token import AliasType, Token, token_cache_size
from .track_status import TrackStatus

__all__ = [
    "ALL_VERSIONS",
    "FETCH_TYPE",
    "MAX_FULL_TRACK_NAME_LENGTH",
    "MAX_GOAWAY_URI_LENGTH",
    "MAX_MESSAGE_LENGTH",
    "MAX_NAMESPACE_FIELDS",
    "MAX_REASON_PHRASE_LENGTH",
    "PARAMETER_SPECS",
    "PUBLISH_NAMESPACE_TYPE",
    "PUBLISH_TYPE",
    "REQUEST_TYPES",
    "SUBSCRIBE_NAMESPACE_TYPE",
    "SUBSCRIBE_TRACKS_TYPE",
    "SUBSCRIBE_TYPE",
    "TRACK_STATUS_TYPE",
    "AliasType",
    "ControlStreamReader",
    "Fetch",
    "FetchOk",
    "FetchType",
    "FetchWithType",
    "GoAway",
    "JoiningFetch",
    "Location",
    "LocationFilter",
    "LocationFilterType",
    "Message",
    "MessageParameters",
    "Namespace",
    "NamespaceDone",
    "ParamContext",
    "ParameterSpec",
    "ParameterType",
    "Publish",
    "PublishBlocked",
    "PublishDone",
    "PublishNamespace",
    "PublishOk",
    "PublishSkipped",
    "PublishStateNotify",
    "Range",
    "RangeFilter",
    "Redirect",
    "RequestError",
    "RequestOk",
    "RequestUpdate",
    "Sender",
    "Setup",
    "SetupOptionType",
    "StandaloneFetch",
    "StreamUse",
    "Subscribe",
    "SubscribeNamespace",
    "SubscribeOk",
    "SubscribeTracks",
    "Token",
    "TrackNamespace",
    "TrackProperties",
    "TrackRequest",
    "TrackStatus",
    "allowed_parameter_types",
    "check_parameters",
    "check_redirect",
    "check_request_ok",
    "check_request_update",
    "decode_message",
    "defined_parameter_types",
    "encode_message",
    "known_setup_options",
    "message_class",
    "message_classes",
    "read_full_track_name",
    "read_track_namespace",
    "stream_count_unknown",
    "token_cache_size",
    "violation",
    "write_full_track_name",
    "write_track_namespace",
]
