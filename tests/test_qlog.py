"""qlog files on request (``TransportConfig.qlog_dir``; docs/tracing.md), on real QUIC over
127.0.0.1 with each installed library (aioquic, qh3) on each end.

A real transfer (bulk bytes echoed on a bidi stream, then a close) with qlog on writes, per
connection, one file at each end, ``{ODCID}_{client|server}.qlog``: one JSON qlog document
(``qlog_format`` JSON, the library's ``qlog_version``) with one trace whose vantage point is
that end and whose events include ``packet_sent`` and ``packet_received``. With qlog off, no
file. Nothing sleeps: every wait is on a callback's future or the server's close.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.transport import BaseConnectionHandler, Connection, TransportConfig, connect, serve
from kvsp_moq.transport.qlog import QlogDirectory, qlog_file_name
from kvsp_moq.transport.tls import SelfSignedCert, make_self_signed

from tests._transport_backends import pairing, server_backend  # noqa: F401

GUARD = 30.0  # a safety net against hangs, never a way to wait for something
PAYLOAD = os.urandom(256 * 1024)


class Echo(BaseConnectionHandler):
    """Echoes each bidi stream; ``lost`` completes when the connection is gone."""

    def __init__(self) -> None:
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        assert self.conn is not None
        self.conn.send(stream_id, bytes(data), end_stream=end_stream)

    def connection_lost(self, error_code: int, reason: str) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class Collect(BaseConnectionHandler):
    def __init__(self) -> None:
        self.body = bytearray()
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        self.body += data
        if end_stream:
            self.done.set_result(bytes(self.body))


@pytest.fixture(scope="module")
def cert() -> SelfSignedCert:
    return make_self_signed()


async def transfer(cert: SelfSignedCert, server_qlog: Path | None, client_qlog: Path | None,
                   connections: int = 1) -> None:
    """``connections`` connections, each echoing PAYLOAD once, closed, and the server closed."""
    handlers: list[Echo] = []

    def factory() -> Echo:
        handlers.append(Echo())
        return handlers[-1]

    server = await serve("127.0.0.1", 0, factory, TransportConfig(
        backend=server_backend(), certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
        qlog_dir=server_qlog))
    try:
        for _ in range(connections):
            collect = Collect()
            conn: Connection = await asyncio.wait_for(connect(
                f"moqt://127.0.0.1:{server.port}/moq", lambda c=collect: c,  # type: ignore[misc]
                TransportConfig(ca_data=cert.cert_pem, qlog_dir=client_qlog)), GUARD)
            sid = conn.open_bidi()
            await conn.write(sid, PAYLOAD, end_stream=True)
            assert await asyncio.wait_for(collect.done, GUARD) == PAYLOAD
            await asyncio.wait_for(conn.aclose(), GUARD)  # the closing period is over
            await asyncio.wait_for(handlers[-1].lost, GUARD)
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), GUARD)


def qlog_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))


def check_qlog(path: Path, vantage: str) -> dict[str, Any]:
    document = json.loads(path.read_text())
    assert document["qlog_format"] == "JSON"
    assert document["qlog_version"] == "0.3"
    (trace,) = document["traces"]
    assert trace["vantage_point"]["type"] == vantage
    assert path.name == f"{trace['common_fields']['ODCID']}_{vantage}.qlog"
    names = {event["name"] for event in trace["events"]}
    assert {"transport:packet_sent", "transport:packet_received"} <= names, names
    # the bulk bytes crossed, both ways: aioquic logs every frame (the echoed stream's STREAM
    # frames); qh3's Rust core gives packet headers and sizes only (its 1-RTT packets received
    # appear as datagrams_received), so there the datagrams' sizes are counted
    frames = [f for e in trace["events"] if e["name"] in ("transport:packet_sent", "transport:packet_received")
              for f in e["data"].get("frames", ())]
    streamed = sum(f.get("length", 0) for f in frames if f.get("frame_type") == "stream")
    carried = sum(r["length"] for e in trace["events"] if e["name"].startswith("transport:datagrams_")
                  for r in e["data"].get("raw", ()))
    assert max(streamed, carried) >= 2 * len(PAYLOAD), (streamed, carried)
    return trace


async def test_qlog_one_file_per_connection_on_each_end(tmp_path: Path, cert: SelfSignedCert) -> None:
    server_dir, client_dir = tmp_path / "server", tmp_path / "client"
    await transfer(cert, server_dir, client_dir, connections=2)
    clients, servers = qlog_files(client_dir), qlog_files(server_dir)
    assert len(clients) == 2 and len(servers) == 2
    client_ids = {check_qlog(p, "client")["common_fields"]["ODCID"] for p in clients}
    server_ids = {check_qlog(p, "server")["common_fields"]["ODCID"] for p in servers}
    assert client_ids == server_ids  # the same two connections, seen from each end


async def test_qlog_both_ends_in_one_directory_do_not_collide(tmp_path: Path, cert: SelfSignedCert) -> None:
    await transfer(cert, tmp_path, tmp_path)
    files = qlog_files(tmp_path)
    assert [p.name.rsplit("_", 1)[1] for p in files] == ["client.qlog", "server.qlog"]
    odcid = files[0].name.split("_")[0]
    assert files[1].name == f"{odcid}_server.qlog"
    check_qlog(files[0], "client")
    check_qlog(files[1], "server")


async def test_no_qlog_when_off(tmp_path: Path, cert: SelfSignedCert, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    await transfer(cert, None, None)
    assert list(tmp_path.iterdir()) == []


def test_flush_writes_open_traces_and_end_rewrites(tmp_path: Path) -> None:
    class Trace:
        def __init__(self, *, is_client: bool, odcid: bytes) -> None:
            self.events: list[str] = []
            self.is_client = is_client

        def to_dict(self) -> dict[str, Any]:
            return {"events": list(self.events), "vantage_point": {"type": "client" if self.is_client else "server"}}

    logger = QlogDirectory(tmp_path / "made", Trace, "0.3")
    trace = logger.start_trace(is_client=True, odcid=b"\x01\x02")
    trace.events.append("a")
    (path,) = logger.flush()
    assert path.name == qlog_file_name(b"\x01\x02", True) == "0102_client.qlog"
    assert json.loads(path.read_text())["traces"][0]["events"] == ["a"]
    trace.events.append("b")
    logger.end_trace(trace)
    assert json.loads(path.read_text())["traces"][0]["events"] == ["a", "b"]
    assert logger.open_traces == 0 and logger.flush() == []
