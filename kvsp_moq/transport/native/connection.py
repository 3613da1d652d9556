"""The :class:`~kvsp_moq.transport.api.Connection` of the native backend: :class:`NativeConnection`.

One connection of an ``_ngtcp2.Endpoint`` (a client's own endpoint, or the server's), known
to the extension by its handle. The endpoint's owner (:mod:`.backend` for a client,
:mod:`.server`) drains the endpoint's events on the loop thread when its eventfd turns
readable and hands each to :meth:`NativeConnection.on_event`, in order; the connection calls
the upper layer's handler from there, through :class:`~..connection_core.ConnectionCore`.

How the interface maps onto the extension (``_ngtcp2.pyi``):

* **Sending.** ``send`` copies the bytes into the extension's send buffer (the network thread
  sends them as congestion and flow control allow); ``send_stable`` (a stored object's
  payload) does not copy: the extension holds the caller's buffer (a ``Py_buffer``) and
  ngtcp2 writes STREAM frames from it, until the bytes are acknowledged or the stream closes. ``stream_send_buffered`` is the
  extension's ``buffered`` (bytes queued and not yet acknowledged); ``wait_writable`` wakes
  on its ``acked`` events; ``drain`` waits for ``buffered`` 0 on every stream sent on (the
  acknowledgement of a FIN alone is not waited for, as with aioquic).
* **Stream credit.** Past the peer's stream limit ``open_bidi``/``open_uni`` still return an
  ID at once: :mod:`.opening` holds the stream until MAX_STREAMS (as aioquic and qh3 do).
* **STOP_SENDING** (RFC 9000 §3.5): ngtcp2 resets the stream itself, with the peer's code,
  and from then on drops what is sent on it (``buffered`` 0). ngtcp2 0.12 has no callback for
  it: the extension reports it when the stream closes — once that RESET_STREAM is
  acknowledged and, on a bidirectional stream, once the receive side ended too. Only then
  does ``send`` raise :class:`StreamClosedError` and the handler hear ``stop_sending``; a
  bidirectional stream whose peer never ends its direction never reports it.
* **PING.** ``ping`` has the extension send a PING and waits for its ``pong`` event: ngtcp2
  0.12 reports no acknowledgement of a PING, so the extension answers when a packet sent
  with it or after it is acknowledged (or nothing is left in flight): a round trip to a live
  peer, never an answer from a dead one.
* **Close.** ``close(code, reason)`` sends an application CONNECTION_CLOSE with both (the
  reason cut to 1024 UTF-8 bytes); a peer's close arrives with its code, reason and kind.
  The extension reports the end (``connection_lost``) as the CONNECTION_CLOSE is sent or
  received, and keeps the closing or draining period; ``wait_closed`` returns once that is
  over (three PTOs), and a client's endpoint is closed then (:mod:`.backend`).
* **A close not yet reported.** The network thread may have seen the connection end (the
  peer's CONNECTION_CLOSE, an idle timeout) before Python drains its ``closed`` event: sends,
  datagrams and opens in between are dropped silently, as aioquic drops them between a close
  and its ``ConnectionTerminated``; ``connection_lost`` follows with the ``closed`` event.
* **Handshake failures**: ``ConnectError`` with the QUIC code: a TLS alert is ``0x100 +
  alert`` (RFC 9001 §4.8) whether the peer or GnuTLS here raised it; ngtcp2's own handshake
  timeout (10 s) is a close with code 0.
* ``congestion_state`` is the extension's ``stats()``: ngtcp2's controller, window, bytes in
  flight, RTTs, pacing and delivery rates, counters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from .opening import StreamOpener
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
    plain_address,
)
from ..url import MoqtUrl

__all__ = ["NativeConnection"]

logger = logging.getLogger(__name__)

_HANDSHAKE_FAILURE = CRYPTO_ERROR + 40  # RFC 8446 handshake_failure
_MAX_REASON = 1024  # bytes of a CONNECTION_CLOSE reason phrase (the extension's limit too)


def _fit_reason(reason: str, limit: int = _MAX_REASON) -> str:
    """A reason phrase of at most ``limit`` UTF-8 bytes (cut at a character boundary)."""
    raw = reason.encode("utf-8")
    return reason if len(raw) <= limit else raw[:limit].decode("utf-8", "ignore")


class NativeConnection(ConnectionCore):
    """A :class:`~kvsp_moq.transport.api.Connection` on one connection of an
    ``_ngtcp2.Endpoint``; what does not depend on the library is
    :class:`~kvsp_moq.transport.connection_core.ConnectionCore`'s."""

    _log = logger

    def __init__(self, *, endpoint: Any, handle: int, config: TransportConfig,
                 handler_factory: HandlerFactory, url: MoqtUrl | None, is_client: bool,
                 peer: Address | None = None,
                 admit: Callable[[], tuple[int, str] | None] = lambda: None,
                 on_ended: Callable[[NativeConnection], None] | None = None) -> None:
        quic = SimpleNamespace(endpoint=endpoint, handle=handle,
                               configuration=SimpleNamespace(is_client=is_client))
        super().__init__(quic=quic, config=config, handler_factory=handler_factory, url=url,
                         peer=peer, on_ended=on_ended)
        self._ep = endpoint
        self._handle = handle
        self._admit = admit
        self._gone = False  # the extension dropped the handle (after its "closed" event)
        self._send_closed: dict[int, int] = {}  # stream -> reset / STOP_SENDING code
        self._sending: dict[int, bool] = {}  # streams sent on, not yet drained -> FIN sent
        self._opener = StreamOpener(endpoint, handle, is_client, self._on_opened)
        self._datagram_limit = 0
        self._pings: list[tuple[int, asyncio.Future[None]]] = []  # (number, waiter)
        self.datagrams_dropped = 0  # datagrams the extension's queue (1 MiB) had no room for
        self._events: dict[str, Callable[[tuple[Any, ...]], None]] = {
            "stream": self._ev_stream, "acked": self._ev_acked, "datagram": self._ev_datagram,
            "reset": self._ev_reset, "stop_sending": self._ev_stop_sending,
            "stream_limit": self._ev_stream_limit, "established": self._ev_established,
            "closed": self._ev_closed, "pong": self._ev_pong, "object": self._ev_object,
            "objects_end": self._ev_object}
        #: Object registrations (:meth:`receive_objects`): handle -> their event callback.
        self._receivers: dict[int, Callable[[tuple[Any, ...]], None]] = {}

    # -- identity ---------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return "native"

    @property
    def handle(self) -> int:
        """Transport-internal: the connection's handle in its endpoint."""
        return self._handle

    def _address_of(self, peer: Any) -> Address:
        return plain_address(peer)

    @property
    def max_datagram_payload(self) -> int:
        if not self._gone:
            try:
                self._datagram_limit = int(self._ep.max_datagram_payload(self._handle))
            except (ConnectionError, ValueError):
                pass  # closing: the last figure
        return self._datagram_limit

    def stats(self) -> dict[str, Any] | None:
        """The extension's statistics of the connection (``Endpoint.stats``); None once it
        has ended."""
        if self._gone:
            return None
        try:
            return dict(self._ep.stats(self._handle))
        except (ConnectionError, ValueError):
            return None

    def congestion_state(self) -> dict[str, Any] | None:
        st = self.stats()
        if st is None:
            return None
        return {"algorithm": st["cc"], "congestion_window": st["cwnd"],
                "bytes_in_flight": st["bytes_in_flight"],
                "smoothed_rtt": st["smoothed_rtt_ms"] / 1e3, "min_rtt": st["min_rtt_ms"] / 1e3,
                "latest_rtt": st["latest_rtt_ms"] / 1e3, "pacing_rate": st["pacing_rate"],
                "delivery_rate": st["delivery_rate"], "bytes_sent": st["bytes_sent"],
                "bytes_received": st["bytes_received"], "packets_lost": st["packets_lost"],
                "max_udp_payload": st["max_udp_payload"]}

    # -- streams ----------------------------------------------------------------------------
    def _open_stream(self, unidirectional: bool) -> int:
        return self._opener.open(unidirectional)

    def _check_sendable(self, stream_id: int) -> None:
        self._check_direction(stream_id)
        code = self._send_closed.get(stream_id)
        if code is not None:
            raise StreamClosedError(stream_id, code)

    def send_stable(self, stream_id: int, data: bytes | bytearray | memoryview,
                    end_stream: bool = False) -> None:
        """:meth:`send` without a copy: the extension holds a buffer of ``data`` (4 KiB and
        more) and sends from it until the peer acknowledged its bytes or the stream closed;
        then it is released at the next drain of the endpoint's events."""
        self._check_open()
        self._check_sendable(stream_id)
        if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
            data = data.cast("B")
        self._send_stream(stream_id, data, end_stream, hold=True)

    def _send_stream(self, stream_id: int, data: bytes | bytearray | memoryview,
                     end_stream: bool, *, hold: bool = False) -> None:
        if self._opener.waiting(stream_id):
            self._opener.send(stream_id, data, end_stream)
        else:
            try:
                self._ep.send(self._handle, stream_id, data, end_stream, hold=hold)
            except ValueError as exc:  # finished, or closed and forgotten
                raise StreamClosedError(stream_id, None, f"stream {stream_id}: {exc}") from None
            except ConnectionError:
                return  # closing: its closed event is queued (nothing more is sent, as aioquic)
        if len(data) or end_stream:
            self._sending[stream_id] = end_stream or self._sending.get(stream_id, False)

    def _abandon(self, stream_id: int, error_code: int, *, peer_stopped: bool) -> bool:
        if stream_id in self._send_closed:
            return False
        self._send_closed[stream_id] = error_code
        self._sending.pop(stream_id, None)
        if self._opener.waiting(stream_id):
            self._opener.reset(stream_id, error_code)
        elif not peer_stopped and not self._gone:  # ngtcp2 answered a STOP_SENDING itself
            try:
                self._ep.reset_stream(self._handle, stream_id, error_code)
            except (ConnectionError, ValueError):
                pass  # finished and acknowledged, or closing: nothing to abandon
        return True

    def _stop_stream(self, stream_id: int, error_code: int) -> None:
        if self._opener.waiting(stream_id):
            self._opener.stop(stream_id, error_code)
            return
        try:
            self._ep.stop_sending(self._handle, stream_id, error_code)
        except (ConnectionError, ValueError):
            pass  # gone, or closing

    def _on_opened(self, stream_id: int) -> None:
        if stream_id in self._waiters:
            self._wake_waiters(stream_id)

    # -- backpressure -----------------------------------------------------------------------
    def stream_send_buffered(self, stream_id: int) -> int:
        return self._buffered(stream_id)

    def _watch(self, stream_id: int) -> None:
        # The extension signals an ``acked`` event only for a stream armed here, once its
        # buffered bytes reach the highest threshold waited for (nq_api_watch_acked): a
        # count reached meanwhile is answered here, as no signal will come for it.
        entries = self._waiters.get(stream_id)
        if not entries or self._gone or self._opener.waiting(stream_id):
            return  # the opener wakes its waiters when the stream opens (_on_opened)
        threshold = max(limit for limit, _ in entries)
        try:
            buffered = int(self._ep.watch_acked(self._handle, stream_id, threshold))
        except (ConnectionError, ValueError):
            return  # closing: its closed event fails the waiters
        if buffered <= threshold:
            self._loop.call_soon(self._wake_waiters, stream_id)

    def _send_closed_code(self, stream_id: int) -> int | None:
        return self._send_closed.get(stream_id)

    def _buffered(self, stream_id: int) -> int:
        if stream_id in self._send_closed or self._gone:
            return 0
        if self._opener.waiting(stream_id):
            return self._opener.buffered(stream_id)
        try:
            return int(self._ep.buffered(self._handle, stream_id))
        except (ConnectionError, ValueError):
            return 0

    async def drain(self) -> None:
        self._check_open()
        for stream_id in list(self._sending):
            try:
                await self.wait_writable(stream_id, 0)
            except StreamClosedError:
                continue  # reset or stopped meanwhile: drained
            if self._sending.get(stream_id):  # finished and acknowledged: forget it
                del self._sending[stream_id]

    async def ping(self) -> None:
        self._check_open()
        try:
            number = int(self._ep.ping(self._handle))
        except ConnectionError:  # closing: its closed event is queued
            raise ConnectionClosedError(CloseInfo(
                0, "connection closing", application=False, local=False)) from None
        entry = (number, self._loop.create_future())
        self._pings.append(entry)
        try:
            await entry[1]
        finally:
            if entry in self._pings:
                self._pings.remove(entry)

    # -- the native data plane ---------------------------------------------------------------
    def receive_objects(self, kind: int, ident: int, group: int, first: int,
                        dests: list[Any], on_event: Callable[[tuple[Any, ...]], None],
                        *, timed_out_range: bool = True, descending: bool = False,
                        max_properties_length: int = 1 << 20) -> int:
        """Have the extension land the objects ``first .. first + len(dests) - 1`` of group
        ``group`` of the peer's data stream of kind ``kind`` (1: SUBGROUP, ``ident`` its
        Track Alias; 2: FETCH, ``ident`` its Request ID) straight in ``dests`` (writable
        buffers, each of exactly its object's payload length, or None: not wanted), hashing
        each payload (SHA-256) as it lands. Call it before the request leaves, so that no byte
        of the answer can precede it. ``on_event`` gets, on the loop thread,
        ``("object", conn, handle, stream_id, group, subgroup, object, length, status,
        priority, digest, properties)`` once per object (digest None: discarded, e.g. a
        duplicate) and ``("objects_end", conn, handle, stream_id, result, code, reason)`` once
        per stream (result ``fin``, ``reset``, ``violation`` — the session must close with
        ``code`` — ``limit`` or ``refused``: the extension stopped the stream with ``code``).
        Returns the registration's handle for :meth:`forget_objects`; the buffers stay in use
        until then. ValueError: this request has destinations already; ConnectionError:
        closed."""
        if self._gone:
            raise ConnectionError("connection closed")
        handle = int(self._ep.receive_objects(
            self._handle, kind, ident, group, first, dests, timed_out_range=timed_out_range,
            descending=descending, max_properties_length=max_properties_length))
        self._receivers[handle] = on_event
        return handle

    def subscriptions_pending(self, delta: int) -> None:
        """A SUBSCRIBE whose objects may land here is about to leave (1), or its answer is
        settled (-1): see ``Endpoint.subscriptions_pending``. A no-op once closed."""
        if not self._gone:
            try:
                self._ep.subscriptions_pending(self._handle, delta)
            except (ConnectionError, ValueError):
                pass  # closing

    def forget_objects(self, handle: int) -> None:
        """End a registration: nothing more lands in its buffers once this returns (a stream
        still landing is stopped with CANCELLED); its later events are dropped."""
        if self._receivers.pop(handle, None) is None:
            return
        try:
            self._ep.forget_objects(self._handle, handle)
        except ValueError:
            pass  # the endpoint closed: it released the buffers with its thread

    def _ev_object(self, event: tuple[Any, ...]) -> None:
        receiver = self._receivers.get(event[2])
        if receiver is not None:
            receiver(event)

    # -- datagrams --------------------------------------------------------------------------
    def _send_datagram_frame(self, data: bytes) -> None:
        try:
            self._ep.send_datagram(self._handle, data)
        except (BlockingIOError, ValueError) as exc:
            # 1 MiB queued already, or the path's limit shrank since the check: lost, like
            # any datagram may be (RFC 9221 §5).
            self.datagrams_dropped += 1
            logger.debug("%s: datagram dropped: %s", self, exc)
        except ConnectionError:
            pass  # closing: its closed event is queued

    # -- lifetime ---------------------------------------------------------------------------
    def _close_quic(self, error_code: int, reason: str) -> str:
        reason = _fit_reason(reason)
        if not self._gone:
            try:
                self._ep.close_connection(self._handle, error_code, reason.encode("utf-8"),
                                          app=True)
            except (ConnectionError, ValueError):
                pass  # closing already
        return reason

    def _release(self, exc: ConnectionClosedError) -> None:
        self._opener.clear()
        self._sending.clear()
        for _, fut in self._pings:
            if not fut.done():
                fut.set_exception(exc)
        self._pings.clear()

    def _connect_error(self, info: CloseInfo) -> ConnectError:
        return _connect_error(info, self._config)

    def terminated(self) -> None:
        """Transport-internal: the connection is gone (its ``closed`` event, or its endpoint
        closed): wake ``wait_closed`` and tell the owner, once."""
        self._gone = True
        if self._close_info is None:
            self._mark_closed(CloseInfo(0, "transport stopped", application=False, local=True))
        self._ended()

    # -- events from the extension ----------------------------------------------------------
    def on_event(self, event: tuple[Any, ...]) -> None:
        """Transport-internal: one event of this connection, as ``Endpoint.events`` gave it."""
        self._events[event[0]](event)

    def _ev_established(self, event: tuple[Any, ...]) -> None:
        if self._close_info is not None:
            return
        alpn, peer = event[2], event[3]
        self._peer = (str(peer[0]), int(peer[1]))
        if alpn not in self._config.alpn_protocols:
            self.refuse(NO_APPLICATION_PROTOCOL, f"no common ALPN protocol ({alpn!r})")
            return
        if self._refuse_without_datagrams(self.max_datagram_payload):
            return
        refusal = self._admit()
        if refusal is not None:
            self.refuse(*refusal)
            return
        self._start_handler(alpn)

    def _ev_stream(self, event: tuple[Any, ...]) -> None:
        if self._handler is not None and self._close_info is None:
            self._call("stream_data", event[2], event[3], event[4])

    def _ev_reset(self, event: tuple[Any, ...]) -> None:
        if self._handler is not None and self._close_info is None:
            self._call("stream_reset", event[2], event[3])

    def _ev_stop_sending(self, event: tuple[Any, ...]) -> None:
        if self._close_info is None:  # with or without a handler: our send side ended
            self._on_stop_sending(event[2], event[3])

    def _ev_datagram(self, event: tuple[Any, ...]) -> None:
        if self._handler is not None and self._close_info is None:
            self._call("datagram_received", event[2])

    def _ev_acked(self, event: tuple[Any, ...]) -> None:
        stream_id, buffered = event[2], event[3]
        if buffered == 0 and self._sending.get(stream_id):
            del self._sending[stream_id]  # finished and acknowledged
        if stream_id in self._waiters:
            self._wake_waiters(stream_id)

    def _ev_pong(self, event: tuple[Any, ...]) -> None:
        answered = event[2]
        for number, fut in self._pings:
            if number <= answered and not fut.done():
                fut.set_result(None)

    def _ev_stream_limit(self, event: tuple[Any, ...]) -> None:
        if self._close_info is None:
            self._opener.retry()

    def _ev_closed(self, event: tuple[Any, ...]) -> None:
        code, reason, application, by_peer = event[2], event[3], event[4], event[5]
        # The extension keeps the closing or draining period (three PTOs, RFC 9000 §10.2):
        # the connection ends for us once it is over, as with aioquic, so that a client's
        # endpoint (and a closing server's) outlives it.
        st = self.stats()
        self._gone = True
        self._mark_closed(CloseInfo(code, reason, application=application, local=not by_peer))
        if st is None:  # dropped without a period (idle timeout, a handshake that failed)
            self.terminated()
        else:
            self._loop.call_later(3 * st["pto_ms"] / 1e3, self.terminated)


def _connect_error(info: CloseInfo, config: TransportConfig) -> ConnectError:
    offered = list(config.alpn_protocols)
    tls_alert = CRYPTO_ERROR <= info.error_code <= CRYPTO_ERROR + 0xFF and not info.application
    if tls_alert and (info.error_code == NO_APPLICATION_PROTOCOL
                      or "alpn" in info.reason.lower()):
        what = f"no common ALPN protocol: we offered {offered} ({info.reason or 'alert 120'})"
    elif info.error_code == NO_APPLICATION_PROTOCOL and info.local and info.application:
        what = f"no common ALPN protocol: we offered {offered} ({info.reason})"
    elif info.application and info.reason == DATAGRAM_MISSING_REASON:
        what = (f"the server: {info.reason}" if info.local else
                f"the server closed the connection: {info.reason} (we are the peer)")
    elif tls_alert and info.error_code == _HANDSHAKE_FAILURE and not info.local:
        # qh3 (2.1) answers an ALPN mismatch with handshake_failure.
        what = (f"TLS handshake failed: handshake_failure (alert 40) from the server "
                f"({info.reason or 'no reason given'}); a qh3 server sends it when there is no "
                f"common ALPN protocol; we offered {offered}")
    elif tls_alert:
        side = "here" if info.local else "by the server"
        what = (f"TLS handshake failed {side}: alert {info.error_code & 0xFF} "
                f"({info.reason or 'no reason given'})")
    else:
        what = f"connection closed during the handshake: {info}"
    return ConnectError(what, error_code=info.error_code, reason=info.reason)
