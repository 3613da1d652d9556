"""Credentials never cross unverified TLS (issue 18; docs/security.md "TLS and tokens").

Real servers on loopback throughout: an Index Service served over HTTPS with a CA made for the
test, a MOQT server with a certificate nobody trusts, and plain TCP / UDP listeners on a
non-loopback address of this host that record whether anything arrived at all.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvsp_moq.bridge import MoqtPool
from kvsp_moq.control.client.http import HttpBlockFetcher, HttpIndexClient, HttpPcClient, PlainHttpRefused
from kvsp_moq.control.client.publisher import IndexUnreachable
from kvsp_moq.control.common.auth import Authorizer, Principal
from kvsp_moq.control.common.config import ControlConfig, IndexConfig, config_from_mapping
from kvsp_moq.control.common.engine_config import EngineConfig
from kvsp_moq.control.common.errors import ConfigError
from kvsp_moq.control.common.tls import TlsConfig, is_loopback_url
from kvsp_moq.control.engine.setup import engine_transport
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.pubsub import Catalog, MoqtServer, connect, serve
from kvsp_moq.storage import RecordKey
from kvsp_moq.transport import ConnectError, TransportConfig
from kvsp_moq.transport.tls import InsecureCredentialsError, check_credentials, is_loopback_host, make_self_signed
from test_instance_support import COMPAT, DESCRIPTOR, SCOPE_A, bkey, record_for


GUARD = 20.0  # seconds: every wait on a peer is bounded
TOKEN = "tls-test-token-0123456789abcdef"


async def within(aw, timeout: float = GUARD):  # noqa: ANN001, ANN201
    return await asyncio.wait_for(aw, timeout)


def _non_loopback_ip() -> str | None:
    """An address of this host that is not loopback (the source address of a route out)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent by a UDP connect
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


@pytest.fixture(scope="module")
def remote_ip() -> str:
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    return ip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    made = make_self_signed(common_name="kvsp tls test")
    cert, key = made.write(d / "server.crt", d / "server.key")
    (d / "ca.pem").write_bytes(made.ca_pem)
    return {"cert": cert, "key": key, "ca": d / "ca.pem"}


def _record(n: int) -> ReplicaRecord:
    return record_for(n, "https://h1.example/kvsp/")


def _key(n: int) -> RecordKey:
    return RecordKey(COMPAT, SCOPE_A, bkey(n))


@pytest.fixture
async def https_index(pki: dict[str, Path]) -> AsyncIterator[str]:
    """A real Index Service served over HTTPS with the test CA's certificate."""
    auth = Authorizer.from_tokens({TOKEN: Principal("tester", scopes=_all(), holders=_all(), instances=_all())})
    tls = TlsConfig(cert=str(pki["cert"]), key=str(pki["key"]))
    server = await serve_index(ControlConfig(auth=auth, index=IndexConfig(purge_interval_ms=0, descriptors=(DESCRIPTOR,)), tls=tls))
    async with server:
        assert server.url.startswith("https://127.0.0.1:")
        yield server.url


def _all():  # noqa: ANN202
    from kvsp_moq.control.common.auth import Grant

    return Grant(everything=True)


# -- HTTPS roles ---------------------------------------------------------------------------------


async def test_https_role_verified_with_the_ca_and_refused_without(https_index: str, pki: dict[str, Path]) -> None:
    """A role served over HTTPS: a client with the CA file publishes and reads back; a client
    trusting only the system store fails certificate verification, and the server never saw
    its request (the record it tried to publish does not exist)."""
    trusted = HttpIndexClient(https_index, TOKEN, tls=TlsConfig(ca_file=str(pki["ca"])))
    untrusted = HttpIndexClient(https_index, TOKEN)  # default: verified, system trust store
    try:
        stored = await within(trusted.publish(_record(1)))
        assert stored.block_key == _record(1).block_key
        with pytest.raises(IndexUnreachable) as info:
            await within(untrusted.publish(_record(2)))
        assert isinstance(info.value.__cause__, aiohttp.ClientConnectorCertificateError)
        assert await within(trusted.replicas(_key(2))) == []  # never reached the IS
        assert len(await within(trusted.replicas(_key(1)))) == 1
    finally:
        await trusted.close()
        await untrusted.close()


async def test_https_server_refuses_tls_below_1_2(https_index: str, pki: dict[str, Path]) -> None:
    """The server context's floor is TLS 1.2: a client offering only TLS 1.1 gets no session
    (skipped where this OpenSSL cannot even offer 1.1, since then it proves nothing)."""
    port = int(https_index.split(":")[2].split("/")[0])
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    try:
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
        ctx.minimum_version = ssl.TLSVersion.TLSv1_1
        ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    except (ValueError, ssl.SSLError):
        pytest.skip("this OpenSSL cannot offer TLS 1.1")
    if not ssl.HAS_TLSv1_1:
        pytest.skip("this OpenSSL has no TLS 1.1")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        reader, writer = await within(asyncio.open_connection("127.0.0.1", port, ssl=ctx))
        writer.close()
    # The same client with TLS 1.2 allowed gets through: the refusal was the version.
    ok = ssl.create_default_context(cafile=str(pki["ca"]))
    reader, writer = await within(asyncio.open_connection("127.0.0.1", port, ssl=ok))
    assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
    writer.close()


def test_tls_section_of_a_config_file(tmp_path: Path, pki: dict[str, Path]) -> None:
    """[tls] paths are relative to the file; a half pair, an unknown key or a missing CA file
    is a ConfigError naming the key."""
    for name in ("server.crt", "server.key", "ca.pem"):
        (tmp_path / name).write_bytes((pki["cert"].parent / name).read_bytes())
    cfg = config_from_mapping({"tls": {"cert": "server.crt", "key": "server.key", "ca_file": "ca.pem"}},
                              base_dir=tmp_path)
    assert cfg.tls.cert == str(tmp_path / "server.crt") and cfg.tls.server_ssl_context() is not None
    assert cfg.tls.client_ssl.verify_mode == ssl.CERT_REQUIRED and cfg.tls.client_ssl.check_hostname
    for section, key in (({"cert": "server.crt"}, "tls.key"), ({"ca_file": "nope.pem"}, "tls.ca_file"),
                         ({"verify": True}, "tls.verify"), ({"insecure": "yes"}, "tls.insecure"),
                         ({"cert": "ca.pem", "key": "ca.pem"}, "tls.cert")):
        with pytest.raises(ConfigError) as info:
            config_from_mapping({"tls": section}, base_dir=tmp_path)
        assert info.value.key == key, section


# -- tokens and plain HTTP -----------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/", "http://127.8.9.10/", "http://localhost:8080/",
                                 "http://[::1]:9/", "https://is.example/"])
def test_tokens_to_loopback_or_https_are_allowed(url: str) -> None:
    assert TlsConfig().token_url_allowed(url)
    cfg = config_from_mapping({"holder": {"index_url": url, "index_token": TOKEN}})
    assert cfg.holder.index_url == url
    HttpIndexClient(url, TOKEN)  # no error at construction


@pytest.mark.parametrize(("doc", "key"), [
    ({"holder": {"index_url": "http://is.example/", "index_token": TOKEN}}, "holder.index_url"),
    ({"pc": {"index_url": "http://10.1.2.3/", "index_token": TOKEN}}, "pc.index_url"),
    ({"instance": {"index_url": "http://is.example/", "token": TOKEN}}, "instance.index_url"),
    ({"instance": {"pc_url": "http://127.0.0.1:1/", "pc_urls": ["http://pc2.example/"], "token": TOKEN}},
     "instance.pc_urls"),
    ({"frontend": {"pc_url": "http://pc.example/", "pc_token": TOKEN}}, "frontend.pc_url"),
    ({"instance": {"token": TOKEN, "engine": {"holder_url": "http://h1.example/"}}}, "instance.engine.holder_url"),
])
def test_tokens_to_plain_http_elsewhere_are_refused_at_config_time(doc: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(doc)
    assert info.value.key == key and "allow_plain_http" in str(info.value)
    # The explicit opt-in lets it through, and without a token there is nothing to protect.
    config_from_mapping({**doc, "tls": {"allow_plain_http": True}})


def test_clients_with_a_base_url_refuse_at_construction() -> None:
    with pytest.raises(ConfigError) as info:
        HttpIndexClient("http://is.example/", TOKEN)
    assert info.value.key == "index_url"
    with pytest.raises(ConfigError) as info:
        HttpPcClient(["http://127.0.0.1:1/", "http://pc.example/"], TOKEN)
    assert info.value.key == "pc_url"
    HttpIndexClient("http://is.example/", None)  # no token: nothing to protect
    HttpIndexClient("http://is.example/", TOKEN, tls=TlsConfig(allow_plain_http=True))


@pytest.fixture
async def tcp_listener(remote_ip: str) -> AsyncIterator[tuple[str, int, asyncio.Queue[bytes]]]:
    """A TCP server on a non-loopback address; every connection's first bytes are queued."""
    seen: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.put_nowait(await reader.read(4096))
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_conn, remote_ip, 0)
    async with server:
        yield remote_ip, server.sockets[0].getsockname()[1], seen


async def test_per_request_urls_refuse_plain_http_before_connecting(tcp_listener) -> None:  # noqa: ANN001
    """A holder URL from a record (not configured): the fetcher raises PlainHttpRefused (an
    aiohttp.ClientError, so retrieval tries the next replica) and nothing reaches the host;
    with allow_plain_http the same request arrives, token and all."""
    ip, port, seen = tcp_listener
    url = f"http://{ip}:{port}/blocks/x"
    fetcher = HttpBlockFetcher(TOKEN)
    try:
        with pytest.raises(PlainHttpRefused):
            async with fetcher.get(url):
                pass
    finally:
        await fetcher.close()
    allowed = HttpBlockFetcher(TOKEN, tls=TlsConfig(allow_plain_http=True))
    try:
        async with allowed.get(url) as resp:
            assert resp.status == 404
    finally:
        await allowed.close()
    first = await within(seen.get())
    assert f"Bearer {TOKEN}".encode() in first
    assert seen.empty()  # the refused request never connected


# -- MOQT ----------------------------------------------------------------------------------------


@pytest.fixture
async def untrusted_moqt() -> AsyncIterator[tuple[str, MoqtServer]]:
    """A MOQT server on loopback with a certificate no trust store holds."""
    made = make_self_signed()
    config = TransportConfig(certificate_pem=made.cert_pem, private_key_pem=made.key_pem)
    server = await serve("127.0.0.1", 0, config, catalog=Catalog())
    try:
        yield f"moqt://127.0.0.1:{server.port}/moq", server
    finally:
        server.close()
        await server.wait_closed()


async def test_pool_verifies_by_default(untrusted_moqt) -> None:  # noqa: ANN001
    """MoqtPool() (the bridge's default, as the engine's pool and the holder's relay link)
    refuses a certificate it cannot verify: no SETUP, so no token, reaches the server."""
    url, server = untrusted_moqt
    assert TransportConfig().insecure is False
    async with MoqtPool(connect_timeout=5.0, setup_tokens=[TOKEN]) as pool:
        with pytest.raises(ConnectError, match="certificate"):
            await within(pool.get(url))
    assert not any(s.ready.done() for s in server.sessions)  # no SETUP (which carries the token) arrived
    # The explicit opt-in (loopback) connects: the refusal above was verification.
    async with MoqtPool(TransportConfig(insecure=True), setup_tokens=[TOKEN]) as pool:
        session = await within(pool.get(url))
        assert session.version is not None
        assert any(s.ready.done() for s in server.sessions)


async def test_pool_with_the_ca_file_verifies(pki: dict[str, Path]) -> None:
    config = TransportConfig(certificate_file=pki["cert"], private_key_file=pki["key"])
    server = await serve("127.0.0.1", 0, config, catalog=Catalog())
    try:
        url = f"moqt://127.0.0.1:{server.port}/moq"
        async with MoqtPool(TlsConfig(ca_file=str(pki["ca"])).transport(), setup_tokens=[TOKEN]) as pool:
            assert (await within(pool.get(url))).version is not None
        async with MoqtPool(connect_timeout=5.0) as pool:  # system store: the test CA is unknown
            with pytest.raises(ConnectError, match="certificate"):
                await within(pool.get(url))
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def udp_listener(remote_ip: str) -> AsyncIterator[tuple[str, int, asyncio.Event]]:
    """A UDP socket on a non-loopback address; the event is set by the first datagram."""
    got = asyncio.Event()

    class Proto(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            got.set()

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Proto, local_addr=(remote_ip, 0))
    try:
        yield remote_ip, transport.get_extra_info("sockname")[1], got
    finally:
        transport.close()


async def test_insecure_moqt_with_tokens_to_a_remote_host_is_refused(udp_listener) -> None:  # noqa: ANN001
    """connect(insecure, tokens) to a non-loopback host raises InsecureCredentialsError before
    a packet leaves; with allow_insecure_remote the Initial does arrive."""
    ip, port, got = udp_listener
    url = f"moqt://{ip}:{port}/moq"
    insecure = TransportConfig(insecure=True, handshake_timeout=1.0)
    with pytest.raises(InsecureCredentialsError):
        await within(connect(url, insecure, setup_tokens=[TOKEN]))
    async with MoqtPool(insecure, setup_tokens=[TOKEN], connect_timeout=1.0) as pool:
        with pytest.raises(InsecureCredentialsError):  # a ConnectionError: a load tries the next source
            await within(pool.get(url))
    assert not got.is_set()
    attempt = asyncio.ensure_future(connect(url, insecure.replace(allow_insecure_remote=True), setup_tokens=[TOKEN]))
    try:
        await within(got.wait())  # the opt-in: the handshake was sent (nobody answers it)
    finally:
        attempt.cancel()
        await asyncio.gather(attempt, return_exceptions=True)


def test_check_credentials_rules(caplog: pytest.LogCaptureFixture) -> None:
    """Verified: always fine. Insecure: loopback fine (warned once), remote refused."""
    check_credentials("moqt://relay.example/moq", TransportConfig())
    with caplog.at_level(logging.WARNING, "kvsp_moq.transport.tls"):
        check_credentials("moqt://127.0.0.1:4443/moq", TransportConfig(insecure=True), purpose="unit-test-a")
        check_credentials("moqt://[::1]:4443/moq", TransportConfig(insecure=True), purpose="unit-test-a")
    warnings = [r for r in caplog.records if "TLS verification disabled for unit-test-a" in r.getMessage()]
    assert len(warnings) == 1 and "tokens may be harvested" in warnings[0].getMessage()
    with pytest.raises(InsecureCredentialsError):
        check_credentials("moqt://relay.example/moq", TransportConfig(insecure=True))
    assert all(is_loopback_host(h) for h in ("localhost", "LOCALHOST.", "127.0.0.1", "127.255.0.3", "::1", "[::1]"))
    assert not any(is_loopback_host(h) for h in ("localhost.example", "10.0.0.1", "::2", "128.0.0.1"))
    assert is_loopback_url("http://127.0.0.1:8/") and not is_loopback_url("http://[::2]/")


def test_engine_tls_defaults_verify_and_insecure_remote_relay_is_refused(tmp_path: Path) -> None:
    """[instance.engine]: verified by default ([tls] ca_file inherited); verify_tls is gone;
    insecure with a token to a non-loopback relay fails at config time unless opted in."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(make_self_signed().ca_pem)
    t = engine_transport(EngineConfig(), TlsConfig(ca_file=str(ca)))
    assert t.insecure is False and t.ca_file == str(ca)
    assert engine_transport(EngineConfig(ca_file="own.pem"), TlsConfig(ca_file=str(ca))).ca_file == "own.pem"
    assert engine_transport(EngineConfig(), TlsConfig(insecure=True)).insecure is True
    assert engine_transport(EngineConfig(insecure=False), TlsConfig(insecure=True)).insecure is False
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"instance": {"engine": {"verify_tls": False}}})
    assert info.value.key == "instance.engine.verify_tls"
    remote = {"instance": {"token": TOKEN, "engine": {"relay_url": "moqt://relay.example:4443/moq", "insecure": True}}}
    with pytest.raises(ConfigError) as info:
        config_from_mapping(remote)
    assert info.value.key == "instance.engine.relay_url"
    config_from_mapping({**remote, "tls": {"allow_insecure_remote": True}})
    config_from_mapping({"instance": {"token": TOKEN, "engine": {"relay_url": "moqt://127.0.0.1:4443/moq",
                                                                  "insecure": True}}})

