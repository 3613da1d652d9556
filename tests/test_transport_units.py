"""kvsp_moq.transport pieces without a network: URLs, configuration, the TLS helper, the
interface's stream-ID helpers, and the event-loop helpers."""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess
import sys
import textwrap

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from kvsp_moq.moqt.version import SUPPORTED_ALPNS
from kvsp_moq.transport import (
    BACKENDS,
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
    available_backends,
    load_backend,
    uvloop_available,
)
from kvsp_moq.transport.config import BACKEND_ENV
from kvsp_moq.transport.tls import make_self_signed
from kvsp_moq.transport.udp import GSO_MAX_BYTES, GSO_MAX_SEGMENTS, _gso_runs

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
    ("wss://example.com/moq", "scheme"),
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
    assert config.low_water == config.send_buffer_high_water // 2


def test_backend_defaults_to_env_then_aioquic(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert TransportConfig().backend == "aioquic"
    monkeypatch.setenv(BACKEND_ENV, "")
    assert TransportConfig().backend == "aioquic"
    monkeypatch.setenv(BACKEND_ENV, "qh3")
    assert TransportConfig().backend == "qh3"
    assert TransportConfig(backend="aioquic").backend == "aioquic"  # the field wins
    monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match="backend"):
        TransportConfig()


def test_known_backends():
    from kvsp_moq.transport import native

    # native only where its extension is built (tests/test_transport_native.py)
    assert BACKENDS == ("aioquic", "qh3", *(("native",) if native.available() else ()))
    assert "aioquic" in available_backends()
    with pytest.raises(ValueError, match="unknown transport backend"):
        load_backend("quiche")


def test_missing_backend_package_is_named():
    """With qh3 made unimportable (sys.modules entry None, as Python does for a package that
    is not there), choosing it fails with an ImportError naming the package and the extra."""
    code = textwrap.dedent("""
        import asyncio, sys
        sys.modules["qh3"] = None
        from kvsp_moq.transport import (BackendUnavailableError, TransportConfig,
                                        available_backends, connect)
        assert "qh3" not in available_backends() and "aioquic" in available_backends()
        try:
            asyncio.run(connect("moqt://127.0.0.1:1", object, TransportConfig(backend="qh3")))
        except BackendUnavailableError as exc:
            assert isinstance(exc, ImportError) and exc.package == "qh3"
            print(exc)
        else:
            raise SystemExit("no error")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'qh3'" in out.stdout and "kvsp-moq[qh3]" in out.stdout


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
    leaf, ca = x509.load_pem_x509_certificates(pair.cert_pem)
    assert pair.certificate == leaf and pair.ca_certificate == ca
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    assert leaf.public_key().curve.name == "secp256r1"
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    # A leaf for TLS servers signed by a CA without a TLS usage: the shape strict verifiers
    # (webpki, qh3) want.
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert leaf.issuer == ca.subject and ca.issuer == ca.subject
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    with pytest.raises(x509.ExtensionNotFound):
        ca.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    leaf.verify_directly_issued_by(ca)
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
    for name in ("api.py", "config.py", "url.py", "tls.py", "loop.py", "__init__.py",
                 "library.py", "engine.py", "endpoints.py", "udp.py", "connection_core.py",
                 "server_core.py"):
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


# ------------------------------------------------------------------------------------------
# GSO batching (udp.py)


def _runs(packets):
    return [([len(d) for d in run], addr, size) for run, addr, size in _gso_runs(packets)]


def test_gso_runs_group_same_address_and_size():
    a, b = ("127.0.0.1", 1), ("127.0.0.1", 2)
    packets = [(bytes(1200), a)] * 3 + [(bytes(500), a), (bytes(1200), a), (bytes(1200), b)]
    # udp(7): every segment has the run's size except a shorter last one, which ends the run.
    assert _runs(packets) == [([1200, 1200, 1200, 500], a, 1200), ([1200], a, 1200),
                              ([1200], b, 1200)]
    # A longer packet never joins a run of shorter ones.
    assert _runs([(bytes(100), a), (bytes(1200), a)]) == [([100], a, 100), ([1200], a, 1200)]


def test_gso_runs_respect_kernel_limits():
    a = ("::1", 1, 0, 0)
    runs = _runs([(bytes(1000), a)] * 200)
    assert all(len(sizes) <= GSO_MAX_SEGMENTS and sum(sizes) <= GSO_MAX_BYTES
               for sizes, _, _ in runs)
    assert sum(len(sizes) for sizes, _, _ in runs) == 200
    assert _runs([(bytes(16384), a)] * 5) == [([16384] * 3, a, 16384), ([16384] * 2, a, 16384)]
    assert _runs([]) == []


def test_aioquic_refuses_packets_its_frame_lengths_cannot_describe():
    """aioquic 1.7.2 writes STREAM/CRYPTO frame lengths in two octets (RFC 9000 §16: at most
    16383): larger packets would corrupt frames, so the configuration is refused up front."""
    from kvsp_moq.transport.aioquic_backend import LIBRARY, MAX_DATAGRAM_SIZE

    ok = LIBRARY.configuration(TransportConfig(backend="aioquic",
                                               max_datagram_size=MAX_DATAGRAM_SIZE),
                               is_client=True)
    assert ok.max_datagram_size == MAX_DATAGRAM_SIZE
    with pytest.raises(ValueError, match="over what aioquic sends correctly"):
        LIBRARY.configuration(TransportConfig(backend="aioquic",
                                              max_datagram_size=MAX_DATAGRAM_SIZE + 1),
                              is_client=True)
