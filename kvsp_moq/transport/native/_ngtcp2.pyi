"""QUIC v1 over ngtcp2 and GnuTLS in a network thread of its own (the C extension beside
this stub; nq.h maps its sources).

An :class:`Endpoint` is one UDP socket and one network thread that does every per-packet
step. Python learns what happened by draining :meth:`Endpoint.events` when
:meth:`Endpoint.fileno` (an eventfd) turns readable. Events are tuples, first element the
kind; those of one connection come in order:

``("established", conn, alpn, (peer_host, peer_port))``
    Handshake complete (RFC 9001 §4.1.1); for a server also how a new connection appears.
``("stream", conn, stream_id, data, fin)``
    Stream bytes in order: everything received for the stream since the last drain, in one
    ``bytes``. Flow-control credit for them is extended when they are handed over, so a
    receiver that does not drain holds at most its windows (RFC 9000 §4).
``("reset", conn, stream_id, code)``
    The peer reset its side of a stream Python had seen (RESET_STREAM).
``("stop_sending", conn, stream_id, code)``
    The peer asked us to stop sending (STOP_SENDING); ngtcp2 0.12 reports it only once the
    stream closes, so it comes after ngtcp2's RESET_STREAM is acknowledged (and, on a
    bidirectional stream, after the receive side has ended too).
``("datagram", conn, data)``
    A DATAGRAM frame (RFC 9221); dropped past 1 MiB of undrained datagrams.
``("acked", conn, stream_id, buffered_now)``
    The stream's send buffer shrank (at most one per stream per drain).
``("stream_limit", conn)``
    The peer's stream limit grew: an ``open_stream`` refused with BlockingIOError may retry.
``("pong", conn, n)``
    The PING of :meth:`Endpoint.ping` number ``n`` (and every earlier one) was answered: a
    packet sent with it or after it was acknowledged.
``("object", conn, reg, stream_id, group, subgroup, object, length, status, priority, digest, properties)``
    One object of a data stream parsed into the destinations of registration ``reg``
    (:meth:`Endpoint.receive_objects`): its fields (``subgroup`` None for a Datagram-preference
    fetch object, ``priority`` None when a subgroup header left it to the subscription), the
    SHA-256 of its payload computed as it landed (None: the payload was discarded), its raw
    Object Properties. One per object, never per packet.
``("objects_end", conn, reg, stream_id, result, code, reason)``
    A registered data stream ended: ``result`` ``"fin"``, ``"reset"`` (the peer's
    RESET_STREAM, ``code`` its code), ``"violation"`` (a malformed stream: the session must be
    closed with ``code``, PROTOCOL_VIOLATION), ``"limit"`` (Object Properties past the limit)
    or ``"refused"`` (an object outside the registration or of another length than its
    destination); after the last two the extension has stopped the stream (STOP_SENDING
    ``code``: EXCESSIVE_LOAD, CANCELLED).
``("closed", conn, code, reason, app, by_peer)``
    The connection ended (the last event; the handle is invalid after it). A TLS failure is
    ``0x100 + alert`` (RFC 9001 §4.8); an idle timeout is code 0, reason ``"idle timeout"``.

Errors: an unknown or closing connection raises ConnectionError; a stream limit or a full
datagram queue BlockingIOError; a closed endpoint, an unknown stream or an operation its
state forbids ValueError.
"""

from typing import Any

from typing_extensions import Buffer

class ObjectParser:
    """The MOQT data-stream parser of the network thread (nq_moqt.c), fed from Python: SUBGROUP
    (``kind`` 1) or FETCH (2) streams, or either (0), with the destination rules of
    :meth:`Endpoint.receive_objects` (``dests`` for objects ``first..`` of ``group``; an empty
    list discards every payload)."""

    def __init__(self, kind: int, group: int, first: int, dests: list[Any], *,
                 timed_out_range: bool = True, descending: bool = False,
                 max_properties_length: int = 1 << 20) -> None: ...
    def feed(self, data: Buffer, fin: bool = False) -> list[tuple[Any, ...]]:
        """Events of these bytes: ``("subgroup" | "fetch", id)`` once the header is read;
        ``("object", group, subgroup, object, length, status, priority, digest, properties)``
        per object; ``("end_of_range", kind, group, object)``; last, once the stream is over
        for the parser, ``("end", result, code, reason)`` (results as ``objects_end``)."""

def version() -> dict[str, str]:
    """``{"ngtcp2": ..., "gnutls": ...}``: the library versions in use."""

class Endpoint:
    def __init__(
        self,
        server: bool,
        host: str,
        port: int,
        *,
        alpns: list[str],
        cert_file: str | None = None,
        key_file: str | None = None,
        ca_file: str | None = None,
        verify: bool = True,
        cc: str = "bbr",
        max_udp_payload: int = 1452,
        idle_timeout_ms: int = 30000,
        initial_max_data: int,
        initial_max_stream_data: int,
        initial_max_streams_bidi: int,
        initial_max_streams_uni: int,
        max_datagram_frame_size: int = 65535,
        gso: bool = True,
        gro: bool = True,
        max_connections: int = 1024,
        reuse_port: bool = False,
    ) -> None:
        """Bind a UDP socket (port 0: any) and start the network thread.

        A server needs ``cert_file`` and ``key_file`` (PEM) and selects the first of its
        ``alpns`` the client offers. A client verifies the server against ``ca_file`` (the
        system's trust store when None) unless ``verify`` is False. ``cc``: reno, cubic,
        bbr or bbr2. ``max_udp_payload`` (1200..65527): below 1452 ngtcp2 probes the path
        from 1200 (in its steps 1232, 1342, 1406, 1444); from 1452, the size is used as is.
        ``max_datagram_frame_size`` 0 offers no DATAGRAM. ``max_connections`` bounds the
        connections of the endpoint. ``reuse_port``: bind with SO_REUSEPORT, so several
        endpoints (processes) may share the port, the kernel spreading peers over them by
        address."""
    def local_address(self) -> tuple[str, int]: ...
    def fileno(self) -> int:
        """An eventfd, readable while events are pending."""
    def events(self) -> list[tuple[Any, ...]]:
        """Drain the event queue (and clear the eventfd)."""
    def close(self) -> None:
        """Close every connection (CONNECTION_CLOSE, NO_ERROR), stop the thread, free
        everything. Idempotent."""
    def connect(self, host: str, port: int, server_name: str) -> int:
        """Start a connection (client endpoints); returns its handle."""
    def open_stream(self, conn: int, uni: bool) -> int:
        """A new stream's ID; BlockingIOError at the peer's stream limit."""
    def send(self, conn: int, stream_id: int, data: Buffer, fin: bool = False, *,
             hold: bool = False) -> None:
        """Queue a copy of ``data`` (and FIN); freed as the peer acknowledges it. ``hold``
        (4 KiB and more): no copy; the extension holds a buffer of ``data`` (its exporter
        cannot resize) and sends from it; the buffer is released at the first :meth:`events`
        after its bytes are all acknowledged or its stream closed (reset included), or by
        :meth:`close`. The bytes must not change meanwhile."""
    def buffered(self, conn: int, stream_id: int) -> int:
        """Bytes queued on the stream and not yet acknowledged."""
    def watch_acked(self, conn: int, stream_id: int, threshold: int) -> int:
        """Wait on the stream's acknowledgements: signal the event fd (an ``acked`` event)
        once its buffered bytes fall to ``threshold``. From the first call on, the stream's
        ``acked`` events signal only so (else they are drained with the next signalled
        event); before it, each one does. Returns the buffered bytes now (0: the stream is
        gone): a count already reached gets no signal."""
    def reset_stream(self, conn: int, stream_id: int, code: int) -> None: ...
    def stop_sending(self, conn: int, stream_id: int, code: int) -> None: ...
    def send_datagram(self, conn: int, data: Buffer) -> None:
        """ValueError when the peer offered no DATAGRAM or ``data`` exceeds
        :meth:`max_datagram_payload`; BlockingIOError past 1 MiB queued."""
    def close_connection(self, conn: int, code: int, reason: Buffer = b"",
                         app: bool = True) -> None: ...
    def stats(self, conn: int) -> dict[str, Any]:
        """smoothed_rtt_ms, min_rtt_ms, latest_rtt_ms, pto_ms (RFC 9002 §6.2), cwnd,
        bytes_in_flight, pacing_rate (bytes/s), delivery_rate, bytes_sent, bytes_received
        (UDP payload bytes), packets_lost (packets carrying STREAM frames declared lost),
        max_udp_payload (the path's, as probed), cc. Also during the closing or draining
        period after the ``closed`` event, while the extension keeps the connection."""
    def max_datagram_payload(self, conn: int) -> int:
        """The largest datagram ``send_datagram`` takes now (0: the peer offered none)."""
    def receive_objects(self, conn: int, kind: int, id: int, group: int, first: int,
                        dests: list[Any], *, timed_out_range: bool = True,
                        descending: bool = False, max_properties_length: int = 1 << 20) -> int:
        """Land the objects ``first .. first + len(dests) - 1`` of ``group`` of the peer's data
        stream of ``kind`` (1 SUBGROUP: ``id`` its Track Alias; 2 FETCH: ``id`` its Request
        ID) in ``dests`` (writable C-contiguous buffers of exactly their object's payload
        length, or None), parsing the stream on the network thread (nq_objects.c); returns the
        registration's handle. The buffers are held until :meth:`forget_objects` (or close).
        Streams nobody registered for reach Python as ``stream`` events, unchanged.
        ``timed_out_range``: End of Timed-Out Range exists (drafts 20+); ``descending``: the
        FETCH's Group Order. ValueError if ``id`` has destinations already."""
    def subscriptions_pending(self, conn: int, delta: int) -> None:
        """``delta`` 1: a SUBSCRIBE of ``conn`` is about to leave; -1: its answer was dispatched
        (and its destinations registered, if any). While some are pending, a SUBGROUP stream
        of a Track Alias nothing registered is held in the extension (its bytes uncredited,
        bounded by the stream's window) instead of going to Python: to the registration of its
        alias when one comes, to Python once none is pending."""
    def forget_objects(self, conn: int, handle: int) -> None:
        """End a registration: once this returns nothing is written into its buffers (a stream
        still landing is stopped with CANCELLED), and they are released."""
    def ping(self, conn: int) -> int:
        """Send a PING (RFC 9000 §19.2) with the next packet; returns its number, which a
        ``("pong", conn, n)`` event with ``n`` at least as large answers. ngtcp2 0.12 reports
        no acknowledgement of a PING: the answer is the acknowledgement of a packet sent with
        it or after it, or nothing left in flight. A peer that answers nothing gets no pong."""
