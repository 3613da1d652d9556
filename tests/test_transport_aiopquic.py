"""The aiopquic backend (picoquic through aiopquic; Python >= 3.12 only).

Where aiopquic cannot be imported (the Python 3.11 CI): choosing it fails with the errors
that name the package and the interpreter, and the two ``*_under_aiopquic`` tests build a
Python >= 3.12 venv with aiopquic and our dependencies (cached beside the interop peers:
``$KVSP_PEER_CACHE`` or ``.peers/``, via ``interop.peers``) and run there, on this working
tree, with ``KVSP_QUIC_BACKEND=aiopquic``: the transport suite for every backend pair that
has aiopquic on one end (plus this module, whose in-process tests then run), and the MOQT
pub/sub and relay tests over aiopquic alone. Every test's outcome is checked: a skip is
allowed only where ``tests/_transport_backends.AIOPQUIC_SKIPS`` predicts it, with its reason.

Where aiopquic is importable, the in-process tests below check what those skips leave out
and what only this backend does (close codes without reasons, TLS failures picoquic detects,
its datagram ceiling, send queues in front of its rings, the idle timeout). Real QUIC on
127.0.0.1; nothing sleeps to wait for a condition.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from interop import peers
from kvsp_moq.transport import (
    BackendUnavailableError,
    BaseConnectionHandler,
    ConnectError,
    Connection,
    ConnectionClosedError,
    Server,
    StreamClosedError,
    TransportConfig,
    available_backends,
    connect,
    load_backend,
    serve,
)
from kvsp_moq.transport.config import BACKEND_ENV
from kvsp_moq.transport.tls import SelfSignedCert, make_self_signed
from tests._transport_backends import _aiopquic_skip, _native_skip

ROOT = Path(__file__).resolve().parent.parent
HAVE_AIOPQUIC = "aiopquic" in available_backends()
GUARD = 60.0  # a safety net against hangs, never a way to wait for something
MiB = 1 << 20

needs_aiopquic = pytest.mark.skipif(
    not HAVE_AIOPQUIC, reason="aiopquic is not importable here (Python >= 3.12 with "
    "kvsp-moq[aiopquic]); the *_under_aiopquic tests run this module in such a venv")

AIOPQUIC_PAIRS = {("aiopquic", "aiopquic"), ("aioquic", "aiopquic"), ("qh3", "aiopquic"),
                  ("aiopquic", "aioquic"), ("aiopquic", "qh3")}
#: With the native extension built for the venv's Python too (``venv_pairs``), issue 28.
NATIVE_PAIRS = {("native", "aiopquic"), ("aiopquic", "native")}
TRANSPORT_MODULES = ["tests/test_transport.py", "tests/test_transport_io.py",
                     "tests/test_transport_drain.py"]
#: Python >= 3.12 for aiopquic's wheels; the venv holds aiopquic and our dependencies (the
#: tests import kvsp_moq from this working tree).
VENV_SPEC = peers.PeerSpec("kvsp-aiopquic", "aiopquic==0.6.1", (3, 12), "aiopquic")
#: Relies on the relay receiving one object in several stream_data chunks; an aiopquic relay
#: often gets it in one (picoquic fills the stream's receive ring before asyncio drains it).
CHUNKING_TEST = "tests/test_relay.py::test_payload_chunks_shared_not_copied"


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


# ------------------------------------------------------------------------------------------
# without aiopquic


def test_missing_aiopquic_is_named() -> None:
    if HAVE_AIOPQUIC:
        pytest.skip("aiopquic is importable here")
    with pytest.raises(BackendUnavailableError) as info:
        load_backend("aiopquic")
    assert isinstance(info.value, ImportError) and info.value.package == "aiopquic"
    assert "kvsp-moq[aiopquic]" in str(info.value)
    with pytest.raises(ValueError, match=r"3\.12"):
        TransportConfig(backend="aiopquic")


# ------------------------------------------------------------------------------------------
# the suites in a Python >= 3.12 venv with aiopquic

_RECORDER = r"""
import json, sys
import pytest

class Recorder:
    def __init__(self):
        self.items, self.outcomes = {}, {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            spec = getattr(item, "callspec", None)
            pair = spec.params.get("pairing") if spec is not None else None
            self.items[item.nodeid] = {"name": item.originalname,
                                       "pair": list(pair) if pair else None}

    def pytest_runtest_logreport(self, report):
        rank = {"passed": 0, "skipped": 1, "failed": 2}
        if report.when != "call" and report.outcome == "passed":
            return
        reason = None
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed:
            reason = str(report.longrepr)[-2000:]
        old = self.outcomes.get(report.nodeid)
        if old is None or rank[report.outcome] > rank[old["outcome"]]:
            self.outcomes[report.nodeid] = {"outcome": report.outcome, "reason": reason}

recorder = Recorder()
rc = pytest.main(sys.argv[2:], plugins=[recorder])
with open(sys.argv[1], "w") as out:
    json.dump({"rc": int(rc), "items": recorder.items, "outcomes": recorder.outcomes}, out)
"""


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return sorted(set(project["dependencies"]) | set(extras.get("test", ()))
                  | set(extras.get("aiopquic", ())))


@pytest.fixture(scope="module")
def venv_python() -> Path:
    if HAVE_AIOPQUIC:
        pytest.skip("aiopquic is importable here: this module's in-process tests cover it")
    try:
        peers.find_interpreter(VENV_SPEC.min_python)
    except peers.PeerUnavailable as exc:
        pytest.skip(f"LOUD SKIP: the aiopquic backend cannot be tested here: {exc}")
    bin_dir = peers.ensure_peer(VENV_SPEC)
    marker = bin_dir.parent / "kvsp-requirements.json"
    wanted = _requirements()
    if not marker.exists() or json.loads(marker.read_text()) != wanted:
        proc = subprocess.run([str(bin_dir / "pip"), "install", "-q", *wanted],
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        marker.write_text(json.dumps(wanted))
    return bin_dir / "python"


@pytest.fixture(scope="module")
def venv_pairs(venv_python: Path) -> set[tuple[str, str]]:
    """The backend pairs with aiopquic on one end that the venv runs: native's too where the
    native extension is built here, after building it for the venv's Python (setup.py in
    place: one more ``_ngtcp2.cpython-3XY-*.so`` beside this Python's)."""
    if "native" not in available_backends():
        return AIOPQUIC_PAIRS
    python = str(venv_python)
    if subprocess.run([python, "-c", "import setuptools"], capture_output=True).returncode:
        proc = subprocess.run([python, "-m", "pip", "install", "-q", "setuptools"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    check = subprocess.run([python, "-c", "from kvsp_moq.transport import available_backends;"
                            " print('native' in available_backends())"], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                           text=True, timeout=120)
    assert check.stdout.strip() == "True", check.stdout + check.stderr[-3000:]
    return AIOPQUIC_PAIRS | NATIVE_PAIRS


def _run_recorded(python: Path | str, args: list[str], tmp_path: Path, name: str,
                  timeout: float = 1500) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{BACKEND_ENV: "aiopquic"})
    env.pop("PYTEST_ADDOPTS", None)
    # "-o addopts=": in one process, without the suite's xdist workers (pyproject.toml), which
    # the aiopquic venv does not install and whose items the recorder would not see.
    proc = subprocess.run([str(python), "-c", _RECORDER, str(out), "-q", "-p",
                           "no:cacheprovider", "-o", "addopts=", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = proc.stdout[-3000:]
    return result


def _per_pair(items: dict[str, Any]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for item in items.values():
        if item["pair"] is not None:
            pair = (item["pair"][0], item["pair"][1])
            counts[pair] = counts.get(pair, 0) + 1
    return counts


def test_transport_suite_under_aiopquic(venv_python: Path, venv_pairs: set[tuple[str, str]],
                                        tmp_path: Path) -> None:
    """The transport suite for every pair with aiopquic on one end (native's both ways where
    the native extension is built), and this module's in-process tests: each outcome as
    predicted."""
    got = _run_recorded(venv_python, [*TRANSPORT_MODULES, "tests/test_transport_aiopquic.py",
                                      "-k", "aiopquic"], tmp_path, "transport")
    # The same modules here, collected only: tests per backend pair.
    here = _run_recorded(sys.executable, [*TRANSPORT_MODULES, "--collect-only"], tmp_path,
                         "collected")
    per_pair = set(_per_pair(here["items"]).values())
    assert len(per_pair) == 1, per_pair
    counts = _per_pair(got["items"])
    assert set(counts) == venv_pairs and set(counts.values()) == per_pair, counts
    unexpected = []
    for nodeid, item in got["items"].items():
        outcome = got["outcomes"].get(nodeid, {"outcome": "not run", "reason": None})
        if item["pair"] is not None:
            why = _aiopquic_skip(item["name"], *item["pair"]) or \
                _native_skip(item["name"], *item["pair"])
            want = ("passed", None) if why is None else ("skipped", why)
        elif item["name"] in ("test_transport_suite_under_aiopquic",
                              "test_pubsub_and_relay_under_aiopquic",
                              "test_webtransport_under_aiopquic"):  # the drivers: skipped inside
            want = ("skipped", "aiopquic is importable here: this module's in-process tests "
                               "cover it")
        elif item["name"] == "test_missing_aiopquic_is_named":
            want = ("skipped", "aiopquic is importable here")
        else:
            want = ("passed", None)
        if (outcome["outcome"], outcome["reason"]) != want:
            unexpected.append((nodeid, outcome, want))
    assert unexpected == [], unexpected
    assert got["rc"] == 0, got["log"]
    passed = sum(o["outcome"] == "passed" for o in got["outcomes"].values())
    print(f"aiopquic transport suite: {passed} passed of {len(got['items'])}")


def test_pubsub_and_relay_under_aiopquic(venv_python: Path, tmp_path: Path) -> None:
    """The MOQT pub/sub layer and the relay, every endpoint on aiopquic."""
    got = _run_recorded(venv_python, ["tests/test_pubsub.py", "tests/test_relay.py",
                                      "--deselect", CHUNKING_TEST], tmp_path, "pubsub")
    outcomes = {nodeid: o["outcome"] for nodeid, o in got["outcomes"].items()}
    assert len(got["items"]) > 20 and set(outcomes) == set(got["items"]), got["log"]
    assert set(outcomes.values()) == {"passed"}, got["outcomes"]
    assert got["rc"] == 0, got["log"]


def test_webtransport_under_aiopquic(venv_python: Path, tmp_path: Path) -> None:
    """MOQT over WebTransport (tests/test_webtransport.py, its aiopquic cases: our HTTP/3
    layer on picoquic's streams) and the relay between raw QUIC and WebTransport on aiopquic;
    the ``kvsp moq`` process test is left to the main venv (the CLI's own dependencies)."""
    got = _run_recorded(venv_python, ["tests/test_webtransport.py", "-k",
                                      "aiopquic or relay"], tmp_path, "webtransport")
    outcomes = {nodeid: o["outcome"] for nodeid, o in got["outcomes"].items()}
    assert sum("aiopquic" in n for n in outcomes) >= 3, got["log"]
    assert set(outcomes.values()) == {"passed"}, got["outcomes"]
    assert got["rc"] == 0, got["log"]


# ------------------------------------------------------------------------------------------
# in process, with aiopquic


class Recorder(BaseConnectionHandler):
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.made: asyncio.Future[str] = loop.create_future()
        self.lost: asyncio.Future[tuple[int, str]] = loop.create_future()
        self.data: dict[int, bytearray] = {}
        self.ended: dict[int, asyncio.Future[bytes]] = {}
        self.datagrams: asyncio.Queue[bytes] = asyncio.Queue()

    def done(self, stream_id: int) -> asyncio.Future[bytes]:
        if stream_id not in self.ended:
            self.ended[stream_id] = asyncio.get_running_loop().create_future()
        return self.ended[stream_id]

    def connection_made(self, conn: Connection, alpn: str) -> None:
        super().connection_made(conn, alpn)
        self.made.set_result(alpn)

    def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
        self.data.setdefault(stream_id, bytearray()).extend(data)
        if end_stream:
            self.done(stream_id).set_result(bytes(self.data[stream_id]))

    def datagram_received(self, data: bytes | memoryview) -> None:
        self.datagrams.put_nowait(bytes(data))

    def connection_lost(self, error_code: int, reason: str) -> None:
        self.lost.set_result((error_code, reason))


class Factory:
    def __init__(self, cls: Callable[[], Recorder] = Recorder) -> None:
        self.cls = cls
        self.made: list[Recorder] = []
        self.first: asyncio.Future[Recorder] = asyncio.get_running_loop().create_future()

    def __call__(self) -> Recorder:
        handler = self.cls()
        self.made.append(handler)
        if not self.first.done():
            self.first.set_result(handler)
        return handler


@pytest.fixture(scope="module")
def cert() -> SelfSignedCert:
    return make_self_signed()


def server_config(cert: SelfSignedCert, backend: str = "aiopquic", **kw: Any) -> TransportConfig:
    return TransportConfig(backend=backend, certificate_pem=cert.cert_pem,
                           private_key_pem=cert.key_pem, **kw)


def client_config(cert: SelfSignedCert, backend: str = "aiopquic", **kw: Any) -> TransportConfig:
    return TransportConfig(backend=backend, ca_data=cert.cert_pem, **kw)


@pytest.fixture
async def closing() -> AsyncIterator[list[Server]]:
    servers: list[Server] = []
    yield servers
    for server in servers:
        server.close()
        await within(server.wait_closed())


async def dial(server: Server, config: TransportConfig,
               handler: Recorder | None = None) -> tuple[Connection, Recorder]:
    handler = handler or Recorder()
    conn = await within(connect(f"moqt://127.0.0.1:{server.port}/moq", lambda: handler, config))
    return conn, handler


PAIRS = [("aiopquic", "aiopquic"), ("aioquic", "aiopquic"), ("aiopquic", "aioquic")]
PAIR_IDS = ["aiopquic", "aioquic-to-aiopquic", "aiopquic-to-aioquic"]


@needs_aiopquic
@pytest.mark.parametrize("closer", ["client", "server"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
async def test_close_codes_reach_the_peer_without_reasons(cert, closing, pair, closer) -> None:
    client, srv = pair
    factory = Factory()
    server = await serve("127.0.0.1", 0, factory, server_config(cert, srv))
    closing.append(server)
    conn, handler = await dial(server, client_config(cert, client))
    peer = await within(factory.first)
    local, remote = (conn, peer) if closer == "client" else (peer.conn, handler)
    local_handler = handler if closer == "client" else peer
    assert local is not None and remote.conn is not None
    local.close(0x1234, "going away")
    with pytest.raises(ConnectionClosedError):
        local.open_bidi()
    assert await within(local_handler.lost) == (0x1234, "going away")  # kept locally
    assert await within(remote.lost) == (0x1234, "")  # picoquic carries no reason
    info = remote.conn.close_info
    assert info is not None and info.application and not info.local
    assert (await within(local.wait_closed())).local
    assert (await within(remote.conn.wait_closed())).error_code == 0x1234


@needs_aiopquic
@pytest.mark.parametrize("client", ["aiopquic", "aioquic"])
async def test_server_close_and_internal_error_codes(cert, closing, client) -> None:
    class Broken(Recorder):
        def stream_data(self, stream_id, data, end_stream):
            raise RuntimeError("bug in the upper layer")

    server = await serve("127.0.0.1", 0, Factory(Broken), server_config(cert))
    closing.append(server)
    conn, handler = await dial(server, client_config(cert, client))
    sid = conn.open_bidi()
    conn.send(sid, b"boom", end_stream=True)
    assert (await within(handler.lost))[0] == 0x1
    await within(conn.wait_closed())

    factory = Factory()
    other = await serve("127.0.0.1", 0, factory, server_config(cert))
    conn, handler = await dial(other, client_config(cert, client))
    await within(factory.first)
    other.close(0x10, "shutting down")
    assert (await within(handler.lost))[0] == 0x10
    await within(other.wait_closed())
    assert other.connections == frozenset() and conn.is_closed


@needs_aiopquic
@pytest.mark.parametrize("client", ["aiopquic", "aioquic"])
async def test_client_without_datagram_is_closed_by_server(cert, closing, client) -> None:
    factory = Factory()
    server = await serve("127.0.0.1", 0, factory, server_config(cert))
    closing.append(server)
    handler = Recorder()
    conn = await within(connect(f"moqt://127.0.0.1:{server.port}", lambda: handler,
                                client_config(cert, client, datagrams=False)))
    assert (await within(handler.lost))[0] == 0x3
    assert conn.close_info is not None and not conn.close_info.local
    await within(conn.wait_closed())
    assert factory.made == []


@needs_aiopquic
async def test_server_told_not_to_advertise_datagram_still_answers_it(cert, closing) -> None:
    """The documented gap (docs/transport.md, "aiopquic"): a picoquic server answers a
    client's max_datagram_frame_size with its own, so ``datagrams=False`` cannot refuse it."""
    server = await serve("127.0.0.1", 0, Factory(), server_config(cert, datagrams=False))
    closing.append(server)
    conn, _ = await dial(server, client_config(cert, "aioquic"))
    assert conn.max_datagram_payload > 0
    await within(conn.aclose())


@needs_aiopquic
async def test_tls_failures_detected_by_picoquic(cert, closing, tmp_path) -> None:
    server = await serve("127.0.0.1", 0, Factory(), server_config(cert))
    closing.append(server)
    url = f"moqt://localhost:{server.port}/"
    for config in (TransportConfig(backend="aiopquic"),  # certifi's roots
                   TransportConfig(backend="aiopquic", ca_data=make_self_signed().cert_pem),
                   TransportConfig(backend="aiopquic", ca_data=cert.cert_pem,
                                   server_name="example.com")):
        with pytest.raises(ConnectError, match="TLS") as info:
            await within(connect(url, Recorder, config))
        assert info.value.error_code is None  # picoquic reports none for its own failure
    cert_file, _ = cert.write_to_dir(tmp_path)
    other_file, _ = make_self_signed().write_to_dir(tmp_path / "other")
    for config in (TransportConfig(backend="aiopquic", insecure=True),
                   TransportConfig(backend="aiopquic", ca_file=cert_file),
                   TransportConfig(backend="aiopquic", ca_file=other_file,
                                   ca_data=cert.cert_pem)):  # one bundle from both
        conn = await within(connect(url, Recorder, config))
        await within(conn.aclose())


@needs_aiopquic
async def test_server_certificate_files_and_port_zero(cert, closing, tmp_path) -> None:
    cert_file, key_file = cert.write_to_dir(tmp_path)
    config = TransportConfig(backend="aiopquic", certificate_file=cert_file,
                             private_key_file=key_file)
    first = await serve("127.0.0.1", 0, Recorder, config)
    closing.append(first)
    second = await serve("127.0.0.1", 0, Recorder, config)
    closing.append(second)
    assert first.address[0] == "127.0.0.1" and 0 < first.port != second.port > 0
    for server in (first, second):
        conn = await within(connect(f"moqt://localhost:{server.port}/", Recorder,
                                    TransportConfig(backend="aiopquic", ca_file=cert_file)))
        await within(conn.aclose())


@needs_aiopquic
async def test_congestion_control_names(cert, closing) -> None:
    with pytest.raises(ValueError, match="congestion"):
        await connect("moqt://127.0.0.1:1", Recorder, TransportConfig(
            backend="aiopquic", congestion_control_algorithm="nope"))
    with pytest.raises(ValueError, match="congestion"):
        await serve("127.0.0.1", 0, Recorder, server_config(
            cert, congestion_control_algorithm="nope"))
    server = await serve("127.0.0.1", 0, Recorder, server_config(
        cert, congestion_control_algorithm="cubic"))
    closing.append(server)
    conn, _ = await dial(server, client_config(cert, congestion_control_algorithm="newreno"))
    await within(conn.aclose())


@needs_aiopquic
@pytest.mark.parametrize("size", [1200, 16384])
async def test_datagram_ceiling_whatever_the_packet_size(cert, closing, size) -> None:
    """picoquic sizes packets itself; ``max_datagram_size`` only bounds the datagram
    payload, within aiopquic's 1200-octet ceiling. Streams work at any setting."""
    factory = Factory()
    server = await serve("127.0.0.1", 0, factory, server_config(cert, max_datagram_size=size))
    closing.append(server)
    conn, handler = await dial(server, client_config(cert, max_datagram_size=size))
    peer = await within(factory.first)
    assert peer.conn is not None
    biggest = conn.max_datagram_payload
    assert biggest == (1156 if size == 1200 else 1200)  # 1200 - 44 octets of overhead
    for sender, receiver in ((conn, peer), (peer.conn, handler)):
        gram = os.urandom(biggest)
        sender.send_datagram(gram)
        assert await within(receiver.datagrams.get()) == gram
        with pytest.raises(ValueError, match="max_datagram_payload"):
            sender.send_datagram(bytes(biggest + 1))
    body = os.urandom(2 * MiB)
    sid = conn.open_uni()
    await within(conn.write(sid, body, end_stream=True))
    assert await within(peer.done(sid)) == body
    await within(conn.aclose())


@needs_aiopquic
async def test_sends_larger_than_the_ring_are_queued(cert, closing) -> None:
    """A 64 KiB stream ring: one 3 MiB send() is queued in front of it and fed in as the
    network thread drains it; thousands of tiny sends (one ring command each) too."""
    factory = Factory()
    server = await serve("127.0.0.1", 0, factory, server_config(cert))
    closing.append(server)
    conn, _ = await dial(server, client_config(cert, extra={"stream_ring_cap": 65536}))
    big = os.urandom(3 * MiB)
    sid = conn.open_uni()
    conn.send(sid, memoryview(big), end_stream=True)
    assert conn.stream_send_buffered(sid) > 65536  # the ring holds at most 64 KiB
    peer = await within(factory.first)
    assert await within(peer.done(sid)) == big
    await within(conn.wait_writable(sid, 0))
    assert conn.stream_send_buffered(sid) == 0
    tiny = conn.open_uni()
    pieces = [os.urandom(7) for _ in range(20000)]
    for piece in pieces:
        conn.send(tiny, piece)
    conn.send(tiny, b"", end_stream=True)
    assert await within(peer.done(tiny)) == b"".join(pieces)
    await within(conn.aclose())


@needs_aiopquic
async def test_finished_stream_counts_its_fin_until_acknowledged(cert, closing) -> None:
    factory = Factory()
    server = await serve("127.0.0.1", 0, factory, server_config(cert))
    closing.append(server)
    conn, _ = await dial(server, client_config(cert))
    sid = conn.open_uni()
    conn.send(sid, b"last words", end_stream=True)
    assert conn.stream_send_buffered(sid) >= 1
    with pytest.raises(StreamClosedError) as info:
        conn.send(sid, b"more")
    assert info.value.error_code is None
    await within(conn.wait_writable(sid, 0))  # picoquic released it: acknowledged
    assert conn.stream_send_buffered(sid) == 0
    peer = await within(factory.first)
    assert await within(peer.done(sid)) == b"last words"
    await within(conn.ping())
    await within(conn.drain())
    await within(conn.aclose())


@needs_aiopquic
async def test_hostile_datagrams_at_both_sockets(cert, closing) -> None:
    factory = Factory()
    server = await serve("127.0.0.1", 0, factory, server_config(cert))
    closing.append(server)
    conn, handler = await dial(server, client_config(cert))
    local = conn._quic.local_address()  # type: ignore[attr-defined]
    assert local is not None
    junk = [b"", b"\x00", os.urandom(20), os.urandom(1200), os.urandom(65000),
            b"\xc0\x0a\x0a\x0a\x0a" + os.urandom(1195),  # long header, unknown version
            b"\xc0\x00\x00\x00\x01\x08" + os.urandom(100),  # a v1 Initial, too short
            b"\xc0\x00\x00\x00\x01" + b"\xff" * 1300,  # v1, CID length 255: malformed
            b"\x40" + os.urandom(1300)]  # short header, unknown connection ID
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
        for port in (server.port, local[1]):
            for data in junk:
                attacker.sendto(data, ("127.0.0.1", port))
    peer = await within(factory.first)
    sid = conn.open_uni()
    body = os.urandom(256 * 1024)
    await within(conn.write(sid, body, end_stream=True))
    assert await within(peer.done(sid)) == body
    await within(conn.ping())
    second, _ = await dial(server, client_config(cert))
    assert not conn.is_closed and len(server.connections) == 2
    assert not handler.lost.done()
    await within(second.aclose())
    await within(conn.aclose())


@needs_aiopquic
@pytest.mark.parametrize("server_backend", ["aiopquic", "aioquic"])
async def test_idle_timeout_closes_quietly(cert, closing, server_backend) -> None:
    server = await serve("127.0.0.1", 0, Recorder, server_config(cert, server_backend))
    closing.append(server)
    conn, handler = await dial(server, client_config(cert, idle_timeout=0.3))
    assert await within(handler.lost) == (0, conn.close_info.reason)  # type: ignore[union-attr]
    info = await within(conn.wait_closed())
    assert info.local and not info.application and info.error_code == 0
    with pytest.raises(ConnectionClosedError):
        await conn.ping()


@needs_aiopquic
async def test_drain_then_close_loses_nothing(cert, closing) -> None:
    factory = Factory()
    server = await serve("127.0.0.1", 0, factory, server_config(cert))
    closing.append(server)
    conn, _ = await dial(server, client_config(cert))
    control = conn.open_bidi()  # never finished: counted until picoquic took its bytes
    conn.send(control, b"setup")
    streams = {conn.open_uni(): os.urandom(n) for n in (1, 1000, 2 * MiB)}
    for sid, body in streams.items():
        conn.send(sid, body, end_stream=True)
    await within(conn.drain())
    assert all(conn.stream_send_buffered(sid) == 0 for sid in [control, *streams])
    peer = await within(factory.first)
    got = {sid: hashlib.sha256(peer.data[sid]).digest() for sid in streams}
    assert got == {sid: hashlib.sha256(b).digest() for sid, b in streams.items()}
    assert bytes(peer.data[control]) == b"setup"
    await within(conn.aclose())
