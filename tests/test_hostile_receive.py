"""A hostile MOQT publisher (tests/hostile_moqt_peer.py, a real QUIC server in a child
process) against our pubsub receive path (kvsp_moq/pubsub/receive.py, limits.py): declared
Payload Lengths of 2^31, 2^33, 2^40 and 2^62 octets, an object that never completes, a
subgroup stream that never ends, thousands of streams. The victim is this process: it stays
up, stops what exceeds a limit with the draft's code (STOP_SENDING EXCESSIVE_LOAD 0x9,
draft-ietf-moq-transport-22 §"Resource Exhaustion"), its peak resident memory (VmHWM
of /proc/self/status, reset at the start) grows by less than a documented bound, and a well-behaved request on the
same session works afterwards.

Bounds (docs/security.md): before these limits, one header declaring 2^31 octets made this
layer allocate 2 GiB (and 2^62 raised MemoryError, closing the session); the bounds below are
what the limits allow plus a wide margin for the interpreter and the QUIC buffers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hostile_support import MiB, PeakRss, client_config, hostile_peer, within
from kvsp_moq.pubsub import MoqtError, MoqtSession, ReceiveLimits, connect
from kvsp_moq.pubsub.errors import ErrorKind
from kvsp_moq.wire.errors import StreamResetCode

DECLARED = (2**31, 2**33, 2**40, 2**62)
#: RSS growth allowed while the peer declares lengths it never sends (documented bound).
DECLARED_BOUND = 64 * MiB
REPORT_GROUP = 1_000_000

pytestmark = pytest.mark.asyncio


async def report_of(session: MoqtSession, track: str,
                    limits_note: str = "") -> tuple[dict[int, int], object]:
    """SUBSCRIBE ``track`` of the hostile peer; read its objects up to the report object
    (group 1_000_000, sent once we stopped every crafted stream): ``{stream: code}`` and
    the subscription."""
    sub = await within(session.subscribe(("h",), track))
    async for obj in sub:
        if obj.group_id == REPORT_GROUP:
            return {int(k): v for k, v in json.loads(bytes(obj.payload)).items()}, sub
    raise AssertionError(f"the subscription ended without a report {limits_note}")


async def well_behaved_fetch(session: MoqtSession) -> None:
    """The session still serves: a FETCH of a well-formed object completes."""
    f = await within(session.fetch(("h",), "ok", start=(0, 0), end=(0, 0)))
    objs = await within(f.collect())
    assert [bytes(o.payload) for o in objs] == [b"k" * 1000]


async def test_declared_lengths_on_subgroup_streams_are_stopped(tmp_path: Path) -> None:
    async with hostile_peer(tmp_path, "publisher") as peer:
        session = await within(connect(peer.url, client_config()))
        try:
            peak = PeakRss()
            track = "lens:" + ",".join(str(n) for n in DECLARED)
            codes, sub = await within(report_of(session, track))
            grown = peak.growth
            # Every crafted stream was stopped with EXCESSIVE_LOAD, nothing allocated for it.
            assert sorted(codes.values()) == [StreamResetCode.EXCESSIVE_LOAD] * len(DECLARED)
            assert sub.stats.stopped_streams == len(DECLARED)
            assert sub.stats.peak_buffered_bytes <= 64 * 1024  # the report object only
            assert grown < DECLARED_BOUND, str(peak)
            assert not session.closed.done()
            await well_behaved_fetch(session)
        finally:
            await within(session.close())


@pytest.mark.parametrize("declared", DECLARED)
async def test_declared_length_on_a_fetch_fails_it_with_excessive_load(
        tmp_path: Path, declared: int) -> None:
    async with hostile_peer(tmp_path, "publisher") as peer:
        session = await within(connect(peer.url, client_config()))
        try:
            peak = PeakRss()
            f = await within(session.fetch(("h",), f"len:{declared}", start=(0, 0)))
            with pytest.raises(MoqtError) as err:
                await within(f.collect())
            grown = peak.growth
            assert err.value.code == StreamResetCode.EXCESSIVE_LOAD
            assert err.value.kind is ErrorKind.STREAM
            assert "max_object_size" in err.value.reason
            # The peer saw our STOP_SENDING with the same code.
            _sid, code = await within(peer.stops.get())
            assert code == StreamResetCode.EXCESSIVE_LOAD
            assert f.stats.peak_buffered_bytes == 0
            assert grown < DECLARED_BOUND, str(peak)
            await well_behaved_fetch(session)
        finally:
            await within(session.close())


async def test_payload_grows_as_it_arrives_not_as_declared(tmp_path: Path) -> None:
    """A header declaring 60 MiB (under max_object_size) followed by 1 MiB and a reset:
    we held what arrived, never the declared length."""
    declared = 60 * MiB
    async with hostile_peer(tmp_path, "publisher") as peer:
        session = await within(connect(peer.url, client_config()))
        try:
            peak = PeakRss()
            f = await within(session.fetch(("h",), f"len:{declared}", start=(0, 0)))
            with pytest.raises(MoqtError) as err:
                await within(f.collect())
            grown = peak.growth
            assert err.value.code == StreamResetCode.INTERNAL_ERROR  # the peer's reset
            assert f.stats.payload_bytes == MiB
            # bytearray growth slack (~1/8) over what arrived: never the 60 MiB declared.
            assert MiB <= f.stats.peak_buffered_bytes <= MiB
            assert f.stats.buffered_bytes == 0
            assert grown < 32 * MiB, str(peak)
            await well_behaved_fetch(session)
        finally:
            await within(session.close())


@pytest.mark.parametrize("limits", [ReceiveLimits(max_queued_objects=4096),
                                    ReceiveLimits(max_buffered_bytes=MiB)],
                         ids=["max_queued_objects", "max_buffered_bytes"])
async def test_endless_subgroup_stream_is_stopped_at_the_queue_bound(
        tmp_path: Path, limits: ReceiveLimits) -> None:
    """Objects of 1 KiB without end, nobody reading: the stream is stopped once
    max_queued_objects (or max_buffered_bytes) are held unread (so is any further stream
    while they stay unread); what was queued can still be read, and the session serves on."""
    held = min(limits.max_queued_objects, limits.max_buffered_bytes // 1024)
    async with hostile_peer(tmp_path, "publisher") as peer:
        session = await within(connect(peer.url, client_config(), receive_limits=limits))
        try:
            peak = PeakRss()
            sub = await within(session.subscribe(("h",), "endless"))
            _sid, code = await within(peer.stops.get())  # the peer saw our STOP_SENDING
            assert code == StreamResetCode.EXCESSIVE_LOAD
            grown = peak.growth
            assert sub.stats.stopped_streams >= 1
            assert sub.stats.peak_buffered_bytes <= held * 1024
            assert grown < DECLARED_BOUND, str(peak)
            # The peer's PUBLISH_DONE ends the subscription once its streams are closed.
            objs = [o for o in await within(sub.collect()) if o.group_id != REPORT_GROUP]
            assert len(objs) == held
            assert all(len(o.payload) == 1024 for o in objs)
            assert sub.stats.buffered_bytes == 0
            codes, _ = await within(report_of(session, "streams:0:0"))  # well-behaved
            assert codes == {}
            await well_behaved_fetch(session)
        finally:
            await within(session.close())


async def test_thousands_of_streams_declaring_2_40(tmp_path: Path) -> None:
    """3000 subgroup streams (the peer may have 128 open at once), each one object
    declaring 2^40 octets: each is stopped with EXCESSIVE_LOAD, the session stays."""
    count = 3000
    async with hostile_peer(tmp_path, "publisher") as peer:
        session = await within(connect(peer.url, client_config()))
        try:
            peak = PeakRss()
            codes, sub = await within(report_of(session, f"streams:{count}:{2**40}"), 120)
            grown = peak.growth
            assert len(codes) == count
            assert set(codes.values()) == {StreamResetCode.EXCESSIVE_LOAD}
            assert sub.stats.stopped_streams == count
            assert grown < DECLARED_BOUND, str(peak)
            await well_behaved_fetch(session)
        finally:
            await within(session.close())
