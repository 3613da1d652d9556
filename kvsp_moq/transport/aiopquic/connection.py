"""The :class:`~kvsp_moq.transport.api.Connection` of the aiopquic backend: :class:`AiopquicConnection`.

It sits on one aiopquic ``QuicConnection`` (a client's own, or one of a server's engine)
through a :class:`~.stack.StackProtocol`, which hands it aiopquic's events and the
raw ring entries, in order, on the loop thread; it calls the upper layer's handler from
there. The send side of its streams is :class:`~.sending.SendStreams`.

What picoquic (through aiopquic 0.6.1) cannot do, and what this class does instead:

* **Close reasons.** picoquic sends CONNECTION_CLOSE without a reason phrase and does not
  report the peer's: ``close(code, reason)`` keeps ``reason`` in our own ``close_info`` only;
  a peer's close arrives with its code and an empty reason (RFC 9000 §19.19 allows both).
* **Who closed, and why, for a transport close.** aiopquic reports a peer's application close
  (``_EVT_APP_CLOSE``, code = the peer's) apart from a transport close (``_EVT_CLOSE``), whose
  code is the *peer's* error — 0 when this end closed (our own close, the idle timeout, an
  error picoquic detected here). A transport close with code 0 that we did not ask for is
  reported as local, reason ``"closed by picoquic ..."``; a TLS failure detected here (an
  untrusted certificate) fails ``connect`` with ``ConnectError.error_code`` None.
* **PING.** aiopquic has no call to send one. :meth:`ping` waits until picoquic reports
  nothing in flight on a snapshot requested after the call (everything sent before it was
  acknowledged): a round trip when something was in flight, only a round trip to the network
  thread when nothing was.
* **Acknowledgements.** picoquic reports none to the application; :meth:`drain` waits for
  every stream's queue and ring to empty, every finished stream to be released (acknowledged,
  see :mod:`.sending`), then for nothing in flight (:meth:`ping`'s check). The
  in-flight figure comes from snapshots of picoquic's state that the network thread sends on
  request, so it is re-read on a timer (:data:`_TICK` .. :data:`_TICK_MAX`) while someone
  waits: picoquic has no "acknowledged" event to wait on.
* **STOP_SENDING.** picoquic neither resets the stream nor stops pulling from its ring; we
  reset it with the same code (RFC 9000 §3.5).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .config import DATAGRAM_CEILING
from .sending import SendStreams
from .stack import (
    EVT_APP_CLOSE,
    EVT_CLOSE,
    EVT_STREAM_DESTROY,
    EVT_STREAM_TX_DRAINED,
    events,
)
from ..api import (
    Address,
    CloseInfo,
    ConnectError,
    ConnectionClosedError,
    HandlerFactory,
    StreamClosedError,
)
from ..config import TransportConfig
from ..connection_core import (
    CRYPTO_ERROR,
    DATAGRAM_MISSING_REASON,
    NO_APPLICATION_PROTOCOL,
    ConnectionCore,
    datagram_payload_limit,
)
from ..url import MoqtUrl

__all__ = ["AiopquicConnection"]

logger = logging.getLogger(__name__)

_PACKET_NUMBER_SIZE = 4  # the longest a short header carries (RFC 9000 §17.1)
_HANDSHAKE_FAILURE = CRYPTO_ERROR + 40  # RFC 8446 handshake_failure
#: How often a waiter re-reads picoquic's in-flight figure (seconds): a quarter of the
#: smoothed RTT, within these bounds.
_TICK = 0.001
_TICK_MAX = 0.05
_LOCAL_CLOSE_REASON = ("closed by picoquic: idle timeout, an error detected here, or the "
                       "peer's transport close without error (picoquic does not say which)")


class AiopquicConnection(ConnectionCore):
    """A :class:`~kvsp_moq.transport.api.Connection` on an aiopquic ``QuicConnection``; what
    does not depend on the library is :class:`~kvsp_moq.transport.connection_core.ConnectionCore`'s."""

    _log = logger

    def __init__(self, *, quic: Any, config: TransportConfig, handler_factory: HandlerFactory,
                 url: MoqtUrl | None, peer: Address | None, ring_cap: int,
                 admit: Callable[[], tuple[int, str] | None] = lambda: None,
                 on_ended: Callable[[AiopquicConnection], None] | None = None) -> None:
        super().__init__(quic=quic, config=config, handler_factory=handler_factory, url=url,
                         peer=peer, on_ended=on_ended)
        self._admit = admit
        self._datagram_limit = 0
        self._raw_close: tuple[int, int] | None = None  # (entry type, code): the first close
        self._sends = SendStreams(quic, ring_cap, self._check_waiters)
        self._flight_waiters: list[asyncio.Future[None]] = []
        self._tick: asyncio.TimerHandle | None = None
        self.datagrams_dropped = 0  # datagrams aiopquic's send ring had no room for

    # -- identity ---------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return "aiopquic"

    @property
    def max_datagram_payload(self) -> int:
        return self._datagram_limit

    # -- streams ----------------------------------------------------------------------------
    def _open_stream(self, unidirectional: bool) -> int:
        return int(self._quic.get_next_available_stream_id(is_unidirectional=unidirectional))

    def _send_stream(self, stream_id: int, data: bytes | bytearray | memoryview,
                     end_stream: bool) -> None:
        self._sends.send(stream_id, data, end_stream)

    def _abandon(self, stream_id: int, error_code: int, *, peer_stopped: bool) -> bool:
        # picoquic resets neither on STOP_SENDING (and would keep sending what is in the
        # ring): we do, with the same code (RFC 9000 §3.5).
        if not self._sends.abandon(stream_id, error_code):
            return False
        self._quic.reset_stream(stream_id, error_code)
        return True

    def _stop_stream(self, stream_id: int, error_code: int) -> None:
        self._quic.stop_stream(stream_id, error_code)

    # -- backpressure -----------------------------------------------------------------------
    def stream_send_buffered(self, stream_id: int) -> int:
        return self._sends.buffered(stream_id)

    def _send_closed_code(self, stream_id: int) -> int | None:
        return self._sends.closed_code(stream_id)[1]

    def _buffered(self, stream_id: int) -> int:
        return self._sends.buffered(stream_id)

    def _watch(self, stream_id: int) -> None:
        self._sends.arm(stream_id)  # one wake-up per arm: ask for the next one

    def _check_waiters(self, stream_id: int | None) -> None:
        self._wake_waiters(stream_id)
        if self._flight_waiters:
            self._schedule_tick(0.0)

    async def drain(self) -> None:
        self._check_open()
        for stream_id in self._sends.sending():
            try:
                await self.wait_writable(stream_id, 0)
            except StreamClosedError:
                continue  # reset or stopped meanwhile: drained
        await self._nothing_in_flight()

    async def ping(self) -> None:
        self._check_open()
        await self._nothing_in_flight()

    async def _nothing_in_flight(self) -> None:
        """Until a snapshot of picoquic's state taken after this call shows no bytes in
        flight. The first read only asks for a fresh snapshot."""
        self._quic.path_quality()  # the network thread answers with a new snapshot
        fut: asyncio.Future[None] = self._loop.create_future()
        self._flight_waiters.append(fut)
        self._schedule_tick(self._tick_interval())
        try:
            await fut
        finally:
            if fut in self._flight_waiters:
                self._flight_waiters.remove(fut)

    def _tick_interval(self) -> float:
        quality = self._quic.path_quality()
        rtt = quality.get("rtt", 0) / 1e6 if quality else 0.0
        return min(_TICK_MAX, max(_TICK, rtt / 4))

    def _schedule_tick(self, delay: float) -> None:
        if self._tick is None:
            self._tick = self._loop.call_later(max(delay, _TICK), self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        if not self._flight_waiters or self._close_info is not None:
            return
        quality = self._quic.path_quality()  # reads the last answer, asks for another
        if quality and quality.get("bytes_in_transit", 1) == 0:
            for fut in self._flight_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._flight_waiters.clear()
        else:
            self._schedule_tick(self._tick_interval())

    # -- datagrams --------------------------------------------------------------------------
    def _send_datagram_frame(self, data: bytes) -> None:
        if not self._quic.send_datagram_frame(data):
            self.datagrams_dropped += 1  # the ring is full: lost, like any datagram may be
            logger.debug("%s: datagram dropped, send ring full", self)

    # -- lifetime ---------------------------------------------------------------------------
    def _close_quic(self, error_code: int, reason: str) -> str:
        self._quic.close(error_code)  # an application close (0x1d), without the reason
        return reason

    def _release(self, exc: ConnectionClosedError) -> None:
        self._sends.close()
        for fut in self._flight_waiters:
            if not fut.done():
                fut.set_exception(exc)
        self._flight_waiters.clear()
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def _connect_error(self, info: CloseInfo) -> ConnectError:
        return _connect_error(info, self._config)

    def terminated(self) -> None:
        """The connection is gone (its close event, or its server stopped): wake
        ``wait_closed`` and tell the owner, once."""
        if self._close_info is None:
            self._mark_closed(CloseInfo(0, "transport stopped", application=False, local=True))
        self._ended()

    # -- events from aiopquic ---------------------------------------------------------------
    def raw_event(self, evt_type: int, stream_id: int, error_code: int) -> None:
        if evt_type == EVT_STREAM_TX_DRAINED:
            self._sends.tx_drained(stream_id)
        elif evt_type == EVT_STREAM_DESTROY:
            self._sends.released(stream_id)
        elif evt_type in (EVT_APP_CLOSE, EVT_CLOSE) and self._raw_close is None:
            # The first says it: a peer's application close comes as APP_CLOSE, then CLOSE.
            self._raw_close = (evt_type, error_code)

    def quic_event(self, event: Any) -> None:
        if isinstance(event, events.StreamDataReceived):
            if event.end_stream:
                self._sends.receive_finished(event.stream_id)
        elif isinstance(event, events.StreamReset):
            self._sends.receive_finished(event.stream_id)
        elif isinstance(event, events.StopSendingReceived):
            if self._close_info is None:  # with or without a handler: our send side ends
                self._on_stop_sending(event.stream_id, event.error_code)
            return
        elif isinstance(event, events.HandshakeCompleted):
            self._on_handshake(event.alpn_protocol)
            return
        elif isinstance(event, events.ConnectionTerminated):
            self._on_terminated(event.error_code)
            return
        self._deliver(event, events)

    def _on_handshake(self, alpn: str | None) -> None:
        if self._close_info is not None:
            return
        quic = self._quic
        if self._peer is None:
            peer = quic.peer_address()
            self._peer = None if peer is None else (str(peer[0]), int(peer[1]))
        if alpn is None or alpn not in self._config.alpn_protocols:
            self.refuse(NO_APPLICATION_PROTOCOL, f"no common ALPN protocol ({alpn!r})")
            return
        params = quic.peer_transport_parameters or {}
        peer_frame = int(params.get("max_datagram_frame_size") or 0)
        if self._refuse_without_datagrams(peer_frame):
            return
        refusal = self._admit()
        if refusal is not None:
            self.refuse(*refusal)
            return
        if peer_frame:  # within aiopquic's own ceiling too
            self._datagram_limit = datagram_payload_limit(
                self._config.max_datagram_size, _PACKET_NUMBER_SIZE, peer_frame,
                int(quic.max_datagram_payload()) or DATAGRAM_CEILING)
        self._start_handler(alpn)

    def _on_terminated(self, error_code: int) -> None:
        kind, code = self._raw_close or (EVT_CLOSE, error_code)
        if kind == EVT_APP_CLOSE:
            self._mark_closed(CloseInfo(code, "", application=True, local=False))
        elif code:
            self._mark_closed(CloseInfo(code, "", application=False, local=False))
        else:  # ours (already marked), or one picoquic began here
            self._mark_closed(CloseInfo(0, _LOCAL_CLOSE_REASON, application=False, local=True))
        self.terminated()


def _connect_error(info: CloseInfo, config: TransportConfig) -> ConnectError:
    offered = list(config.alpn_protocols)
    tls_alert = CRYPTO_ERROR <= info.error_code <= CRYPTO_ERROR + 0xFF and not info.application
    if info.error_code == NO_APPLICATION_PROTOCOL and (tls_alert or info.local):
        what = f"no common ALPN protocol: we offered {offered}"
    elif tls_alert and info.error_code == _HANDSHAKE_FAILURE:
        # qh3 (2.1) answers an ALPN mismatch with handshake_failure; picoquic does not show
        # us the reason phrase that would say so.
        what = (f"TLS handshake failed: handshake_failure (alert 40) from the server, which a "
                f"qh3 server sends when there is no common ALPN protocol; we offered {offered}")
    elif tls_alert:
        what = f"TLS handshake failed: alert {info.error_code & 0xFF} from the server"
    elif info.application and info.reason == DATAGRAM_MISSING_REASON:
        what = f"the server: {info.reason}"
    elif info.local and not info.application and not config.insecure:
        # picoquic reports no code for a failure it detected itself.
        return ConnectError(
            "TLS handshake failed or was aborted here (an untrusted certificate, a name "
            "mismatch, ...; picoquic reports no error code for a failure it detected itself)",
            error_code=None, reason=info.reason)
    else:
        what = f"connection closed during the handshake: {info}"
    return ConnectError(what, error_code=info.error_code, reason=info.reason)
