"""REQUEST_OK and REQUEST_ERROR (draft-20 §"REQUEST_OK", §"REQUEST_ERROR"; draft 18 the same
bytes).

::

    REQUEST_OK { Type = 0x7, Length (16), Number of Parameters (vi64), Parameters..,
                 Track Properties (..) }
    REQUEST_ERROR { Type = 0x5, Length (16), Error Code (vi64), Retry Interval (vi64),
                    Error Reason (Reason Phrase), [Redirect] }     -- iff Error Code = REDIRECT
    Redirect { Connect URI Length (vi64), Connect URI (..), Track Namespace (..),
               Track Name Length (vi64), Track Name (..) }

REQUEST_OK answers PUBLISH (PUBLISH_OK), REQUEST_UPDATE (REQUEST_UPDATE_OK), TRACK_STATUS,
SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS and PUBLISH_NAMESPACE; the codec checks the union of
their parameter allow-lists, and :func:`check_request_ok` the one of the request answered,
together with "Track Properties ... are empty in [all but TRACK_STATUS_OK]. If an endpoint
receives Track Properties in one of these messages it MUST close the session with a
PROTOCOL_VIOLATION".

Draft 18's message table (§"Control Messages") still lists ``0x1E PUBLISH_OK
({{message-request-ok}})``, while its REQUEST_OK section makes PUBLISH_OK a shorthand for
REQUEST_OK (0x7) and its change log says "Remove PUBLISH_OK message type, make it a REQUEST_OK
alias (#1611)". A draft-18 peer that follows the table sends type 0x1E with REQUEST_OK's body:
on draft 18 we accept it (:class:`PublishOk`) as the answer to a PUBLISH only; we send 0x7.
Drafts 20+ list 0x1E as "RESERVED (PUBLISH_OK in <= 17)": unknown there.

REQUEST_ERROR codes are kept as received (``error_code``); unknown codes read as
INTERNAL_ERROR through :attr:`RequestError.code` and never close the session
(moqt-reference §2.9). The Redirect rules that need the request or the role (a server
receiving a non-empty Connect URI; a non-empty Track Name for a namespace-scoped request) are in
:func:`check_redirect`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...wire.buffer import Reader, Writer
from ...wire.kvp import KeyValuePair
from ..errors import RequestErrorCode, request_error_code
from ..version import Version
from ._base import (
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
)
from ._fields import (
    TrackProperties,
    check_vi64,
    read_reason_phrase,
    read_track_properties,
    read_uri,
    violation,
    write_reason_phrase,
    write_track_properties,
    write_uri,
)
from .names import TrackNamespace, read_full_track_name, write_full_track_name
from .params import (
    MessageParameters,
    ParamContext,
    check_parameters,
    read_parameters,
    write_parameters,
)

__all__ = ["PublishOk", "Redirect", "RequestError", "RequestOk", "check_redirect",
           "check_request_ok"]

#: No limit is stated for the Connect URI; the 16-bit Message Length bounds it.
_MAX_CONNECT_URI_LENGTH = 0xFFFF


@dataclass(frozen=True, slots=True)
class RequestOk(Message):
    """REQUEST_OK (a.k.a. PUBLISH_OK, REQUEST_UPDATE_OK, TRACK_STATUS_OK, ...)."""

    TYPE = 0x07
    NAME = "REQUEST_OK"
    PARAMS = ParamContext.REQUEST_OK
    ON_REQUESTS = {
        PUBLISH_TYPE: Sender.EITHER,  # PUBLISH_OK from the subscriber; REQUEST_UPDATE_OK from it
        SUBSCRIBE_TYPE: Sender.RESPONDER,  # REQUEST_UPDATE_OK
        FETCH_TYPE: Sender.RESPONDER,  # REQUEST_UPDATE_OK
        TRACK_STATUS_TYPE: Sender.RESPONDER,
        PUBLISH_NAMESPACE_TYPE: Sender.RESPONDER,
        SUBSCRIBE_NAMESPACE_TYPE: Sender.RESPONDER,
        SUBSCRIBE_TRACKS_TYPE: Sender.RESPONDER,
    }

    parameters: MessageParameters = MessageParameters()
    track_properties: TrackProperties = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "track_properties", tuple(KeyValuePair(*kv) for kv in self.track_properties)
        )

    def encode_body(self, w: Writer, version: Version) -> None:
        write_parameters(w, version, self.PARAMS, self.parameters)
        write_track_properties(w, self.track_properties)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> RequestOk:
        params = read_parameters(r, version, cls.PARAMS)
        return cls(params, read_track_properties(r))


@dataclass(frozen=True, slots=True)
class PublishOk(RequestOk):
    """Draft 18's table entry ``0x1E PUBLISH_OK``: a REQUEST_OK body under the old type,
    answering a PUBLISH (module docstring). Everything that takes a REQUEST_OK takes it."""

    TYPE = 0x1E
    NAME = "PUBLISH_OK"
    VERSIONS = frozenset({Version.DRAFT_18})
    PARAMS = ParamContext.PUBLISH_OK
    ON_REQUESTS = {PUBLISH_TYPE: Sender.RESPONDER}


def check_request_ok(version: Version, msg: RequestOk, answers: ParamContext, *,
                     strict: bool = False) -> RequestOk:
    """Session check of a REQUEST_OK that answers ``answers`` (e.g. ``TRACK_STATUS_OK``):
    Track Properties only in TRACK_STATUS_OK (PROTOCOL_VIOLATION, as the draft says); returns
    the message without the parameters ``answers`` does not list (ignored and logged, see
    :func:`~.params.check_parameters`; ``strict``: PROTOCOL_VIOLATION)."""
    if msg.track_properties and answers is not ParamContext.TRACK_STATUS_OK:
        raise violation(f"Track Properties in a REQUEST_OK answering {answers.value}")
    params = check_parameters(version, answers, msg.parameters, strict=strict)
    return msg if params is msg.parameters else dataclasses.replace(msg, parameters=params)


@dataclass(frozen=True, slots=True)
class Redirect:
    """§"Redirect Structure": where to retry the request (empty URI: this session)."""

    connect_uri: str = ""
    track_namespace: TrackNamespace = ()
    track_name: bytes = b""

    def __post_init__(self) -> None:
        object.__setattr__(self, "track_namespace", tuple(bytes(f) for f in self.track_namespace))
        object.__setattr__(self, "track_name", bytes(self.track_name))

    def write(self, w: Writer) -> None:
        write_uri(w, self.connect_uri, _MAX_CONNECT_URI_LENGTH, "Connect URI")
        write_full_track_name(w, self.track_namespace, self.track_name)

    @classmethod
    def read(cls, r: Reader) -> Redirect:
        uri = read_uri(r, _MAX_CONNECT_URI_LENGTH, "Connect URI")
        namespace, name = read_full_track_name(r)
        return cls(uri, namespace, name)


@dataclass(frozen=True, slots=True)
class RequestError(Message):
    """REQUEST_ERROR; ``redirect`` is present iff ``error_code`` is REDIRECT (0x34)."""

    TYPE = 0x05
    NAME = "REQUEST_ERROR"
    # The responder rejects a request; on a PUBLISH stream the publisher (its requester) also
    # rejects the subscriber's REQUEST_UPDATE.
    ON_REQUESTS = {
        t: (Sender.EITHER if t == PUBLISH_TYPE else Sender.RESPONDER) for t in REQUEST_TYPES
    }

    error_code: int
    retry_interval: int = 0
    error_reason: str = ""
    redirect: Redirect | None = None

    def __post_init__(self) -> None:
        check_vi64("Error Code", self.error_code)
        check_vi64("Retry Interval", self.retry_interval)
        if (self.redirect is not None) != (self.error_code == RequestErrorCode.REDIRECT):
            raise ValueError("a Redirect is present exactly when the Error Code is REDIRECT")

    @property
    def code(self) -> RequestErrorCode:
        """The error code; unknown codes read as INTERNAL_ERROR."""
        return request_error_code(self.error_code)

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.error_code)
        w.push_vi64(self.retry_interval)
        write_reason_phrase(w, self.error_reason)
        if self.redirect is not None:
            self.redirect.write(w)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> RequestError:
        code = r.pull_vi64()
        retry = r.pull_vi64()
        reason = read_reason_phrase(r)
        redirect = Redirect.read(r) if code == RequestErrorCode.REDIRECT else None
        return cls(code, retry, reason, redirect)


def check_redirect(
    version: Version, msg: RequestError, request_type: int, *, receiver_is_server: bool
) -> None:
    """Session checks of a Redirect (§"Redirect Structure"), PROTOCOL_VIOLATION: a server
    receiving a non-empty Connect URI; a non-empty Track Name answering a namespace-scoped
    request (PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE; SUBSCRIBE_TRACKS too from draft 20)."""
    if msg.redirect is None:
        return
    if receiver_is_server and msg.redirect.connect_uri:
        raise violation("a server received a Redirect with a Connect URI")
    scoped = {PUBLISH_NAMESPACE_TYPE, SUBSCRIBE_NAMESPACE_TYPE}
    if version >= Version.DRAFT_20:
        scoped.add(SUBSCRIBE_TRACKS_TYPE)
    if request_type in scoped and msg.redirect.track_name:
        raise violation("Redirect with a Track Name for a namespace-scoped request")
