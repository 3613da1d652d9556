"""The relay on the native QUIC backend (issue 28): every endpoint on ngtcp2, the payload
bytes forwarded to every subscriber from the very buffers they arrived in.

Real QUIC on 127.0.0.1; the only thing observed from inside is which send call the relay's
sessions make (``send_stable``: the native backend keeps a reference and writes the STREAM
frames from it, docs/transport.md "Sending from the store").
"""

from __future__ import annotations

import asyncio
import os

import pytest

from kvsp_moq.pubsub import Catalog, connect
from kvsp_moq.transport import TransportConfig, native
from kvsp_moq.transport.tls import make_self_signed
from relay import Relay, RelayConfig

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native backend not built: {native.unavailable_reason()}")

GUARD = 60.0
NS = ("relay-native", "ns")
DGRAM = 16384


async def within(aw, timeout: float = GUARD):
    return await asyncio.wait_for(aw, timeout)


def _cfg(**kw) -> TransportConfig:
    return TransportConfig(backend="native", max_datagram_size=DGRAM, **kw)


async def test_fanout_sends_the_received_chunks_themselves(monkeypatch) -> None:
    """Three subscribers of one track through a native relay get every byte of 3 x 2 MiB
    objects (past the 4 MiB stream window), and the relay handed the payload chunks to
    QUIC with ``send_stable``, the same chunk object to every subscriber: no copy in the
    relay, none in QUIC's send buffer."""
    from kvsp_moq.transport.native.connection import NativeConnection

    stable: list[memoryview | bytes] = []
    copied = 0
    real_stable, real_send = NativeConnection.send_stable, NativeConnection.send

    def spy_stable(self, stream_id, data, end_stream=False):
        if not self._is_client:  # the relay's side of a session (the others are clients)
            stable.append(data)
        return real_stable(self, stream_id, data, end_stream)

    def spy_send(self, stream_id, data, end_stream=False):
        nonlocal copied
        if not self._is_client:
            copied += len(data)
        return real_send(self, stream_id, data, end_stream)

    cert = make_self_signed()
    relay = await Relay(RelayConfig(
        server_transport=_cfg(certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem),
        upstream_transport=_cfg(insecure=True))).start()
    sessions = []
    objects = [os.urandom(2 << 20) for _ in range(3)]
    try:
        catalog = Catalog()
        pub = await within(connect(relay.url, _cfg(insecure=True), catalog=catalog))
        sessions.append(pub)
        await within(pub.publish_namespace(NS))
        track = catalog.create(NS, "layers")
        subs = []
        for _ in range(3):
            s = await within(connect(relay.url, _cfg(insecure=True)))
            sessions.append(s)
            subs.append(await within(s.subscribe(NS, "layers")))
        monkeypatch.setattr(NativeConnection, "send_stable", spy_stable)
        monkeypatch.setattr(NativeConnection, "send", spy_send)
        writer = asyncio.ensure_future(_write(track, objects))
        got = await within(asyncio.gather(*(s.collect() for s in subs)))
        await within(writer)
    finally:
        for s in sessions:
            await within(s.close())
        await within(relay.close())
    for received in got:
        assert [bytes(o.payload) for o in received] == objects
    payload = sum(len(o) for o in objects)
    held = sum(len(c) for c in stable)
    # Object headers and the SUBGROUP header are small copied sends; the payload is held.
    assert held >= 3 * payload and copied < 3 * payload // 100
    by_id: dict[int, int] = {}
    for c in stable:
        by_id[id(c)] = by_id.get(id(c), 0) + 1
    assert max(by_id.values()) == 3  # one chunk object, three subscribers


async def _write(track, objects: list[bytes]) -> None:
    for i, obj in enumerate(objects):
        await track.write_object(0, i, obj)
    await track.finish()
