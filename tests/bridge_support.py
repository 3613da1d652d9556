"""Shared helpers of tests/test_bridge*.py (holds no tests): a real holder (BlockStore +
MoqtHolder serving on 127.0.0.1), a real relay (``relay.core.Relay`` in-process), a tiny
tampering MOQT publisher, and block builders. Everything runs over loopback QUIC."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsp_moq.bridge import LAYER_DIGEST, MoqtHolder
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.kvsp.naming import BlockName
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.pubsub import Catalog, MoqtServer, serve
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import make_self_signed
from relay import Relay, RelayConfig

GUARD = 30.0
CERT = make_self_signed()


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


async def until(cond: Callable[[], bool], what: str, timeout: float = GUARD) -> None:
    """Poll state that changes inside another party's event handlers (a relay's) with a
    bound that fails loudly."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {what}")
        await asyncio.sleep(0.002)


def server_config() -> TransportConfig:
    return TransportConfig(certificate_pem=CERT.cert_pem, private_key_pem=CERT.key_pem)


def client_config() -> TransportConfig:
    return TransportConfig(insecure=True)


def make_key(seed: int) -> RecordKey:
    rng = np.random.default_rng(seed)
    return RecordKey(rng.bytes(32), rng.bytes(16), rng.bytes(32))


@dataclass
class Layers:
    geometry: Geometry
    tokens: int
    arrays: list[tuple[np.ndarray, np.ndarray]]


def make_layers(count: int = 8, *, tokens: int = 16, kv_heads: int = 2, head_dim: int = 64,
                dtype: str = "bf16", seed: int = 3) -> Layers:
    geometry = Geometry.from_descriptor_fields(kv_heads, head_dim, dtype)
    rng = np.random.default_rng(seed)
    storage = geometry.numpy_dtype
    shape = geometry.shape(tokens)
    n = int(np.prod(shape)) * storage.itemsize

    def section() -> np.ndarray:
        return rng.integers(0, 256, n, dtype=np.uint8).view(storage).reshape(shape)

    return Layers(geometry, tokens, [(section(), section()) for _ in range(count)])


class HolderNode:
    """A BlockStore (host tier) published by a MoqtHolder serving on 127.0.0.1."""

    async def start(self, ttl_ms: int = 600_000) -> HolderNode:
        self.store = BlockStore([HostTier(256 << 20)])
        self.holder = MoqtHolder(self.store, ttl_ms=ttl_ms)
        self.url = await self.holder.serve("127.0.0.1", 0, server_config())
        return self

    def put(self, key: RecordKey, layers: Layers) -> None:
        self.store.put_layers(key, layers.arrays, token_count=layers.tokens,
                              geometry=layers.geometry)
        self.holder.publish(key)

    def payload(self, key: RecordKey, layer: int) -> bytes:
        return bytes(self.store.layer_payload(key, layer, touch=False))

    async def close(self) -> None:
        await within(self.holder.close())


_CA_FILES: list[str] = []


def ca_file() -> str:
    """A file holding the CA of ``CERT`` (``[tls] ca_file`` of instances that verify the
    test relay and holders, as they do by default); removed at exit."""
    if not _CA_FILES:
        import atexit
        import os
        import tempfile

        fd, path = tempfile.mkstemp(prefix="kvsp-test-ca-", suffix=".pem")
        with os.fdopen(fd, "wb") as fp:
            fp.write(CERT.ca_pem)
        atexit.register(os.unlink, path)
        _CA_FILES.append(path)
    return _CA_FILES[0]


async def start_relay() -> Relay:
    return await Relay(RelayConfig(server_transport=server_config(),
                                   upstream_transport=client_config())).start()


class TamperingPublisher:
    """A real MOQT publisher of ours that serves a replica's namespace with one flipped
    byte in layer ``bad_layer`` (and the honest per-object LAYER_DIGEST property)."""

    async def start(self, name: BlockName, payloads: dict[int, bytes], digests: list[bytes],
                    bad_layer: int) -> TamperingPublisher:
        self.catalog = Catalog()
        track = self.catalog.create(name.namespace_fields(), "raw", keep=True)
        for layer in sorted(payloads):
            data = bytearray(payloads[layer])
            if layer == bad_layer:
                data[len(data) // 2] ^= 0x01
            await track.write_object(0, layer, bytes(data),
                                     properties=((LAYER_DIGEST, digests[layer]),))
        self.server: MoqtServer = await serve("127.0.0.1", 0, server_config(),
                                              catalog=self.catalog)
        self.url = f"moqt://127.0.0.1:{self.server.port}/moq"
        return self

    async def close(self) -> None:
        for s in list(self.server.sessions):
            await within(s.close())
        self.server.close()
        await within(self.server.wait_closed())


def record_at(record: ReplicaRecord, holder: str) -> ReplicaRecord:
    """The same replica's record naming another ``moqt://`` endpoint (a relay, a liar...)."""
    return ReplicaRecord.from_json({**record.to_json(), "holder": holder})


def closed_port_url() -> str:
    """A moqt:// URL on a UDP port nobody listens on (bound, then released)."""
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"moqt://127.0.0.1:{port}/moq"


def random_replica_id() -> bytes:
    return os.urandom(16)
