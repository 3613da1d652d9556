"""``Connection.drain()``: after it returns, the peer has acknowledged every byte sent (real QUIC,
loopback). The peer's application may be handed those bytes a little later than its transport
acknowledged them (aiopquic acknowledges from its own thread), so the content check waits for both
streams' ends, bounded."""

from __future__ import annotations

import asyncio
import hashlib
import os

from kvsp_moq.transport import BaseConnectionHandler, TransportConfig, connect, serve
from kvsp_moq.transport.tls import make_self_signed
from tests._transport_backends import pairing, server_backend  # noqa: F401


class Sink(BaseConnectionHandler):
    def __init__(self) -> None:
        self.received: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.two_ended = asyncio.Event()

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        self.received.setdefault(stream_id, bytearray()).extend(data)
        if end_stream:
            self.ended.add(stream_id)
            if len(self.ended) == 2:
                self.two_ended.set()


async def test_drain_waits_for_acknowledgement_of_every_stream() -> None:
    cert = make_self_signed()
    sinks: list[Sink] = []

    def factory() -> Sink:
        sinks.append(Sink())
        return sinks[-1]

    server = await serve("127.0.0.1", 0, factory, TransportConfig(
        certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem, backend=server_backend()))
    try:
        conn = await connect(f"moqt://127.0.0.1:{server.port}/", BaseConnectionHandler,
                             TransportConfig(insecure=True))
        payloads = {conn.open_uni(): os.urandom(3 << 20), conn.open_uni(): os.urandom(1000)}
        for sid, data in payloads.items():
            conn.send(sid, data, end_stream=True)
        assert any(conn.stream_send_buffered(sid) > 0 for sid in payloads)
        await conn.drain()
        assert all(conn.stream_send_buffered(sid) == 0 for sid in payloads)
        await asyncio.wait_for(sinks[0].two_ended.wait(), 10)
        got = sinks[0].received
        assert {sid: hashlib.sha256(got[sid]).digest() for sid in payloads} == \
               {sid: hashlib.sha256(d).digest() for sid, d in payloads.items()}
        await conn.aclose()
    finally:
        server.close()
        await server.wait_closed()
