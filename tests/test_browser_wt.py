"""A real browser receives a KV block over WebTransport through the relay (issue 20,
docs/viewer.md).

The relay (``python -m relay`` as a process, WebTransport on, a 13-day ECDSA P-256 certificate
made here, whose SHA-256 it prints) takes a holder (``MoqtHolder``) over raw QUIC as the block's publisher; ``kvsp moq view`` runs
as a process and serves the page for the holder's Replica Record; Debian's Chromium, driven by
Playwright, opens it: the page connects to the relay over WebTransport with
``serverCertificateHashes``, does MOQT SETUP (draft 22), SUBSCRIBEs to the block's track and
FETCHes its layers (binding v1: one object per layer), hashes each with ``crypto.subtle`` and
compares it with the record's layer digest. The test waits for ``body[data-done="1"]``
(bounded), reads the results from the page and checks every digest against the record and the
store. A second block is published through the relay by a publisher that flips one byte of
layer 2 (a record naming that replica): the page must show ✗ for layer 2 only. A third block
is still being computed (``MoqtHolder.begin``, binding §6): layers 0-2 exist when the page
subscribes and come by FETCH, each later one is written only after the page showed the one
before it verified, so it can only have come live on the subscription (a subgroup stream).
Screenshots go to the test's tmp dir (and the third one to docs/img/browser-wt.png with
KVSP_UPDATE_SCREENSHOTS=1).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge_support import HolderNode, make_key, make_layers
from relay_restart_support import RelayProcess
from kvsp_moq.cli.demo.cluster import http_request
from kvsp_moq.control.dashboard.collect import parse_metrics
from kvsp_moq.storage import BlockStore, HostTier
from kvsp_moq.bridge import LAYER_DIGEST
from kvsp_moq.kvsp.naming import BlockName
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.pubsub import Catalog, MoqtSession, connect
from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import WEBTRANSPORT_HASH_MAX_DAYS, make_self_signed

playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = "/usr/bin/chromium"
# WebTransport needs QUIC: no --disable-quic here (unlike tests/test_dashboard.py).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GUARD = 60.0  # a safety net against hangs, never a way to wait for something
ROOT = Path(__file__).resolve().parent.parent
LAYERS = 8
BAD_LAYER = 2

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


async def tampering_publisher(relay_url: str, name: BlockName, payloads: list[bytes],
                              digests: list[bytes]) -> MoqtSession:
    """A client of the relay (raw QUIC) publishing ``name`` with one flipped byte in layer
    BAD_LAYER and the honest LAYER_DIGEST property on every object."""
    catalog = Catalog()
    track = catalog.create(name.namespace_fields(), "raw", keep=True)
    for layer, payload in enumerate(payloads):
        data = bytearray(payload)
        if layer == BAD_LAYER:
            data[len(data) // 2] ^= 0x01
        await track.write_object(0, layer, bytes(data), properties=((LAYER_DIGEST, digests[layer]),))
    session = await within(connect(relay_url, TransportConfig(insecure=True), catalog=catalog))
    await within(session.publish_namespace(name.namespace_fields()))
    return session


async def start_viewer(records: list[Path], wt_url: str, cert_sha256: str) -> tuple[asyncio.subprocess.Process, str]:
    """``kvsp moq view`` as a process; returns it and the page's URL (its first stdout line)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvsp_moq", "moq", "view", *map(str, records), "--url", wt_url,
        "--cert-sha256", cert_sha256, "--timeout", str(GUARD / 2),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None
    line = (await within(proc.stdout.readline())).decode()
    assert line.startswith("kvsp moq view: http://127.0.0.1:"), line
    return proc, line.split(": ", 1)[1].strip()


async def open_page(browser: Any, url: str) -> tuple[Any, list[str]]:
    page = await browser.new_page(viewport={"width": 1200, "height": 700})
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    await page.goto(url)
    return page, console


async def view(browser: Any, url: str, shot: Path, page: Any = None, console: list[str] | None = None) -> dict[str, Any]:
    if page is None:
        page, console = await open_page(browser, url)
    try:
        try:
            await page.wait_for_selector('body[data-done="1"]', timeout=GUARD * 1e3)
        except playwright_api.TimeoutError:
            await page.screenshot(path=str(shot), full_page=True)
            raise AssertionError(f"the page did not finish; console: {console}") from None
        result: dict[str, Any] = json.loads(await page.evaluate("document.body.dataset.result"))
        result["rows"] = await page.evaluate("""() => [...document.querySelectorAll('tr.layer')].map(
            (r) => ({layer: Number(r.dataset.layer), verified: r.dataset.verified,
                     mark: r.querySelector('.mark').textContent}))""")
        result["status"] = await page.evaluate("document.getElementById('status').textContent")
        await page.screenshot(path=str(shot), full_page=True)
        return result
    finally:
        await page.close()


async def test_chromium_receives_and_verifies_a_block_through_the_relay(tmp_path: Path) -> None:
    cert = make_self_signed(days=WEBTRANSPORT_HASH_MAX_DAYS - 1)
    cert_file, key_file = cert.write(tmp_path / "relay.crt", tmp_path / "relay.key")
    relay = await RelayProcess(tmp_path / "relay.log", "--cert", str(cert_file), "--key", str(key_file),
                               "--metrics", "0").start()
    assert relay.proc is not None and relay.proc.stdout is not None
    wt_line = (await within(relay.proc.stdout.readline())).decode().strip()
    assert wt_line == f"relay webtransport on https://127.0.0.1:{relay.port}/moq (certificate sha-256 {cert.sha256})"
    metrics_url = (await within(relay.proc.stdout.readline())).decode().split(" on ", 1)[1].strip()
    holder = await HolderNode().start()
    liar: MoqtSession | None = None
    viewer: asyncio.subprocess.Process | None = None
    try:
        moqt_url = f"moqt://127.0.0.1:{relay.port}/moq"
        wt_url = f"https://127.0.0.1:{relay.port}/moq"
        # The honest block: stored at the holder, published through the relay over raw QUIC.
        await within(holder.holder.attach_relay(moqt_url, TransportConfig(insecure=True)))
        key, layers = make_key(20), make_layers(LAYERS, tokens=64)
        holder.put(key, layers)
        assert await holder.holder.wait_announced(GUARD)
        record = holder.holder.replica_record(key, holder=moqt_url)
        assert record.layer_digests is not None
        payloads = [holder.payload(key, layer) for layer in range(LAYERS)]
        assert [hashlib.sha256(p).digest() for p in payloads] == list(record.layer_digests)
        # The tampered one: another replica id, the same layer digests, one flipped byte.
        bad_name = BlockName(record.compat_id, record.scope_id, record.block_key, os.urandom(16))
        bad_record = ReplicaRecord.from_json({**record.to_json(), "moqt_namespace": bad_name.moqt_namespace()})
        liar = await tampering_publisher(moqt_url, bad_name, payloads, list(record.layer_digests))

        # The block being computed: its record is the one the replica will have (made by
        # another store from the same layers, under the replica id begin() chose).
        skey, slayers = make_key(21), make_layers(LAYERS, tokens=64, seed=5)
        writer = holder.holder.begin(skey, slayers.geometry, LAYERS, slayers.tokens)
        assert await holder.holder.wait_announced(GUARD)
        twin = BlockStore([HostTier(64 << 20)])
        twin.put_layers(skey, slayers.arrays, token_count=slayers.tokens, geometry=slayers.geometry)
        twin_record = twin.info(skey).replica_record(moqt_url, 600_000)
        live_name = BlockName(twin_record.compat_id, twin_record.scope_id, twin_record.block_key, writer.replica_id)
        live_record = ReplicaRecord.from_json({**twin_record.to_json(), "moqt_namespace": live_name.moqt_namespace()})
        for layer in range(3):
            writer.write_layer(layer, *slayers.arrays[layer])

        files = [tmp_path / "record.json", tmp_path / "tampered.json", tmp_path / "streaming.json"]
        for path, rec in zip(files, (record, bad_record, live_record)):
            path.write_text(json.dumps(rec.to_json()))
        viewer, page_url = await start_viewer(files, wt_url, cert.sha256)

        async with playwright_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                good = await view(browser, f"{page_url}?block=0", tmp_path / "browser-wt.png")
                bad = await view(browser, f"{page_url}?block=1", tmp_path / "browser-wt-tampered.png")
                page, console = await open_page(browser, f"{page_url}?block=2")
                await page.wait_for_selector('body[data-subscribed="1"]', timeout=GUARD * 1e3)
                for layer in range(3, LAYERS):  # each after the page verified the one before
                    await page.wait_for_selector(f'tr.layer[data-layer="{layer - 1}"][data-verified="1"]',
                                                 timeout=GUARD * 1e3)
                    writer.write_layer(layer, *slayers.arrays[layer])
                writer.finish()
                live = await view(browser, "", tmp_path / "browser-wt-streaming.png", page, console)
            finally:
                await browser.close()
        if os.environ.get("KVSP_UPDATE_SCREENSHOTS") == "1":  # refresh the docs' picture on purpose
            (ROOT / "docs" / "img").mkdir(exist_ok=True)
            shutil.copyfile(tmp_path / "browser-wt-streaming.png", ROOT / "docs" / "img" / "browser-wt.png")
        metrics = await within(http_request(metrics_url))
        live_stored = holder.store.info(skey).layer_digests
    finally:
        if viewer is not None:
            viewer.terminate()
            assert await within(viewer.wait()) == 0
        if liar is not None:
            await within(liar.close())
        await holder.close()
        relay.proc.terminate()
        assert await relay.wait() == 0, (tmp_path / "relay.log").read_text()[-2000:]

    # Every layer arrived in the browser and its SHA-256 is the record's (and the store's).
    assert good["error"] is None, good
    assert [r["layer"] for r in good["layers"]] == list(range(LAYERS))
    assert all(r["verified"] for r in good["layers"]), good
    assert [bytes.fromhex(r["digest"]) for r in good["layers"]] == list(record.layer_digests)
    assert {r["via"] for r in good["layers"]} == {"FETCH"}  # a complete block (binding §5, §6)
    assert [r["mark"] for r in good["rows"]] == ["✓"] * LAYERS
    assert good["status"].startswith(f"{LAYERS} of {LAYERS} layers received and verified")
    # The tampered replica: layer 2 differs from the record, the page says so and nothing else.
    assert bad["error"] is None, bad
    marks = ["✗" if layer == BAD_LAYER else "✓" for layer in range(LAYERS)]
    assert [r["mark"] for r in bad["rows"]] == marks
    assert [r["verified"] for r in bad["layers"]] == [m == "✓" for m in marks]
    flipped = bytearray(payloads[BAD_LAYER])
    flipped[len(flipped) // 2] ^= 0x01
    assert bad["layers"][BAD_LAYER]["digest"] == hashlib.sha256(flipped).hexdigest()
    assert bad["layers"][BAD_LAYER]["expected"] == record.layer_digests[BAD_LAYER].hex()
    assert any("layer 2: SHA-256 differs" in p for p in bad["problems"])
    # The block being computed: the layers before the subscription by FETCH, the rest live.
    assert live["error"] is None, live
    assert all(r["verified"] for r in live["layers"]), live
    assert [r["via"] for r in live["layers"]] == ["FETCH"] * 3 + ["SUBSCRIBE"] * (LAYERS - 3)
    assert [bytes.fromhex(r["digest"]) for r in live["layers"]] == list(live_stored) == \
        list(twin_record.layer_digests or ())
    assert [r["mark"] for r in live["rows"]] == ["✓"] * LAYERS
    # The relay carried the sessions' objects downstream (raw QUIC in, WebTransport out).
    assert metrics.status == 200
    assert parse_metrics(metrics.body.decode()).get("relay_objects_out_total") >= 3 * LAYERS
