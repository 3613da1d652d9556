"""The MOQT rows of ``kvsp bench wan --codec`` (``wan_moqt_codec_<codec>_rate``).

Holder side (:func:`serve_through_relay`, in the holder's namespace, in the codec holder's
process): a relay (``relay.Relay``) whose edge transcoder knows the bench block's descriptor
(``bridge.transcoding.from_descriptors``, docs/binding.md §13), and a MOQT holder attached to
it as the publisher of the block's raw replica. The relay makes each coded track from the raw
one once per replica and codec and caches its objects, so it sits where a transcoding relay
pays off: at the sending end of the WAN path.

Loader side (:func:`load_moqt`, in the loader's namespace): one MOQT session to the relay on
``--backend`` (its default congestion control unless ``--congestion-control``), and per codec
(``raw`` too; not ``zstd-planes``, whose section size the content decides: the relay makes
no such track) a FETCH of the coded track, every layer checked against the coded digests the
relay declares and decoded to bf16 on a worker thread (``bridge.transcoding.coded_layers``).
Timed from the FETCH to the last layer decoded; best of ``repeat`` after one untimed load (the
one that makes the relay transcode: its seconds are the holder row's, not these).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .....bridge import MoqtHolder, MoqtPool
from .....bridge.transcoding import coded_layers, from_descriptors
from .....kvsp.codecs import coded_section_bytes
from .....kvsp.layout import Geometry
from .....kvsp.records import ReplicaRecord
from .....storage import BlockStore, RecordKey
from .....transport import TransportConfig
from .....transport.tls import make_self_signed

__all__ = ["MoqtRelayed", "load_moqt", "serve_through_relay"]


class MoqtRelayed:
    """The transcoding relay and the holder publishing through it (:func:`serve_through_relay`)."""

    def __init__(self, relay: Any, holder: MoqtHolder, record: ReplicaRecord) -> None:
        self.relay, self.holder, self.record = relay, holder, record

    async def close(self) -> None:
        await self.holder.close()
        await self.relay.close()


async def serve_through_relay(store: BlockStore, key: RecordKey, descriptor: dict[str, Any], host: str,
                              backend: str, datagram_size: int, congestion_control: str | None,
                              cache_bytes: int) -> MoqtRelayed:
    """Start the transcoding relay on ``host`` and publish ``key`` of ``store`` through it."""
    from relay import Relay, RelayConfig  # only in the holder's process

    logging.getLogger("relay").setLevel(logging.ERROR)  # not the "open relay" warning
    cert = make_self_signed(ip_addresses=(host, "127.0.0.1"))
    sending = TransportConfig(backend=backend, certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
                              max_datagram_size=datagram_size, congestion_control_algorithm=congestion_control)
    client = TransportConfig(backend=backend, insecure=True, max_datagram_size=datagram_size)
    relay = await Relay(RelayConfig(host=host, server_transport=sending, upstream_transport=client,
                                    cache_bytes=cache_bytes, transcoder=from_descriptors([descriptor]))).start()
    holder = MoqtHolder(store)
    try:
        holder.publish(key)
        await holder.attach_relay(relay.url, client)
        await holder.wait_announced()
    except BaseException:
        await holder.close()
        await relay.close()
        raise
    return MoqtRelayed(relay, holder, holder.replica_record(key, holder=relay.url))


async def load_moqt(record: ReplicaRecord, geometry: Geometry, tokens: int, codecs: Sequence[str], repeat: int,
                    config: TransportConfig) -> dict[str, list[float]]:
    """codec -> [best seconds, coded octets received] of the coded track through the relay
    the record names (module notes)."""
    name = record.block_name()
    if name is None or record.layer_digests is None:
        raise ValueError("the record names no MOQT replica with layer digests")
    last = len(record.layer_digests) - 1
    pool = MoqtPool(config, connect_timeout=30.0)
    worker = ThreadPoolExecutor(1, thread_name_prefix="decode")
    loop = asyncio.get_running_loop()

    async def decode(run: Any) -> Any:
        return await loop.run_in_executor(worker, run)

    out: dict[str, list[float]] = {}
    try:
        session = await pool.get(record.holder)  # the handshake is not timed
        for codec in ("raw", *codecs):
            if coded_section_bytes(codec, geometry, tokens) is None:
                continue  # a content-sized section (zstd-planes): the relay makes no such track
            best, octets = float("inf"), 0
            for run in range(repeat + 1):
                start = time.perf_counter()
                got = [layer async for layer in coded_layers(session, name, codec, geometry, 0, last,
                                                             timeout=600.0, decode=decode)]
                elapsed = time.perf_counter() - start
                if len(got) != last + 1:
                    raise AssertionError(f"{codec}: {len(got)} layers of {last + 1}")
                octets = sum(layer.coded_octets for layer in got)
                if run > 0:
                    best = min(best, elapsed)
            out[codec] = [best, float(octets)]
    finally:
        await pool.close()
        worker.shutdown()
    return out
