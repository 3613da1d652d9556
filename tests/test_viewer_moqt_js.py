"""The block viewer's MOQT client (``kvsp_moq/control/viewer/static/moqt.js``) in Chromium
against our Python codec (docs/viewer.md): the bytes it sends are the bytes
``kvsp_moq.moqt`` encodes for the same messages; what our encoders write (SUBSCRIBE_OK,
FETCH_OK, REQUEST_ERROR, PUBLISH_DONE, fetch and subgroup streams), fed whole and one byte per
chunk, it reads back exactly; malformed input gives a MoqtError with PROTOCOL_VIOLATION
(0x3), never another exception or a hang, and a declared payload length never sizes a buffer
(the receiver refuses it). The page is served by ``serve_viewer``; its routes are checked
too. One browser for the module's tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from typing import Any

import pytest

from kvsp_moq.bridge import LAYER_DIGEST
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.viewer import ViewerBlock, ViewerError, serve_viewer
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.moqt.data import FetchStreamEncoder, SubgroupHeader, SubgroupStreamEncoder
from kvsp_moq.moqt.messages import (FetchOk, MessageParameters, PublishDone, RequestError,
                                    Subscribe, SubscribeOk)
from kvsp_moq.moqt.messages.codec import encode_message
from kvsp_moq.moqt.messages.fetch import Fetch
from kvsp_moq.moqt.messages.filters import LocationFilter
from kvsp_moq.moqt.version import Version
from kvsp_moq.storage import BlockStore, HostTier
from kvsp_moq.wire.varint import encode_vi64

from bridge_support import make_key, make_layers

playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
D22 = Version.DRAFT_22
NS = [b"kvsp-1", b"\x01" * 32, b"\x02" * 16, b"\x03" * 32, b"\x04" * 16]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")

# Runs in the page: imports the module, reads each vector, reports what it saw.
HARNESS = """async (vectors) => {
  const m = await import('/moqt.js');
  const unhex = (h) => Uint8Array.from(h.match(/../g) || [], (x) => parseInt(x, 16));
  const hex = (b) => [...b].map((x) => x.toString(16).padStart(2, '0')).join('');
  const stream = (h, chunk) => { const b = unhex(h); return new ReadableStream({ start(c) {
    for (let i = 0; i < b.length; i += chunk) c.enqueue(b.slice(i, i + chunk)); c.close(); } }); };
  const props = (map) => Object.fromEntries([...map].map(([k, v]) => [k, typeof v === 'number' ? v : hex(v)]));
  const receive = (got) => (o) => {   // like the page: a buffer only of a size it expects
    if (o.length > 4096) { got.push({ refused: o.length }); return null; }
    const dst = new Uint8Array(o.length);
    return { dst, offset: 0, done: async () => got.push({ group: o.group, object: o.object, status: o.status,
             properties: props(o.properties), payload: hex(dst) }) };
  };
  async function data(kind, h, chunk) {
    const got = [];
    try {
      const s = new m.StreamReader(stream(h, chunk));
      const type = await s.vi();
      if (kind === 'fetch') { got.push({ request: await s.vi() }); await m.readFetch(s, { onObject: receive(got) }); }
      else await m.readSubgroup(s, type, { headerReady: async (hd) => got.push({ header: { ...hd } }),
                                           onObject: (hd, o) => receive(got)(o) });
      return { ok: got };
    } catch (e) { return { error: e instanceof m.MoqtError ? e.code : 'not a MoqtError: ' + e, got }; }
  }
  async function control(h, chunk) {
    try {
      const msg = await new m.StreamReader(stream(h, chunk)).message();
      const decode = { 4: m.decodeSubscribeOk, 0x18: m.decodeFetchOk, 5: m.decodeRequestError, 0xb: m.decodePublishDone }[msg.type];
      const out = decode(msg.body);
      if (out.properties) out.properties = props(out.properties);
      return { ok: { type: msg.type, ...out } };
    } catch (e) { return { error: e instanceof m.MoqtError ? e.code : 'not a MoqtError: ' + e }; }
  }
  const out = { vi: [], sent: {}, control: [], data: [] };
  for (const [h, v] of vectors.vi) {
    const r = new m.BodyReader(unhex(h));
    out.vi.push([r.vi(), hex(m.encodeVi(v))]);
  }
  const ns = vectors.namespace.map(unhex), name = new TextEncoder().encode('raw');
  out.sent.subscribe = hex(m.encodeSubscribe(0, ns, name));
  out.sent.fetch = hex(m.encodeFetch(2, ns, name, 0, 3, 17));
  for (const [h, chunk] of vectors.control) out.control.push(await control(h, chunk));
  for (const [kind, h, chunk] of vectors.data) out.data.push(await data(kind, h, chunk));
  return out;
}"""


@pytest.fixture(scope="module")
def block() -> ViewerBlock:
    store = BlockStore([HostTier(16 << 20)])
    key, layers = make_key(30), make_layers(4, tokens=8)
    store.put_layers(key, layers.arrays, token_count=layers.tokens, geometry=layers.geometry)
    record = store.info(key).replica_record("moqt://127.0.0.1:4443/moq", 600_000)
    return ViewerBlock.from_record(record, certificate_sha256="ab" * 32)


async def run_harness(server: RunningServer, vectors: dict[str, Any]) -> Any:
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{server.url}api/blocks")  # an origin to import ./moqt.js from
            return await page.evaluate(HARNESS, vectors)
        finally:
            await browser.close()


def fetch_stream(objects: list[tuple[int, int, bytes]]) -> bytes:
    enc = FetchStreamEncoder(2, D22)
    out = enc.header()
    for group, obj, payload in objects:
        out += enc.object(group, obj, payload, subgroup_id=0, publisher_priority=128,
                          properties=((LAYER_DIGEST, hashlib.sha256(payload).digest()),))
    return out


def subgroup_stream(objects: list[tuple[int, bytes]]) -> bytes:
    enc = SubgroupStreamEncoder(SubgroupHeader(track_alias=7, group_id=0, subgroup_id=0,
                                               publisher_priority=128, has_properties=True), D22)
    out = enc.header()
    for obj, payload in objects:
        out += enc.object(obj, payload, properties=((LAYER_DIGEST, hashlib.sha256(payload).digest()),))
    return out


async def test_moqt_js_against_our_codec_and_hostile_bytes(block: ViewerBlock) -> None:
    vi = [("25", 37), ("8025", 37), ("bbbd", 15293), ("ed7f3e7d", 226442877),
          ("faa1a0e403d8", 2893212287960), ("fc8998abc66bc0", 151288809941952)]
    payloads = [bytes(random.Random(i).randbytes(100 + 37 * i)) for i in range(4)]
    ok_subscribe = SubscribeOk(5, MessageParameters(expires=1000, largest_object=(0, 3)),
                               ((0x3802, 64), (0x3803, b"\x07" * 64)))
    ok_fetch = FetchOk(True, (0, 3), MessageParameters(), ((0x3802, 64), (0x3806, 4)))
    control = [encode_message(D22, ok_subscribe), encode_message(D22, ok_fetch),
               encode_message(D22, RequestError(0x10, 0, "no such track")),
               encode_message(D22, PublishDone(0x2, 1, "done")),
               encode_message(D22, SubscribeOk(5, MessageParameters(), ()))[:-1] + b"",  # cut short
               bytes.fromhex("0400040001" "2105")]  # a parameter SUBSCRIBE_OK may not have
    fetch_ok = fetch_stream([(0, i, p) for i, p in enumerate(payloads)])
    sub_ok = subgroup_stream([(i, p) for i, p in enumerate(payloads)])
    rng = random.Random(20)
    fuzz = [("fetch", "05" + rng.randbytes(rng.randrange(1, 60)).hex()) for _ in range(60)]
    fuzz += [("subgroup", "15" + rng.randbytes(rng.randrange(1, 60)).hex()) for _ in range(60)]
    huge = FetchStreamEncoder(2, D22).header() + FetchStreamEncoder(2, D22).object_header(
        0, 0, 1 << 40, subgroup_id=0, publisher_priority=128)
    data = [("fetch", fetch_ok.hex(), 1 << 20), ("fetch", fetch_ok.hex(), 1),
            ("subgroup", sub_ok.hex(), 1 << 20), ("subgroup", sub_ok.hex(), 1),
            ("fetch", fetch_ok[:-10].hex(), 7),                      # ends inside a payload
            ("fetch", "0502" + encode_vi64(0x80).hex(), 1),         # Serialization Flags 0x80
            ("fetch", "0502" + "3c" + "00" * 3 + encode_vi64(70000).hex(), 1 << 20),  # props > 65535
            ("subgroup", "20" + "0700", 1),                         # 0x20: not a subgroup type
            ("fetch", huge.hex(), 1)]                               # a 2^40-byte payload declared
    async with await serve_viewer([block]) as server:
        out = await run_harness(server, {
            "vi": vi, "namespace": [f.hex() for f in NS],
            "control": [[c.hex(), 1] for c in control],
            "data": [[k, h, c] for k, h, c in data] + [[k, h, 3] for k, h in fuzz]})

    assert out["vi"] == [[v, encode_vi64(v).hex()] for _, v in vi]
    # What it sends is what our codec encodes.
    ns = tuple(NS)
    assert out["sent"]["subscribe"] == encode_message(D22, Subscribe(
        0, ns, b"raw", MessageParameters(location_filter=LocationFilter.next_object()))).hex()
    assert out["sent"]["fetch"] == encode_message(D22, Fetch(2, ns, b"raw", MessageParameters(
        location_filter=LocationFilter.absolute((0, 3), 0, 17)))).hex()
    # What it reads.
    c = out["control"]
    assert c[0]["ok"] == {"type": 4, "alias": 5, "largest": {"group": 0, "object": 3}, "expires": 1000,
                          "properties": {"14338": 64, "14339": "07" * 64}}
    assert c[1]["ok"] == {"type": 0x18, "endOfTrack": 1, "end": {"group": 0, "object": 3},
                          "properties": {"14338": 64, "14342": 4}}
    assert c[2]["ok"] == {"type": 5, "code": 0x10, "retry": 0, "reason": "no such track"}
    assert c[3]["ok"] == {"type": 0xB, "status": 2, "streams": 1, "reason": "done"}
    assert c[4] == {"error": 3} and c[5] == {"error": 3}
    expected = [{"group": 0, "object": i, "status": 0, "payload": p.hex(),
                 "properties": {str(LAYER_DIGEST): hashlib.sha256(p).hexdigest()}} for i, p in enumerate(payloads)]
    d = out["data"]
    for whole_then_bytewise in (d[0:2], d[2:4]):
        for result in whole_then_bytewise:
            assert "error" not in result, result
            assert result["ok"][1:] == expected
    assert d[0]["ok"][0] == {"request": 2}
    assert d[2]["ok"][0] == {"header": {"alias": 7, "group": 0, "subgroup": 0, "priority": 128}}
    assert [r.get("error") for r in d[4:8]] == [3, 3, 3, 3]
    assert d[4]["got"] == [{"request": 2}] + expected[:3]  # the objects before the cut
    assert d[8] == {"ok": [{"request": 2}, {"refused": 1 << 40}]}
    # Random bytes: objects or PROTOCOL_VIOLATION, never another exception (nor a hang).
    for result in d[9:]:
        assert "ok" in result or result["error"] == 3, result


async def test_viewer_routes_and_what_it_refuses(block: ViewerBlock) -> None:
    from kvsp_moq.cli.demo.cluster import http_request

    async with await serve_viewer([block]) as server:
        page = await http_request(server.url)
        config = await http_request(f"{server.url}api/blocks/0")
        script = await http_request(f"{server.url}moqt.js")
        missing = await http_request(f"{server.url}api/blocks/1")
        listing = await http_request(f"{server.url}api/blocks")
    assert page.status == 200 and b'<body data-done="0">' in page.body
    assert script.status == 200 and b"export class MoqtSession" in script.body
    assert "javascript" in {k.lower(): v for k, v in script.headers.items()}["content-type"]
    assert missing.status == 404
    assert json.loads(listing.body)["blocks"] == [{"n": 0, "block_key": block.record.block_key.hex(), "layers": 4}]
    cfg = json.loads(config.body)
    assert cfg["url"] == "https://127.0.0.1:4443/moq" and cfg["track"] == "raw"
    assert cfg["layer_bytes"] == 2 * 8 * 2 * 64 * 2  # K and V: tokens x kv_heads x head_dim x bf16
    assert cfg["layer_digests"] == [d.hex() for d in block.record.layer_digests or ()]
    assert bytes.fromhex(cfg["namespace"][4]) == block.record.block_name().replica_id  # type: ignore[union-attr]
    # Records it cannot show.
    doc = block.record.to_json()
    with pytest.raises(ViewerError, match="layer_digests"):
        ViewerBlock.from_record(ReplicaRecord.from_json({k: v for k, v in doc.items() if k != "layer_digests"}))
    with pytest.raises(ViewerError, match="not a moqt:// URL"):
        ViewerBlock.from_record(ReplicaRecord.from_json(
            {**{k: v for k, v in doc.items() if k != "moqt_namespace"}, "holder": "https://h.example/"}))
    with pytest.raises(ViewerError, match="https://"):
        ViewerBlock.from_record(block.record, url="moqt://127.0.0.1:1/moq")
    with pytest.raises(ViewerError, match="64 lowercase hex"):
        ViewerBlock.from_record(block.record, certificate_sha256="AB" * 32)
    with pytest.raises(ViewerError, match="codec raw"):
        ViewerBlock.from_record(ReplicaRecord.from_json({**doc, "size": doc["size"] + 1}))


def test_kvsp_moq_view_refuses_what_it_cannot_show(tmp_path, block: ViewerBlock) -> None:
    import subprocess
    import sys

    doc = {k: v for k, v in block.record.to_json().items() if k != "layer_digests"}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    (tmp_path / "ok.json").write_text(json.dumps(block.record.to_json()))
    for args, says in (([str(tmp_path / "r.json")], "layer_digests"),
                       ([str(tmp_path / "ok.json"), "--url", "moqt://127.0.0.1:1/moq"], "https://"),
                       ([str(tmp_path / "missing.json")], "missing.json")):
        proc = subprocess.run([sys.executable, "-m", "kvsp_moq", "moq", "view", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr and proc.stdout == "", (args, proc.stderr)
