"""kvsp_moq.transport pieces without a network: URLs, configuration, the TLS helper, the
interface's stream-ID helpers, and the event-loop helpers."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from kvsp_moq.moqt.version import SUPPORTED_ALPNS
from kvsp_moq.transport import (
    DEFAULT_ALPNS,
    BaseConnectionHandler,
    ConnectionHandler,
    TransportConfig,
    is_bidirectional,
    is_client_initiated,
    is_locally_initiated,
    is_unidirectional,
    new_event_loop,
    parse_moqt_url,
    uvloop_available,
)
from kvsp_moq.transport.tls import make_self_signed

# ------------------------------------------------------------------------------------------
# URLs


def test_url_full():
    u = parse_moqt_url("moqt://relay.example.com:4443/moq/live?token=abc#track:x")
    assert (u.host, u.port, u.path, u.query, u.fragment) == (
        "relay.example.com", 4443, "/moq/live", "token=abc", "track:x")
    assert u.authority == "relay.example.com:4443"
    assert u.path_and_query == "/moq/live?token=abc"
    assert str(u) == "moqt://relay.example.com:4443/moq/live?token=abc#track:x"


def test_url_defaults():
    u = parse_moqt_url("moqt://Example.COM")
    assert (u.host, u.port, u.path, u.query, u.fragment) == ("example.com", 443, "", None, None)
    assert u.path_and_query == "" and u.authority == "Example.COM"
    assert parse_moqt_url("MOQT://h/").path == "/"
    assert parse_moqt_url("moqt://h/p?").query == ""  # an empty query is still a query


def test_url_ipv6_and_percent_encoding():
    u = parse_moqt_url("moqt://[::1]:9000/a%20b")
    assert (u.host, u.port, u.path, u.authority) == ("::1", 9000, "/a%20b", "[::1]:9000")
    assert parse_moqt_url("moqt://127.0.0.1:1/").host == "127.0.0.1"


@pytest.mark.parametrize("url, message", [
    ("https://example.com/moq", "scheme"),
    ("http://example.com", "scheme"),
    ("example.com:443", "scheme"),
    ("moqt:/example.com", "authority"),
    ("moqt:///path", "empty host"),
    ("moqt://:443/path", "empty host"),
    ("moqt://host:99999/", "invalid"),
    ("moqt://host:abc/", "invalid"),
    ("moqt://host:0/", "port 0"),
    ("moqt://host:/", "empty port"),
    ("moqt://ho st/", "whitespace"),
])
def test_url_rejects(url, message):
    with pytest.raises(ValueError, match=message):
        parse_moqt_url(url)


# ------------------------------------------------------------------------------------------
# configuration


def test_default_alpns_match_moqt_versions():
    assert DEFAULT_ALPNS == SUPPORTED_ALPNS == ("moqt-22", "moqt-21", "moqt-20", "moqt-18")
    config = TransportConfig()
    assert config.alpn_protocols == DEFAULT_ALPNS
    assert config.max_datagram_size == 1200 and config.datagrams
    assert config.backend == "aioquic"
    assert config.low_water == config.send_buffer_high_water // 2


@pytest.mark.parametrize("changes, message", [
    ({"backend": "quiche"}, "backend"),
    ({"alpn_protocols": "moqt-22"}, "sequence"),
    ({"alpn_protocols": []}, "empty"),
    ({"alpn_protocols": [""]}, "ALPN"),
    ({"max_datagram_size": 1199}, "max_datagram_size"),
    ({"max_datagram_size": 70000}, "max_datagram_size"),
    ({"max_stream_data": 0}, "max_stream_data"),
    ({"send_buffer_high_water": 10, "send_buffer_low_water": 20}, "low_water"),
    ({"idle_timeout": 0}, "positive"),
    ({"certificate_pem": b"x"}, "together"),
])
def test_config_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        TransportConfig(**changes)


def test_config_replace_validates():
    config = TransportConfig(max_datagram_size=16384)
    assert config.replace(max_datagram_size=1452).max_datagram_size == 1452
    with pytest.raises(ValueError):
        config.replace(max_datagram_size=100)


# ------------------------------------------------------------------------------------------
# TLS helper


def test_self_signed_cert_contents():
    pair = make_self_signed()
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert cert.issuer == cert.subject
    assert b"PRIVATE KEY" in pair.key_pem


def test_self_signed_cert_custom_names(tmp_path):
    pair = make_self_signed(["kv.internal"], ["10.0.0.7"], days=1)
    san = pair.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["kv.internal"]
    cert_path, key_path = pair.write(tmp_path / "c.pem", tmp_path / "k.pem")
    assert cert_path.read_bytes() == pair.cert_pem and key_path.read_bytes() == pair.key_pem
    with pytest.raises(ValueError):
        make_self_signed([], [])


# ------------------------------------------------------------------------------------------
# interface helpers


def test_stream_id_helpers():
    # RFC 9000 §2.1: 0 client bidi, 1 server bidi, 2 client uni, 3 server uni.
    assert [is_client_initiated(i) for i in range(4)] == [True, False, True, False]
    assert [is_unidirectional(i) for i in range(4)] == [False, False, True, True]
    assert [is_bidirectional(i) for i in range(4)] == [True, True, False, False]
    assert is_locally_initiated(6, is_client=True) and not is_locally_initiated(7, True)
    assert is_locally_initiated(7, is_client=False)


def test_base_handler_satisfies_the_protocol():
    assert isinstance(BaseConnectionHandler(), ConnectionHandler)


def test_api_module_imports_no_quic_library():
    import ast
    from pathlib import Path

    import kvsp_moq.transport as pkg
    root = Path(pkg.__file__).parent
    for name in ("api.py", "config.py", "url.py", "tls.py", "loop.py", "__init__.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            else:
                continue
            assert not any(m.split(".")[0] in {"aioquic", "qh3", "aiopquic"} for m in mods), name


def test_new_event_loop_respects_choice():
    loop = new_event_loop(use_uvloop=False)
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()
    loop = new_event_loop(config=TransportConfig(use_uvloop=True))
    try:
        assert ("uvloop" in type(loop).__module__) == uvloop_available()
    finally:
        loop.close()
    # Nothing was installed globally.
    assert not type(asyncio.get_event_loop_policy()).__module__.startswith("uvloop")
