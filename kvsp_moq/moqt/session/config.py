"""Roles, states and local settings of the sans-IO MOQT session (:mod:`.machine`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from ..messages import Token

__all__ = ["Role", "SessionConfig", "SessionState"]


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


class SessionState(Enum):
    #: Our SETUP may be sent; the peer's has not arrived.
    SETUP = "setup"
    ESTABLISHED = "established"
    #: GOAWAY sent or received: no new requests.
    DRAINING = "draining"
    CLOSED = "closed"


@dataclass
class SessionConfig:
    """Local settings of a session, including every Setup Option our SETUP carries."""

    #: Client: the PATH / AUTHORITY options to send (native QUIC only, §"PATH", §"AUTHORITY").
    path: str | None = None
    authority: str | None = None
    #: Server: decides whether a PATH / AUTHORITY is served (False → INVALID_PATH /
    #: INVALID_AUTHORITY). None accepts any well-formed value.
    accept_path: Callable[[str | None], bool] | None = None
    accept_authority: Callable[[str | None], bool] | None = None
    #: The session runs over WebTransport (set by the driver from its connection): PATH and
    #: AUTHORITY are not sent, and a peer's are refused with INVALID_PATH /
    #: INVALID_AUTHORITY (§"PATH", §"AUTHORITY": "MUST NOT be used ... when WebTransport is
    #: used"); the CONNECT request carries the URL instead.
    webtransport: bool = False
    implementation: str | None = "kvsp-moq"
    #: MAX_REQUEST_UPDATES we advertise (draft 19+; None: not sent = unlimited).
    max_request_updates: int | None = None
    #: AUTHORIZATION TOKEN Setup Options of our SETUP, in order (draft-20
    #: §"AUTHORIZATION TOKEN"; USE_VALUE or REGISTER: nothing is registered before SETUP).
    authorization_tokens: Sequence[Token] = ()
    #: MAX_AUTH_TOKEN_CACHE_SIZE we advertise (§"MAX_AUTH_TOKEN_CACHE_SIZE"; None: not sent,
    #: i.e. 0: the peer may not register token aliases).
    max_auth_token_cache_size: int | None = None
    #: Bytes held per data stream whose Track Alias is not known yet, and in total before the
    #: peer's SETUP; beyond them the stream is stopped with EXCESSIVE_LOAD.
    max_pending_stream_bytes: int = 1 << 20
    #: Data streams held at once for a Track Alias not known yet, and their bytes together;
    #: beyond either the stream is stopped with EXCESSIVE_LOAD.
    max_pending_streams: int = 1024
    max_pending_total_bytes: int = 16 << 20
    #: Requests of the peer we serve at once (draft-ietf-moq-transport-22 §"Subscription
    #: Amplification": "MAY reject excessive subscriptions with REQUEST_ERROR using the
    #: EXCESSIVE_LOAD error code"; §"State maintenance"). Since draft 17 there is no
    #: MAX_REQUEST_ID: the wire limit is QUIC's MAX_STREAMS, which the transport raises as
    #: streams end. A request beyond this cap is answered REQUEST_ERROR EXCESSIVE_LOAD (Retry
    #: Interval below) and never reaches the application. None: no cap.
    max_concurrent_requests: int | None = 1024
    #: Request streams whose first message is still incomplete, held at once (each buffers
    #: at most one control message, <= 64 KiB); one more is refused with STOP_SENDING +
    #: RESET_STREAM EXCESSIVE_LOAD (§"Session initialization": an endpoint "MAY reset such
    #: bidirectional streams").
    max_incomplete_requests: int = 64
    #: Retry Interval (ms) sent with that EXCESSIVE_LOAD (§"REQUEST_ERROR": 0 = do not retry;
    #: on the wire the value is ms + 1).
    excessive_load_retry_ms: int = 1000
    #: Gaps the session tracks per ID space (the peer's Request IDs, its request streams, its
    #: unidirectional streams, retired Track Aliases): finished IDs are a range set
    #: (:mod:`kvsp_moq.moqt.rangeset`), a watermark plus one range per run above a gap. A peer
    #: that leaves more gaps than this has its lowest gaps taken as used (a Request ID there is
    #: then INVALID_REQUEST_ID, a stream there is ignored). The same number bounds the retired
    #: Track Aliases remembered and the finished SUBSCRIBEs/FETCHes whose data routing waits
    #: for ``release()`` (oldest dropped first). Bounds the session's state by this, not by
    #: the number of requests it has seen.
    max_id_gaps: int = 4096
    #: Setup Options of types this layer does not know (e.g. GREASE), sent as they are.
    extra_setup_options: Sequence[tuple[int, int | bytes]] = ()
