"""A hostile holder or relay (tests/hostile_moqt_peer.py, a real QUIC server in a child
process) against block loads (kvsp_moq/bridge/receive.py): objects declaring 2^31, 2^33,
2^40 or 2^62 octets for a layer, layers one octet too long, an endless run of objects. The
sink's layer size (the Replica Record's geometry and token count) is the bound: every such
object is refused (STOP_SENDING CANCELLED), nothing is allocated for it, the load moves on to
the next source and completes from the honest holder. Peak resident memory of this process
(VmHWM, reset at the start) grows by less than 64 MiB (before: 2^31 declared = 2 GiB)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge_support import HolderNode, make_key, make_layers
from hostile_support import MiB, PeakRss, client_config, hostile_peer, within
from kvsp_moq.bridge import Source, load_block, sink_for_record
from kvsp_moq.wire.errors import StreamResetCode

LAYERS = 4
BOUND = 64 * MiB


@pytest.fixture
async def holder():
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


def hostile_tracks(payload_bytes: int) -> list[str]:
    return ([f"len:{n}" for n in (2**31, 2**33, 2**40, 2**62)]
            + [f"layers:{LAYERS}:{payload_bytes + 1}", "endless"])


async def test_hostile_sources_are_refused_and_the_honest_holder_serves(
        tmp_path: Path, holder: HolderNode) -> None:
    key, layers = make_key(51), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    name = record.block_name()
    assert name is not None
    async with hostile_peer(tmp_path, "publisher") as peer:
        probe = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
        for track in hostile_tracks(probe.payload_bytes):
            sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
            peak = PeakRss()
            result = await within(load_block(
                [Source(peer.url, name, track), record], sink, config=client_config()))
            assert result.complete, (track, result.attempts)
            first = result.attempts[0]
            assert first.url == peer.url and first.verified == () and first.error, track
            assert "payload length" in first.error, (track, first.error)
            _sid, code = await within(peer.stops.get())  # our STOP_SENDING reached it
            assert code == StreamResetCode.CANCELLED
            assert peak.growth < BOUND, f"{track}: {peak}"
            for layer in range(LAYERS):
                k, v = sink.layer(layer)
                assert k.tobytes() + v.tobytes() == holder.payload(key, layer)
