"""Batched UDP I/O under the QUIC engine: GSO on send, GRO and bursts on receive.

A QUIC library's asyncio layer writes one ``sendto`` per packet and the event loop reads one
datagram per readiness callback (asyncio) or calls back per datagram (uvloop), so every
packet costs a system call and a pass through the loop. :class:`UdpEndpoint` is the
:class:`asyncio.DatagramTransport` the engine (``engine.py``) runs on instead:

* **Send** (:meth:`UdpEndpoint.send_packets`): the packets of one ``datagrams_to_send()``
  batch that go to the same address with the same size go out in one ``sendmsg`` carrying a
  ``UDP_SEGMENT`` control message (Linux UDP GSO, ``udp(7)``; the last segment may be
  shorter): up to :data:`GSO_MAX_SEGMENTS` packets and :data:`GSO_MAX_BYTES` bytes per call.
  The buffers are passed as a gather list, never joined.
* **Receive**: up to :data:`RECV_BURST` reads per readiness callback; with ``UDP_GRO`` the
  kernel may hand several packets of one flow as one buffer whose segment size it reports in
  a control message, which is split here. The engine defers its transmission to after the
  burst, so one ACK-bearing transmission answers many packets.

Support is probed once per address family (:func:`gso_supported`); a send the kernel
refuses with an "unsupported" errno turns GSO off for that socket and the packets are sent
one by one. Off Linux, or with ``TransportConfig.udp_gso/udp_gro`` False, it is plain
``sendto``/``recvfrom`` with the same batching of reads. Errors on send follow UDP: the packet
is dropped and ``protocol.error_received`` is told; QUIC retransmits.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "GSO_MAX_BYTES",
    "GSO_MAX_SEGMENTS",
    "RECV_BURST",
    "SERVER_RECV_BURST_OCTETS",
    "UDP_GRO",
    "UDP_SEGMENT",
    "UdpEndpoint",
    "gso_supported",
    "open_endpoint",
]

logger = logging.getLogger(__name__)

#: Linux socket options (include/uapi/linux/udp.h), level SOL_UDP.
UDP_SEGMENT = 103
UDP_GRO = 104
_SOL_UDP = getattr(socket, "SOL_UDP", 17)
#: The kernel refuses more segments than UDP_MAX_SEGMENTS (64) in one GSO send, and the
#: whole send is one UDP datagram to the stack, so it must stay under 64 KiB.
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65000
#: Reads per readiness callback before yielding to the loop.
RECV_BURST = 64
#: A server socket's burst also ends after this many octets. A server's one socket and loop
#: carry all its connections (a relay: an upstream's flood beside its downstream
#: connections). Between two bursts each connection transmits once, and its pacer then sends
#: at most its bucket (16 packets, aioquic's QuicPacketPacer). Before this bound a burst was
#: 64 reads of up to 64 KiB each (GRO coalesces a GSO sender's packets), so a cold relay's
#: downstream ran at a fraction of the upstream's rate until the upstream was done, and its
#: first layer left 71-98 ms after the request. With 512 KiB the median is 27.5-40 ms over two
#: sittings of alternated runs (direct: 17-24 ms), with block rate and fan-out within their
#: noise. 1 MiB gave 48 ms; 256 KiB gave 25 ms but 8-18 % less fan-out throughput (more passes,
#: each transmitting to every connection). docs/benchmarks.md, issue 16. A client socket serves
#: one connection and keeps the whole burst. At 1452-octet datagrams the 64 reads end the
#: burst first either way.
SERVER_RECV_BURST_OCTETS = 512 * 1024
_RECV_SIZE = 65536  # the largest UDP payload (65527) fits; so does a coalesced GRO buffer
_ANC_SIZE = socket.CMSG_SPACE(4) if hasattr(socket, "CMSG_SPACE") else 0
_MAX_QUEUED = 16 << 20  # bytes kept while the socket is not writable; beyond: dropped
_U16 = struct.Struct("=H")
_I32 = struct.Struct("=i")
_LINUX = sys.platform.startswith("linux")
#: errnos by which a kernel (or device) says it cannot segment this send.
_GSO_REFUSED = frozenset(e for e in (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP,
                                     getattr(errno, "ENOTSUP", None), errno.ENOPROTOOPT)
                         if e is not None)

_gso_probe: dict[int, bool] = {}

Packet = tuple[bytes, Any]


def gso_supported(family: int) -> bool:
    """Whether the kernel accepts UDP_SEGMENT on a socket of ``family``; probed once."""
    cached = _gso_probe.get(family)
    if cached is not None:
        return cached
    ok = False
    if _LINUX:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.setsockopt(_SOL_UDP, UDP_SEGMENT, 1200)
                ok = probe.getsockopt(_SOL_UDP, UDP_SEGMENT) == 1200
        except OSError:
            ok = False
    _gso_probe[family] = ok
    return ok


def _enable_gro(sock: socket.socket) -> bool:
    if not _LINUX:
        return False
    try:
        sock.setsockopt(_SOL_UDP, UDP_GRO, 1)
        return bool(sock.getsockopt(_SOL_UDP, UDP_GRO))
    except OSError:
        return False


def _gro_segment(ancdata: list[tuple[int, int, bytes]]) -> int:
    for level, kind, data in ancdata:
        if level == _SOL_UDP and kind == UDP_GRO:
            if len(data) >= 4:
                return int(_I32.unpack_from(data)[0])
            if len(data) >= 2:
                return int(_U16.unpack_from(data)[0])
    return 0


def _gso_runs(packets: Sequence[Packet]) -> Iterable[tuple[list[bytes], Any, int]]:
    """Split packets into runs for one send each: same address, every segment of the run's
    first size except a shorter last one, within the kernel's limits. Yields
    ``(buffers, address, segment_size)``."""
    run: list[bytes] = []
    addr: Any = None
    size = total = 0
    for data, to in packets:
        n = len(data)
        if run and to == addr and n <= size and len(run) < GSO_MAX_SEGMENTS \
                and total + n <= GSO_MAX_BYTES:
            run.append(data)
            total += n
            if n < size:  # a shorter segment ends the run (udp(7): only the last may be)
                yield run, addr, size
                run = []
            continue
        if run:
            yield run, addr, size
        run, addr, size, total = [data], to, n, n
    if run:
        yield run, addr, size


class UdpEndpoint(asyncio.DatagramTransport):
    """A UDP socket driven by the loop's reader/writer callbacks, for one protocol (a QUIC
    connection's, or a server's demultiplexer)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 protocol: asyncio.DatagramProtocol, *, gso: bool, gro: bool,
                 burst_octets: int | None = None) -> None:
        super().__init__()
        #: Octets after which a receive burst ends (None: only RECV_BURST reads).
        self._burst_octets = burst_octets if burst_octets is not None else RECV_BURST * _RECV_SIZE
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._gso = gso and gso_supported(sock.family)
        self._gro = gro and _enable_gro(sock)
        self._queue: collections.deque[Packet] = collections.deque()
        self._queued = 0
        self._closing = False
        self._closed = False
        self._writing = False
        #: Counters: packets handed to the kernel and the send calls that carried them,
        #: packets delivered to the protocol and the reads that got them, packets dropped
        #: because the socket stayed unwritable (UDP semantics; QUIC retransmits).
        self.packets_sent = self.send_calls = 0
        self.packets_received = self.recv_calls = 0
        self.dropped = 0
        self._extra = {"socket": sock, "sockname": sock.getsockname()}

    # -- introspection ----------------------------------------------------------------------
    @property
    def gso(self) -> bool:
        """True while sends use UDP_SEGMENT."""
        return self._gso

    @property
    def gro(self) -> bool:
        """True when the socket has UDP_GRO on."""
        return self._gro

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol  # type: ignore[assignment]

    def is_closing(self) -> bool:
        return self._closing

    def get_write_buffer_size(self) -> int:
        return self._queued

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        self._protocol.connection_made(self)
        self._loop.add_reader(self._fd, self._on_readable)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._queue.clear()
        self._queued = 0
        self._loop.call_soon(self._finish_close)

    def abort(self) -> None:
        self.close()

    def _finish_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._protocol.connection_lost(None)
        finally:
            self._sock.close()

    # -- send -------------------------------------------------------------------------------
    def sendto(self, data: bytes | bytearray | memoryview, addr: Any = None) -> None:
        self.send_packets([(bytes(data), addr)])

    def send_packets(self, packets: Sequence[Packet]) -> None:
        """Send ``(data, address)`` pairs in order, segmented where possible."""
        if self._closing or not packets:
            return
        if self._queue:  # keep order behind what the kernel refused earlier
            self._enqueue(packets)
            return
        if self._gso:
            runs = list(_gso_runs(packets))
            for i, (run, addr, size) in enumerate(runs):
                if not self._send_run(run, addr, size):
                    self._enqueue((d, a) for later, a, _ in runs[i:] for d in later)
                    return
            return
        for i, (data, addr) in enumerate(packets):
            if not self._send_one(data, addr):
                self._enqueue(packets[i:])
                return

    def _send_run(self, run: list[bytes], addr: Any, size: int) -> bool:
        """One GSO send; False when the socket would block (nothing was sent)."""
        if len(run) == 1:
            return self._send_one(run[0], addr)
        try:
            self._sock.sendmsg(run, [(_SOL_UDP, UDP_SEGMENT, _U16.pack(size))], 0, addr)
            self.send_calls += 1
            self.packets_sent += len(run)
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno in _GSO_REFUSED:
                logger.info("UDP GSO refused (%s); sending packets one by one", exc)
                self._gso = False
            else:
                self._protocol.error_received(exc)
                return True
        for i, data in enumerate(run):
            if not self._send_one(data, addr):
                self._enqueue([(d, addr) for d in run[i:]])
                return True
        return True

    def _send_one(self, data: bytes, addr: Any) -> bool:
        try:
            self._sock.sendto(data, addr)
            self.send_calls += 1
            self.packets_sent += 1
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:  # EMSGSIZE, unreachable, ...: dropped like any lost packet
            self._protocol.error_received(exc)
        return True

    def _enqueue(self, packets: Iterable[Packet]) -> None:
        for data, addr in packets:
            if self._queued + len(data) > _MAX_QUEUED:
                self.dropped += 1
                continue
            self._queue.append((data, addr))
            self._queued += len(data)
        if self._queue and not self._writing:
            self._loop.add_writer(self._fd, self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        while self._queue:
            data, addr = self._queue[0]
            if not self._send_one(data, addr):
                return
            self._queue.popleft()
            self._queued -= len(data)
        self._loop.remove_writer(self._fd)
        self._writing = False

    # -- receive ----------------------------------------------------------------------------
    def _on_readable(self) -> None:
        """Read up to RECV_BURST times. A protocol with ``datagrams_received(list, addr)``
        (a client connection) gets the burst's packets in batches, one per run of packets
        from one address; others (a server's demultiplexer) get ``datagram_received`` per
        packet."""
        batch_cb = getattr(self._protocol, "datagrams_received", None)
        one_cb = self._protocol.datagram_received
        sock = self._sock
        batch: list[bytes] = []
        batch_addr: Any = None
        octets = self._burst_octets
        for _ in range(RECV_BURST):
            if octets <= 0:
                break
            if self._closing:
                return
            try:
                if self._gro:
                    data, anc, _flags, addr = sock.recvmsg(_RECV_SIZE, _ANC_SIZE)
                    segment = _gro_segment(anc) if anc else 0
                else:
                    data, addr = sock.recvfrom(_RECV_SIZE)
                    segment = 0
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._protocol.error_received(exc)
                break
            self.recv_calls += 1
            octets -= len(data)
            packets = ([data[pos:pos + segment] for pos in range(0, len(data), segment)]
                       if 0 < segment < len(data) else [data])
            self.packets_received += len(packets)
            if batch_cb is None:
                for packet in packets:
                    one_cb(packet, addr)
                    if self._closing:
                        return
                continue
            if batch and addr != batch_addr:
                batch_cb(batch, batch_addr)
                batch = []
            batch.extend(packets)
            batch_addr = addr
        if batch and not self._closing:
            batch_cb(batch, batch_addr)  # type: ignore[misc]


async def open_endpoint(sock: socket.socket, protocol: asyncio.DatagramProtocol, *,
                        gso: bool, gro: bool, burst_octets: int | None = None) -> UdpEndpoint:
    """Run ``protocol`` on the bound, non-blocking ``sock``; ``connection_made`` is called
    before this returns. ``burst_octets``: a receive burst also ends after this many octets
    (servers: :data:`SERVER_RECV_BURST_OCTETS`)."""
    endpoint = UdpEndpoint(asyncio.get_running_loop(), sock, protocol, gso=gso, gro=gro,
                           burst_octets=burst_octets)
    endpoint.start()
    return endpoint
