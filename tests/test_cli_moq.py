"""``kvsp moq subscribe|fetch|publish`` as real processes over real QUIC on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_moq.pubsub import ReceivedObject, MoqtSession, serve
from kvsp_moq.transport import TransportConfig
from kvsp_moq.transport.tls import make_self_signed

OBJECT_SIZE = 70_000
CMD = [sys.executable, "-m", "kvsp_moq", "moq"]


def expected_lines(data: bytes, first: int = 0, last: int | None = None) -> list[str]:
    chunks = [data[i:i + OBJECT_SIZE] for i in range(0, len(data), OBJECT_SIZE)]
    last = len(chunks) - 1 if last is None else last
    return [f"0 {i} {len(chunks[i])} {hashlib.sha256(chunks[i]).hexdigest()}" for i in range(first, last + 1)]


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(4 * OBJECT_SIZE + 1234)  # 5 objects, the last one short
    path = tmp_path / "block.bin"
    path.write_bytes(data)
    return path, data


async def _start_server(data_file: Path, *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        *CMD, "publish", "kvsp-1/demo", "raw", "--file", str(data_file), "--object-size",
        str(OBJECT_SIZE), "--serve", "127.0.0.1:0", *extra,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert proc.stderr is not None
    while True:  # the server says where it listens; read until it does
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, "publisher exited before serving"
        if m := re.search(r"serving (moqt://\S+)", line):
            return proc, m.group(1)


async def _run(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*CMD, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        os.killpg(proc.pid, signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_subscribe_then_fetch_against_publish_serve(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    server, url = await _start_server(path, "--subscribers", "1")
    try:
        rc, out, err = await _run("subscribe", url, "kvsp-1/demo", "raw", "--insecure", "--count", "5")
        assert rc == 0, err
        assert out.splitlines() == expected_lines(data)
        for draft in ("22", "20", "18"):
            rc, out, err = await _run("fetch", url, "kvsp-1/demo", "raw", "--insecure", "--draft", draft,
                                      "--start", "0:1", "--end", "0:3")
            assert rc == 0, err
            assert out.splitlines() == expected_lines(data, 1, 3)
    finally:
        await _stop(server)


async def test_errors_carry_the_moqt_code(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    server, url = await _start_server(path)
    try:
        rc, out, err = await _run("subscribe", url, "kvsp-1/other", "raw", "--insecure")
        assert rc == 1 and out == ""
        assert "MOQT error 0x10" in err  # REQUEST_ERROR DOES_NOT_EXIST
        rc, _, err = await _run("fetch", url, "kvsp-1/demo", "raw", "--insecure", "--start", "1-2")
        assert rc == 2 and "GROUP:OBJECT" in err
        rc, _, err = await _run("subscribe", url, "kvsp-1//x", "raw", "--insecure")
        assert rc == 2 and "none empty" in err
    finally:
        await _stop(server)


async def test_publish_as_client_to_a_server_that_subscribes(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    cert = make_self_signed()
    received: asyncio.Future[list[ReceivedObject]] = asyncio.get_running_loop().create_future()

    async def on_session(session: MoqtSession) -> None:
        kind, ns = await session.namespace_updates.get()
        assert (kind, ns) == ("publish_namespace", (b"kvsp-1", b"up"))
        sub = await session.subscribe(ns, "raw")
        objs = []
        async for obj in sub:
            objs.append(obj)
            if len(objs) == 5:
                break
        received.set_result(objs)

    server = await serve("127.0.0.1", 0, TransportConfig(certificate_pem=cert.cert_pem,
                                                         private_key_pem=cert.key_pem),
                         on_session=on_session)
    try:
        client = asyncio.ensure_future(_run(
            "publish", f"moqt://127.0.0.1:{server.port}/", "kvsp-1/up", "raw", "--file", str(path),
            "--object-size", str(OBJECT_SIZE), "--subscribers", "1", "--insecure"))
        objs = await asyncio.wait_for(received, 60)
        rc, _, err = await client
        assert rc == 0, err
        assert [f"{o.group_id} {o.object_id} {len(o.payload)} {hashlib.sha256(o.payload).hexdigest()}"
                for o in objs] == expected_lines(data)
        assert "object 5/5" in err
    finally:
        server.close()
        await server.wait_closed()


async def test_binary_namespace_fields(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    proc = await asyncio.create_subprocess_exec(
        *CMD, "publish", "kvsp-1/hex:ab01", "raw", "--file", str(path), "--object-size",
        str(OBJECT_SIZE), "--serve", "127.0.0.1:0",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert proc.stderr is not None
    while True:  # the server says where it listens (and names the field in hex)
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, "publisher exited before serving"
        if m := re.search(r"serving (moqt://\S+) (\S+)", line):
            url = m.group(1)
            assert m.group(2) == "kvsp-1/hex:ab01"
            break
    try:
        for spelling in ("kvsp-1/hex:ab01", "kvsp-1/0xab01"):  # both are the octets ab 01
            rc, out, err = await _run("fetch", url, spelling, "raw", "--insecure")
            assert rc == 0, err
            assert out.splitlines() == expected_lines(data)
        rc, out, err = await _run("fetch", url, "kvsp-1/ab01", "raw", "--insecure")  # the text "ab01"
        assert rc == 1 and out == "" and "MOQT error 0x10 (REQUEST_ERROR DOES_NOT_EXIST)" in err
        rc, _, err = await _run("fetch", url, "kvsp-1/hex:abc", "raw", "--insecure")
        assert rc == 2 and "hex digits" in err
    finally:
        await _stop(proc)


async def test_a_server_that_never_answers_is_one_line_with_a_hint() -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never answers
        silent.bind(("127.0.0.1", 0))
        port = silent.getsockname()[1]
        rc, out, err = await _run("fetch", f"moqt://127.0.0.1:{port}/", "kvsp-1/x", "raw", "--insecure",
                                  "--connect-timeout", "0.5")
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"kvsp: cannot connect: QUIC handshake with 127.0.0.1:{port} timed out")
    assert "reachable over UDP" in lines[0]


async def test_block_names_are_checked_before_connecting() -> None:
    for block, problem in (("ab/cd", "4 hex fields"), ("00/11/22/33", "compat_id must be 32 octets"),
                           ("!!", "base64url")):
        rc, _, err = await _run("fetch", "moqt://127.0.0.1:9/", "--block", block, "--insecure")
        assert rc == 2 and err.startswith("kvsp: --block") and problem in err, err
