"""The native data plane's receive path (issue 28, step 2): SUBGROUP and FETCH data streams
parsed in C (transport/native/nq_moqt.c), payloads landed in registered destinations and hashed
as they land (nq_objects.c), a block FETCH on the native backend verified against the record
(bridge/native_receive.py).

The parser is judged against the Python one (kvsp_moq/moqt/data/), the protocol's one source of
truth: every vector whole and byte by byte, every truncation, hostile fields (varints past their
limits, oversized lengths, properties past the limit, malformed key-value pairs) and random
bytes give the same objects or the same error code. ``ObjectParser`` drives the very parser the
network thread runs, without a socket; the network tests run it on real QUIC over loopback
against an honest holder, the hostile child-process publisher of tests/hostile_moqt_peer.py and
an in-process publisher that writes crafted bytes (a malformed stream, a reset mid-object).
tests/test_native_sanitizers.py runs this module again under ASan and UBSan.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsp_moq.transport import native

pytestmark = pytest.mark.skipif(not native.available(), reason=native.unavailable_reason() or "")

if native.available():
    from kvsp_moq.transport.native._ngtcp2 import ObjectParser

from bridge_support import HolderNode, make_key, make_layers, server_config  # noqa: E402
from hostile_support import hostile_peer  # noqa: E402
from kvsp_moq.bridge import Source, load_block, sink_for_record, subscribe_block  # noqa: E402
from kvsp_moq.bridge import native_receive  # noqa: E402
from kvsp_moq.moqt.data import (  # noqa: E402
    DataStreamParser,
    EndOfRange,
    EndOfRangeKind,
    FetchStreamEncoder,
    GroupOrder,
    ObjectBegin,
    ObjectEnd,
    ObjectPayload,
    ObjectStatus,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupStreamEncoder,
)
from kvsp_moq.moqt.version import Version  # noqa: E402
from kvsp_moq.sinks import make_sink  # noqa: E402
from kvsp_moq.transport import TransportConfig, TransportError  # noqa: E402
from kvsp_moq.transport import serve as transport_serve  # noqa: E402
from kvsp_moq.wire.errors import LimitExceeded, StreamResetCode, WireError  # noqa: E402
from kvsp_moq.wire.varint import encode_vi64  # noqa: E402

GUARD = 30.0
SUBGROUP, FETCH = 1, 2
PV = 0x3


def native_config() -> TransportConfig:
    return TransportConfig(insecure=True, backend="native")


# ---- the two parsers, side by side ------------------------------------------------------------

def python_parse(chunks: list[bytes], version: Version, order: GroupOrder,
                 max_props: int) -> tuple[list[tuple[Any, ...]], tuple[str, int] | None]:
    """Objects (fields, payload) and ("fin" | "violation" | "limit", code) from the Python
    parser; the result is None while the stream is not over."""
    p = DataStreamParser(version, group_order=order, max_properties_length=max_props)
    objects: list[tuple[Any, ...]] = []
    cur: list[Any] = []
    try:
        for i, chunk in enumerate(chunks):
            for e in p.feed(chunk, end_stream=i == len(chunks) - 1):
                if isinstance(e, ObjectBegin):
                    cur = [(e.group_id, e.subgroup_id, e.object_id, e.payload_length,
                            int(e.status), e.publisher_priority, bytes(e.raw_properties)),
                           bytearray()]
                elif isinstance(e, ObjectPayload):
                    cur[1] += e.data
                elif isinstance(e, ObjectEnd):
                    objects.append((*cur[0], bytes(cur[1])))
                elif isinstance(e, EndOfRange):
                    objects.append(("eor", int(e.kind), e.group_id, e.object_id))
    except LimitExceeded as exc:
        return objects, ("limit", exc.stream_code)
    except WireError as exc:
        return objects, ("violation", exc.code)
    return objects, ("fin", 0)


def native_parse(chunks: list[bytes], version: Version, order: GroupOrder, max_props: int,
                 dests: list[Any] | None = None, first: int = 0
                 ) -> tuple[list[tuple[Any, ...]], tuple[str, int] | None, list[Any]]:
    """The same from ObjectParser; an empty registration discards every payload, so objects
    carry their digest instead of their bytes."""
    p = ObjectParser(0, 0, first, dests or [], timed_out_range=version.end_of_timed_out_range,
                     descending=order is GroupOrder.DESCENDING, max_properties_length=max_props)
    objects: list[tuple[Any, ...]] = []
    end: tuple[str, int] | None = None
    events: list[Any] = []
    for i, chunk in enumerate(chunks):
        for e in p.feed(chunk, fin=i == len(chunks) - 1):
            events.append(e)
            if e[0] == "object":
                objects.append(tuple(e[1:7]) + (e[8],))
            elif e[0] == "end_of_range":
                objects.append(("eor", *e[1:]))
            elif e[0] == "end":
                end = (e[1], e[2])
    return objects, end, events


def same_outcome(data: bytes, chunks: list[bytes], version: Version = Version.DRAFT_22,
                 order: GroupOrder = GroupOrder.ASCENDING, max_props: int = 1 << 20) -> Any:
    """Both parsers agree on ``chunks`` (FIN after the last): the objects' fields, and the end
    (FIN, or the error's code); returns the Python parser's outcome."""
    py_objects, py_end = python_parse(chunks, version, order, max_props)
    nat_objects, nat_end, _ = native_parse(chunks, version, order, max_props)
    fields = [o[:7] if o[0] != "eor" else o for o in py_objects]
    if py_end is not None and py_end[0] != "fin":
        # An error raised by a feed() loses the Python events of that chunk: a prefix.
        nat_objects = nat_objects[:len(fields)]
    assert nat_objects == fields, data.hex()
    assert nat_end == py_end, (data.hex(), nat_end, py_end)
    return py_objects, py_end


def whole_and_bytewise(data: bytes, **kw: Any) -> Any:
    out = same_outcome(data, [data], **kw)
    objects, end = same_outcome(data, [data[i:i + 1] for i in range(len(data))] + [b""], **kw)
    assert end == out[1] and (objects == out[0] or end[0] != "fin")
    return out


def subgroup_stream(header: SubgroupHeader, version: Version = Version.DRAFT_22) -> bytes:
    enc = SubgroupStreamEncoder(header, version)
    props = ((0x3801, b"d" * 32), (0x3802, 7)) if header.has_properties else ()
    return (enc.header() + enc.object(1, b"a" * 300, properties=props) + enc.object(2, b"")
            + enc.object(9, b"b" * 5) + enc.object(10, status=ObjectStatus.END_OF_GROUP))


def fetch_stream(version: Version, order: GroupOrder) -> bytes:
    enc = FetchStreamEncoder(7, version, order)
    g = (5, 4, 2) if order is GroupOrder.DESCENDING else (2, 4, 5)
    out = enc.header()
    out += enc.object(g[0], 0, b"x" * 100, subgroup_id=0, publisher_priority=3)
    out += enc.object(g[0], 1, b"y" * 10, subgroup_id=0, publisher_priority=3,
                      properties=((0x3801, b"p" * 5),))
    out += enc.object(g[0], 3, b"", subgroup_id=1, publisher_priority=9)
    out += enc.object(g[0], 4, b"z", subgroup_id=2, publisher_priority=9)
    out += enc.object(g[0], 6, b"w" * 3, subgroup_id=2, publisher_priority=9)
    out += enc.object(g[0], 7, b"d" * 2, subgroup_id=None, publisher_priority=9)
    out += enc.object(g[0], 8, b"e", subgroup_id=44, publisher_priority=9)
    out += enc.end_of_range(EndOfRangeKind.NON_EXISTENT, g[1], 2)
    out += enc.object(g[1], 3, b"q" * 17, subgroup_id=44, publisher_priority=1)
    if version.end_of_timed_out_range:
        out += enc.end_of_range(EndOfRangeKind.TIMED_OUT, g[2], 0)
    out += enc.end_of_range(EndOfRangeKind.UNKNOWN, g[2], 9)
    return out


HEADERS = [SubgroupHeader(track_alias=a, group_id=g, subgroup_id=s, publisher_priority=p,
                          subgroup_id_mode=m, has_properties=props, end_of_group=eog,
                          first_object=first)
           for (a, g) in ((3, 0), (1 << 40, (1 << 64) - 1))
           for m, s in ((SubgroupIdMode.ZERO, 0), (SubgroupIdMode.FIRST_OBJECT_ID, None),
                        (SubgroupIdMode.EXPLICIT, 1 << 50))
           for p in (None, 200)
           for props in (False, True)
           for eog, first in ((False, False), (True, True))]


@pytest.mark.parametrize("version", [Version.DRAFT_18, Version.DRAFT_22])
def test_every_subgroup_header_form_parses_as_the_python_parser(version: Version) -> None:
    for header in HEADERS:
        objects, end = whole_and_bytewise(subgroup_stream(header, version), version=version)
        assert end == ("fin", 0) and len(objects) == 4


@pytest.mark.parametrize("version", [Version.DRAFT_18, Version.DRAFT_20, Version.DRAFT_22])
@pytest.mark.parametrize("order", [GroupOrder.ASCENDING, GroupOrder.DESCENDING])
def test_fetch_streams_parse_as_the_python_parser(version: Version, order: GroupOrder) -> None:
    objects, end = whole_and_bytewise(fetch_stream(version, order), version=version, order=order)
    assert end == ("fin", 0) and len([o for o in objects if o[0] != "eor"]) == 8


def test_payloads_land_in_their_destinations_with_their_digests() -> None:
    enc = FetchStreamEncoder(7)
    payloads = [bytes(random.Random(i).randbytes(40_000 + i)) for i in range(3)]
    data = enc.header() + b"".join(enc.object(0, 10 + i, p, subgroup_id=0, publisher_priority=1)
                                   for i, p in enumerate(payloads))
    dests = [bytearray(len(p)) for p in payloads]
    for size in (len(data), 1, 1200, 16384):
        for d in dests:
            d[:] = bytes(len(d))
        chunks = [data[i:i + size] for i in range(0, len(data), size)] + [b""]
        _, end, events = native_parse(chunks, Version.DRAFT_22, GroupOrder.ASCENDING, 1 << 20,
                                      dests=list(dests), first=10)
        assert end == ("fin", 0)
        digests = [e[7] for e in events if e[0] == "object"]
        assert digests == [hashlib.sha256(p).digest() for p in payloads]
        assert [bytes(d) for d in dests] == payloads


# ---- hostile input ------------------------------------------------------------------------------

def vi(n: int) -> bytes:
    return encode_vi64(n)


def nine(n: int) -> bytes:
    """A non-minimal (9-byte) vi64: valid on receipt."""
    return encode_vi64(n, length=9)


HOSTILE: dict[str, bytes] = {
    # Object ID past 2**64-1 on a subgroup stream (delta after object 1).
    "object id overflow": bytes([0x30]) + vi(1) + vi(0) + vi(5) + vi(1) + b"a"
    + vi((1 << 64) - 1) + vi(1) + b"b",
    "9-byte varints everywhere": bytes([0x14]) + nine(0) + nine(1) + nine(2) + b"\x07"
    + nine(5) + nine(1) + b"x" + nine(0) + nine(0) + nine(0),
    "unknown object status": bytes([0x30]) + vi(1) + vi(0) + vi(0) + vi(0) + vi(2),
    "object after end of group": bytes([0x30]) + vi(1) + vi(0) + vi(0) + vi(0) + vi(3)
    + vi(0) + vi(1) + b"x",
    "properties on a status object": bytes([0x31]) + vi(1) + vi(0) + vi(0) + vi(2) + vi(2)
    + vi(0) + vi(0) + vi(4),
    "properties past the limit": bytes([0x31]) + vi(1) + vi(0) + vi(0) + vi((1 << 20) + 1),
    "malformed key-value pair": bytes([0x31]) + vi(1) + vi(0) + vi(0) + vi(2) + vi(1) + vi(9)
    + vi(1) + b"x",
    "key-value length past 65535": bytes([0x31]) + vi(1) + vi(0) + vi(0) + vi(4) + vi(1)
    + vi(70000) + vi(1) + b"x",
    "invalid subgroup type": bytes([0x16]) + vi(1) + vi(0),
    "invalid fetch flags": bytes([0x05, 0x01]) + vi(0x80),
    "fetch group id overflow": bytes([0x05, 0x01]) + vi(0x1C) + vi((1 << 64) - 1) + vi(0)
    + b"\x01" + vi(0) + vi(0x08) + vi(0) + vi(0),
    "first fetch object without ids": bytes([0x05, 0x01]) + vi(0x10) + b"\x01" + vi(0),
    "fetch priority from no object": bytes([0x05, 0x01]) + vi(0x0C) + vi(0) + vi(0) + vi(0),
    "subgroup of no prior object": bytes([0x05, 0x01]) + vi(0x5C) + vi(0) + vi(0) + b"\x01"
    + vi(0) + vi(0x01) + vi(0),
    "end of range with a payload": bytes([0x05, 0x01]) + vi(0x8C) + vi(0) + vi(0) + vi(3),
    "timed-out range in draft 18": bytes([0x05, 0x01]) + vi(0x20C) + vi(0) + vi(0) + vi(0),
    "control stream type": vi(0x2F00) + vi(1),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_fields_give_the_python_parsers_error(case: str) -> None:
    data = HOSTILE[case]
    version = Version.DRAFT_18 if "draft 18" in case else Version.DRAFT_22
    _, end = whole_and_bytewise(data, version=version)
    assert end is not None
    if case == "properties past the limit":
        assert end == ("limit", StreamResetCode.EXCESSIVE_LOAD)
    elif case == "9-byte varints everywhere":
        assert end == ("fin", 0)
    else:
        assert end == ("violation", PV), end


def test_every_truncation_ends_as_in_python() -> None:
    for data in (subgroup_stream(HEADERS[-1]), fetch_stream(Version.DRAFT_22, GroupOrder.ASCENDING)):
        for cut in range(len(data)):
            _, end = same_outcome(data[:cut], [data[:cut]])
            assert end is not None


def test_random_bytes_give_the_same_objects_or_the_same_error() -> None:
    rng = random.Random(28)
    starts = [b"\x05", b"\x10", b"\x11", b"\x15", b"\x35", b"\x74", b"\x05\x00\x1c\x00\x00\x01"]
    for i in range(1500):
        body = rng.randbytes(rng.randrange(0, 64))
        if i % 3:  # mostly small numbers, so that parsing goes deep
            body = bytes(b & rng.choice((0x03, 0x0F, 0x3F, 0xFF)) for b in body)
        data = rng.choice(starts) + body
        cut = rng.randrange(0, len(data) + 1)
        same_outcome(data, [data[:cut], data[cut:]], max_props=rng.choice((0, 8, 1 << 20)))


def test_oversized_and_overlong_payloads_are_refused_before_a_byte_lands() -> None:
    enc = FetchStreamEncoder(7)
    dest = bytearray(1000)
    for declared in (1001, 1 << 31, 1 << 62, (1 << 64) - 1):
        head = enc.header() if declared == 1001 else FetchStreamEncoder(7).header()
        data = head + FetchStreamEncoder(7).object_header(0, 0, declared, subgroup_id=0,
                                                          publisher_priority=1) + b"z" * 64
        _, end, events = native_parse([data], Version.DRAFT_22, GroupOrder.ASCENDING, 1 << 20,
                                      dests=[dest])
        assert end == ("refused", StreamResetCode.CANCELLED)
        assert "payload length" in events[-1][3] and dest == bytearray(1000)
    # An object outside the registered range is refused too; a second delivery is discarded.
    stray = enc.header() + FetchStreamEncoder(7).object(0, 5, b"q", subgroup_id=0,
                                                       publisher_priority=1)
    _, end, events = native_parse([stray], Version.DRAFT_22, GroupOrder.ASCENDING, 1 << 20,
                                  dests=[bytearray(1)])
    assert end == ("refused", StreamResetCode.CANCELLED) and "unexpected object 0/5" in events[-1][3]


# ---- on the network ----------------------------------------------------------------------------

@pytest.fixture
async def holder():
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


def octets(section: Any) -> bytes:
    if isinstance(section, np.ndarray):
        return section.tobytes()
    import torch
    return section.contiguous().view(torch.uint8).numpy().tobytes()


def watch_native(monkeypatch: pytest.MonkeyPatch) -> list[native_receive.NativeFetch]:
    """The NativeFetch of every FETCH the bridge makes."""
    seen: list[native_receive.NativeFetch] = []
    made = native_receive.native_fetch

    def spy(*args: Any) -> Any:
        nf = made(*args)
        if nf is not None:
            seen.append(nf)
        return nf

    monkeypatch.setattr("kvsp_moq.bridge.load.native_fetch", spy)
    return seen


async def test_a_block_lands_through_the_native_path_verified(
        holder: HolderNode, monkeypatch: pytest.MonkeyPatch) -> None:
    key, layers = make_key(61), make_layers(6, tokens=64)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    seen = watch_native(monkeypatch)
    for sink_backend in ("numpy", "torch"):
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend=sink_backend)
        result = await within(load_block(record, sink, config=native_config()))
        assert result.complete and result.attempts[0].verified == tuple(range(6))
        for layer in range(6):
            k, v = sink.layer(layer)
            assert octets(k) + octets(v) == holder.payload(key, layer)
    assert len(seen) == 2 and all(nf.verified == list(range(6)) for nf in seen)
    # Another backend keeps the Python path.
    sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
    result = await within(load_block(record, sink, config=TransportConfig(insecure=True, backend="aioquic")))
    assert result.complete and len(seen) == 2


async def test_hostile_lengths_are_refused_and_the_honest_holder_serves(
        tmp_path: Path, holder: HolderNode) -> None:
    key, layers = make_key(62), make_layers(4)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    name = record.block_name()
    assert name is not None
    async with hostile_peer(tmp_path, "publisher") as peer:
        probe = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
        for track in ("len:4611686018427387904", f"layers:4:{probe.payload_bytes + 1}",
                      "endless"):
            sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
            result = await within(load_block([Source(peer.url, name, track), record], sink,
                                             config=native_config()))
            assert result.complete, (track, result.attempts)
            first = result.attempts[0]
            assert first.verified == () and "payload length" in (first.error or ""), first
            _sid, code = await within(peer.stops.get())  # our STOP_SENDING reached it
            assert code == StreamResetCode.CANCELLED


def crafted_publisher() -> Any:
    """A publisher (our transport and sans-IO session) that answers a FETCH of track
    ``<hex>:<end>`` with those bytes after its FETCH_HEADER, then ``fin``, ``reset`` (code 0x7)
    once they are acknowledged, or nothing."""
    from hostile_moqt_peer import HostilePublisher

    class Crafted(HostilePublisher):  # type: ignore[misc]
        async def _fetch(self, rid: int, sid: int, name: bytes) -> None:
            self.pump()
            hexed, _, end = name.decode().partition(":")
            try:
                await self.connection.write(sid, bytes.fromhex(hexed), end_stream=end == "fin")
                if end == "reset":
                    await self.connection.wait_writable(sid, 0)
                    self.connection.reset_stream(sid, 0x7)
            except TransportError:
                pass

    return Crafted


async def test_malformed_stream_and_reset_mid_object_fail_the_source(
        holder: HolderNode, monkeypatch: pytest.MonkeyPatch) -> None:
    key, layers = make_key(63), make_layers(2)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    name = record.block_name()
    assert name is not None
    size = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy").payload_bytes
    enc = FetchStreamEncoder(0)  # the header itself the publisher's session sent
    half_object = enc.object_header(0, 0, size, subgroup_id=0, publisher_priority=1) + bytes(100)
    cases = {
        "malformed": ((vi(0x80) + vi(0)).hex() + ":fin", "PROTOCOL_VIOLATION"),
        "reset": (half_object.hex() + ":reset", "fetch stream reset"),
        "truncated": (half_object.hex() + ":fin", "PROTOCOL_VIOLATION"),
    }
    server = await transport_serve("127.0.0.1", 0, crafted_publisher(), server_config())
    seen = watch_native(monkeypatch)
    try:
        url = f"moqt://127.0.0.1:{server.port}/moq"
        for case, (track, want) in cases.items():
            sink = sink_for_record(record, layers.geometry, layers.tokens, backend="numpy")
            result = await within(load_block([Source(url, name, track), record], sink,
                                             config=native_config()))
            assert result.complete, (case, result.attempts)
            first = result.attempts[0]
            assert first.verified == () and first.error, (case, first)
            assert want in first.error or (want == "PROTOCOL_VIOLATION" and "0x3" in first.error), \
                (case, first.error)
    finally:
        server.close()
        await within(server.wait_closed())
    assert len(seen) >= 6 and all(nf.handle is None for nf in seen)  # every registration ended


async def test_a_block_lands_in_a_store_through_the_native_path(
        holder: HolderNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetch's landing (bridge/landing.py StoreLanding): every layer's buffer is handed
    out before the FETCH leaves, so it is staged and committed into the store at FETCH_OK."""
    from kvsp_moq.control.client.moqt import MoqtBlockRetriever
    from kvsp_moq.storage import BlockStore, HostTier

    key = make_key(64)
    holder.put(key, make_layers(4, tokens=16))
    record = holder.holder.replica_record(key)
    seen = watch_native(monkeypatch)
    retriever = MoqtBlockRetriever(native_config())
    try:
        store = BlockStore([HostTier(1 << 20)])
        landed = await within(retriever.land([record], store, key))
        assert landed.info is not None and landed.info.complete and landed.attempts == ()
        assert store.info(key).digest == record.digest
        for layer in range(4):
            assert bytes(store.layer_payload(key, layer, touch=False)) == holder.payload(key, layer)
        assert len(seen) == 1 and seen[0].verified == [0, 1, 2, 3]
    finally:
        await retriever.close()


# ---- SUBSCRIBE: the live layers of a block being computed (prefill streaming) -------------------

def watch_native_subscribe(monkeypatch: pytest.MonkeyPatch) -> list[native_receive.NativeSubscribe]:
    """The NativeSubscribe of every SUBSCRIBE the bridge makes."""
    seen: list[native_receive.NativeSubscribe] = []
    made = native_receive.native_subscribe

    def spy(*args: Any) -> Any:
        ns = made(*args)
        if ns is not None:
            seen.append(ns)
        return ns

    monkeypatch.setattr("kvsp_moq.bridge.instance.native_subscribe", spy)
    return seen


async def test_live_layers_land_through_the_native_subscribe(
        holder: HolderNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block being computed: two layers exist before the SUBSCRIBE (FETCHed), the others
    are written one at a time, each only once the previous one is verified: they land in C
    from the SUBGROUP stream, verified against their LAYER_DIGEST (the sink has no digests),
    and the subscription ends with PUBLISH_DONE although its data stream never reached the
    session."""
    count = 6
    key, layers = make_key(65), make_layers(count)
    writer = holder.holder.begin(key, layers.geometry, count, layers.tokens)
    for layer in range(2):
        writer.write_layer(layer, *layers.arrays[layer])
    seen = watch_native_subscribe(monkeypatch)
    sink = make_sink(layers.geometry, layers.tokens, (0, count - 1), [None] * count,
                     backend="numpy")
    consumer = asyncio.ensure_future(subscribe_block(
        holder.url, key.block_name(writer.replica_id), sink, config=native_config()))
    await within(holder.holder.track(key).subscribed.wait())
    await within(sink.wait_for_layer(1))
    for layer in range(2, count):
        writer.write_layer(layer, *layers.arrays[layer])
        await within(sink.wait_for_layer(layer))
    writer.finish()
    result = await within(consumer)
    assert result.complete and result.verified == tuple(range(count)), result.attempts
    digests = holder.store.info(key).layer_digests
    for layer in range(count):
        k, v = sink.layer(layer)
        assert octets(k) + octets(v) == holder.payload(key, layer)
        assert sink.expected_digest(layer) == digests[layer]
    assert len(seen) == 1 and seen[0].verified == [2, 3, 4, 5] and seen[0].handle is None


@pytest.mark.parametrize("track", ["len:4611686018427387904", "size+1", "endless"])
async def test_hostile_subgroup_streams_are_refused_before_a_byte_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, track: str) -> None:
    """A hostile publisher's SUBGROUP streams for a natively registered subscription: a Payload
    Length past 2^62 or one octet more than the layer, and objects without end (of another size
    and past the range): the stream is stopped with CANCELLED before a byte lands, no layer is
    taken, the publisher's last stream (a group we did not ask for) is refused too, and the
    subscription still ends with its PUBLISH_DONE (the natively ended streams are counted). The
    publisher opens its stream right behind SUBSCRIBE_OK: its first bytes may arrive before the
    registration, and are held by the extension until it is made."""
    layers = make_layers(4)
    seen = watch_native_subscribe(monkeypatch)
    sink = make_sink(layers.geometry, layers.tokens, (0, 3), [None] * 4, backend="numpy")
    if track == "size+1":
        track = f"lens:{sink.payload_bytes + 1}"
    name = make_key(66).block_name(bytes(16))
    async with hostile_peer(tmp_path, "publisher") as peer:
        result = await within(subscribe_block(peer.url, name, sink, codec=track,
                                              config=native_config(), timeout=GUARD))
        first = result.attempts[0]
        assert first.verified == () and not result.verified, result.attempts
        assert "payload length" in (first.error or ""), first.error
        # The stream came right behind SUBSCRIBE_OK: held by the extension until the
        # registration, then refused there (not by the Python path).
        assert len(seen) == 1 and seen[0].handle is None and not seen[0].verified
        assert seen[0].problems and "payload length" in seen[0].problems[0], seen[0].problems
        _sid, code = await within(peer.stops.get())  # our STOP_SENDING reached it
        assert code == StreamResetCode.CANCELLED
