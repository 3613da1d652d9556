"""Our WebTransport server against a real browser: Debian's Chromium (headless, driven by
Playwright with ``executable_path``; never a downloaded browser) opens a session with
``serverCertificateHashes`` for the short-lived ECDSA certificate the test makes, and every
primitive MOQT uses crosses in both directions: the WT-Protocol choice, a server-opened
unidirectional stream (how MOQT's subgroups reach a subscriber), datagrams, page-opened
unidirectional and bidirectional streams, a stream abort's code (the WebTransport error-code
mapping), and the close code and reason. The MOQT page itself is another test's.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsp_moq import transport
from kvsp_moq.transport import BaseConnectionHandler, Connection, TransportConfig
from kvsp_moq.transport.tls import WEBTRANSPORT_HASH_MAX_DAYS, make_self_signed

playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = "/usr/bin/chromium"
# No --disable-quic: WebTransport runs on HTTP/3.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GUARD = 60.0

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="Debian's chromium is not installed")

PAGE_SCRIPT = """async ([url, hex]) => {
  const value = new Uint8Array(hex.match(/../g).map(h => parseInt(h, 16)));
  const enc = new TextEncoder(), dec = new TextDecoder();
  const readAll = async (readable) => {
    const r = readable.getReader(); let text = '';
    for (;;) { const {value, done} = await r.read(); if (done) return text; text += dec.decode(value); }
  };
  const out = {};
  const wt = new WebTransport(url, {serverCertificateHashes: [{algorithm: 'sha-256', value}],
                                    protocols: ['moqt-22', 'moqt-20']});
  await wt.ready;
  out.protocol = wt.protocol;
  const incomingStreams = wt.incomingUnidirectionalStreams.getReader();
  const {value: incoming} = await incomingStreams.read();
  out.uni = await readAll(incoming);
  const datagrams = wt.datagrams.readable.getReader();
  await wt.datagrams.writable.getWriter().write(enc.encode('datagram from the page'));
  out.datagram = dec.decode((await datagrams.read()).value);
  const uni = (await wt.createUnidirectionalStream()).getWriter();
  await uni.write(enc.encode('uni from the page')); await uni.close();
  const bidi = await wt.createBidirectionalStream();
  const w = bidi.writable.getWriter();
  await w.write(enc.encode('bidi from the page')); await w.close();
  out.bidi = await readAll(bidi.readable);
  const aborted = (await wt.createUnidirectionalStream()).getWriter();
  await aborted.write(enc.encode('x'));
  await aborted.abort(new WebTransportError({streamErrorCode: 17}));
  out.reset_seen = await readAll((await incomingStreams.read()).value);
  wt.close({closeCode: 5, reason: 'page done'});
  await wt.closed;
  return out;
}"""


class Echo(BaseConnectionHandler):
    """The server side: opens a stream at once, answers a datagram with one, echoes a
    bidirectional stream, reports a reset on a stream of its own, records the close."""

    def __init__(self, events: asyncio.Queue[tuple[object, ...]]) -> None:
        self.events = events
        self.bidi: dict[int, bytearray] = {}

    def connection_made(self, conn: Connection, alpn: str) -> None:
        self.conn = conn
        self.events.put_nowait(("session", alpn, conn.is_webtransport))
        sid = conn.open_uni()
        conn.send(sid, b"hello from the server", end_stream=True)

    def stream_data(self, stream_id: int, data, end_stream: bool) -> None:
        self.events.put_nowait(("stream", transport.is_unidirectional(stream_id), bytes(data),
                                end_stream))
        assert self.conn is not None
        if not transport.is_unidirectional(stream_id):
            self.bidi.setdefault(stream_id, bytearray()).extend(data)
            if end_stream:
                self.conn.send(stream_id, b"echo: " + self.bidi.pop(stream_id), end_stream=True)

    def datagram_received(self, data) -> None:
        self.events.put_nowait(("datagram", bytes(data)))
        assert self.conn is not None
        self.conn.send_datagram(b"datagram back")

    def stream_reset(self, stream_id: int, error_code: int) -> None:
        self.events.put_nowait(("reset", error_code))
        assert self.conn is not None
        sid = self.conn.open_uni()  # tell the page what arrived
        self.conn.send(sid, f"reset {error_code}".encode(), end_stream=True)

    def connection_lost(self, error_code: int, reason: str) -> None:
        self.events.put_nowait(("lost", error_code, reason))


@pytest.fixture
def page_server(tmp_path: Path) -> Iterator[str]:
    """A plain HTTP origin on 127.0.0.1 (a secure context) for the page to run in."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


async def test_chromium_webtransport_session(page_server: str) -> None:
    cert = make_self_signed(days=WEBTRANSPORT_HASH_MAX_DAYS - 1)  # serverCertificateHashes
    events: asyncio.Queue[tuple[object, ...]] = asyncio.Queue()
    server = await transport.serve("127.0.0.1", 0, lambda: Echo(events), TransportConfig(
        certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem, webtransport=True))
    try:
        async with playwright_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page()
                await page.goto(page_server)
                out = await asyncio.wait_for(page.evaluate(
                    PAGE_SCRIPT, [f"https://127.0.0.1:{server.port}/moq", cert.sha256]), GUARD)
            finally:
                await browser.close()
        assert out == {"protocol": "moqt-22", "uni": "hello from the server",
                       "datagram": "datagram back", "bidi": "echo: bidi from the page",
                       "reset_seen": "reset 17"}
        seen = []
        while not seen or seen[-1][0] != "lost":
            seen.append(await asyncio.wait_for(events.get(), GUARD))
        assert seen[0] == ("session", "moqt-22", True)
        assert ("datagram", b"datagram from the page") in seen
        page_bytes = {(uni, data) for kind, uni, data, _ in
                      (e for e in seen if e[0] == "stream") if data}
        assert page_bytes >= {(True, b"uni from the page"), (False, b"bidi from the page")}
        assert ("reset", 17) in seen  # the page's abort code, through the WT mapping
        assert seen[-1] == ("lost", 5, "page done")  # CLOSE_WEBTRANSPORT_SESSION
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), GUARD)
