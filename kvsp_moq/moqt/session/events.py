"""Events and actions of the sans-IO MOQT session (:class:`~.machine.SessionMachine`).

The session is fed transport input (``stream_data``, ``stream_reset``, ``stop_sending``,
``datagram_received``) and answers with two queues:

* **events** — what happened at the MOQT level, for the application layer (``next_event``);
* **actions** — what the I/O layer must do on the QUIC connection (``next_action``), in order.

Every class here is a small frozen dataclass: transitions as data (h11 style). There is no
"open a stream" action: the session asks the transport for each new stream's ID
(:mod:`.streams`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..messages import GoAway, Message, Setup
from ..objects import ObjectDatagram

__all__ = [
    "Action",
    "CloseSession",
    "DataEvent",
    "DataStreamClosed",
    "DataStreamStopped",
    "DatagramReceived",
    "Event",
    "GoawayReceived",
    "RequestCancelled",
    "RequestFinished",
    "RequestMessage",
    "RequestReceived",
    "ResetStream",
    "ResponseReceived",
    "SendDatagram",
    "SendStream",
    "SessionClosed",
    "SetupComplete",
    "StopSending",
    "UpdateAnswered",
    "UpdateReceived",
]


# ------------------------------------------------------------------------------------------
# events


class Event:
    """Base class of session events."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class SetupComplete(Event):
    """The peer's SETUP arrived and was valid; the session is established."""

    peer_setup: Setup


@dataclass(frozen=True, slots=True)
class RequestReceived(Event):
    """The peer opened a request stream; ``message`` is its first message (SUBSCRIBE, FETCH,
    PUBLISH, TRACK_STATUS, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS)."""

    request_id: int
    message: Message


@dataclass(frozen=True, slots=True)
class ResponseReceived(Event):
    """The first response to one of our requests: SUBSCRIBE_OK, FETCH_OK, REQUEST_OK or
    REQUEST_ERROR."""

    request_id: int
    message: Message


@dataclass(frozen=True, slots=True)
class UpdateReceived(Event):
    """The peer sent REQUEST_UPDATE (``message``) for request ``request_id``."""

    request_id: int
    message: Message


@dataclass(frozen=True, slots=True)
class UpdateAnswered(Event):
    """REQUEST_OK / REQUEST_ERROR answering our REQUEST_UPDATE ``update_request_id``."""

    request_id: int
    update_request_id: int
    message: Message


@dataclass(frozen=True, slots=True)
class RequestMessage(Event):
    """Any other message on a request stream: NAMESPACE, NAMESPACE_DONE, PUBLISH_DONE,
    PUBLISH_STATE_NOTIFY, PUBLISH_SKIPPED/BLOCKED, GOAWAY."""

    request_id: int
    message: Message


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    """The peer finished (FIN) its half of the request stream: "nothing more", not cancel."""

    request_id: int


@dataclass(frozen=True, slots=True)
class RequestCancelled(Event):
    """The peer reset or stopped the request stream (cancellation, draft-18+ §"Request
    Streams"); the session has reset its own half and forgotten the request."""

    request_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class GoawayReceived(Event):
    """GOAWAY on the control stream (``request_id`` None) or on a request stream."""

    message: GoAway
    request_id: int | None = None


@dataclass(frozen=True, slots=True)
class DataEvent(Event):
    """A data-plane event of a subscription or fetch: the parser's ``SubgroupHeader``,
    ``FetchHeader``, ``ObjectBegin``, ``ObjectPayload`` (memoryview of received bytes, not
    copied), ``ObjectEnd`` or ``EndOfRange`` (see :mod:`kvsp_moq.moqt.objects`)."""

    request_id: int
    stream_id: int
    event: object


@dataclass(frozen=True, slots=True)
class DataStreamClosed(Event):
    """A data stream of request ``request_id`` ended: FIN (``error_code`` None) or reset."""

    request_id: int
    stream_id: int
    error_code: int | None


@dataclass(frozen=True, slots=True)
class DataStreamStopped(Event):
    """The peer sent STOP_SENDING on one of our data streams (the transport reset it)."""

    request_id: int
    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class DatagramReceived(Event):
    """An OBJECT_DATAGRAM of subscription ``request_id`` (payload: view of the datagram)."""

    request_id: int
    datagram: ObjectDatagram


@dataclass(frozen=True, slots=True)
class SessionClosed(Event):
    """The session is over: we closed it (``local``) or the connection was lost."""

    error_code: int
    reason: str
    local: bool


# ------------------------------------------------------------------------------------------
# actions


class Action:
    """Base class of I/O actions."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class SendStream(Action):
    stream_id: int
    data: bytes
    end_stream: bool = False


@dataclass(frozen=True, slots=True)
class ResetStream(Action):
    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class StopSending(Action):
    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class SendDatagram(Action):
    data: bytes


@dataclass(frozen=True, slots=True)
class CloseSession(Action):
    """Close the connection (CONNECTION_CLOSE application code ``error_code``)."""

    error_code: int
    reason: str
