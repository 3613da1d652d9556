"""Backend matrix for the transport tests: every test of a module that imports ``pairing``
runs once per (client backend, server backend) pair of the installed QUIC libraries — each
library with itself, and every other pair in both directions.

``TransportConfig()`` takes its default backend from ``$KVSP_QUIC_BACKEND``; the fixture sets
it to the client's backend, and :func:`server_backend` tells the helpers what the server runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsp_moq.transport import available_backends
from kvsp_moq.transport.config import BACKEND_ENV

INSTALLED = available_backends()
PAIRS = [(b, b) for b in INSTALLED] + [
    (c, s) for c in INSTALLED for s in INSTALLED if c != s]

_current: dict[str, str] = {"client": "aioquic", "server": "aioquic"}

#: Tests that cannot pass where aiopquic (picoquic) is on one end (docs/transport.md,
#: "aiopquic"): test name -> (the end that matters: "client", "server" or "any", why).
#: tests/test_transport_aiopquic.py checks what these leave out that aiopquic can do.
_NO_REASON = "picoquic neither sends a CONNECTION_CLOSE reason phrase nor reports the peer's"
AIOPQUIC_SKIPS: dict[str, tuple[str, str]] = {
    "test_close_code_and_reason_reach_the_peer": ("any", _NO_REASON),
    "test_long_close_reason_is_truncated_not_lost": ("any", _NO_REASON),
    "test_server_close_closes_its_connections": ("any", _NO_REASON),
    "test_handler_exception_closes_with_internal_error": ("any", _NO_REASON),
    "test_client_without_datagram_is_closed_by_server": ("any", _NO_REASON),
    "test_large_max_datagram_size": ("any", "picoquic sizes its packets itself (path-MTU "
                                     "discovery) and caps datagrams at 1200"),
    "test_server_without_datagram_is_refused_by_client": ("server", "a picoquic server "
                                                          "answers a client's DATAGRAM "
                                                          "parameter with its own"),
    "test_untrusted_cert_fails_unless_insecure": ("client", "picoquic reports no error code "
                                                  "for a TLS failure it detected itself"),
    "test_bad_congestion_control_name_is_rejected": ("client", "'bbr' is a picoquic "
                                                     "controller"),
    "test_gso_gro_on_and_off_carry_the_same_bytes": ("any", "picoquic does its own UDP I/O "
                                                     "(no engine UdpEndpoint counters)"),
    "test_hostile_datagrams_do_not_disturb": ("client", "reads the engine client's UdpEndpoint"),
    "test_uvloop_bulk_transfer_does_not_spin_on_pacing_timers": ("client", "counts the "
                                                                 "engine's timer callbacks"),
}


#: The same for the native backend (ngtcp2 0.12 in our C extension; docs/transport.md,
#: "native"). tests/test_transport_native.py checks what these leave out.
_ENGINE_UDP = ("the extension does its own UDP I/O: there is no engine UdpEndpoint (conn.udp) "
               "whose counters or socket the test reads")
_NO_QLOG = "the extension writes no qlog (qlog_dir is refused with ValueError)"
NATIVE_SKIPS: dict[str, tuple[str, str]] = {
    "test_gso_gro_on_and_off_carry_the_same_bytes": ("any", _ENGINE_UDP),
    "test_hostile_datagrams_do_not_disturb": ("client", _ENGINE_UDP),
    "test_uvloop_bulk_transfer_does_not_spin_on_pacing_timers": ("client", "counts the "
                                                                 "engine's timer callbacks"),
    "test_qlog_one_file_per_connection_on_each_end": ("any", _NO_QLOG),
    "test_qlog_both_ends_in_one_directory_do_not_collide": ("any", _NO_QLOG),
    "test_stop_sending_propagates_and_wakes_writer": (
        "client", "ngtcp2 0.12 has no callback for a peer's STOP_SENDING: the stopped sender "
        "learns of it (and its code) only when the stream closes, and this bidirectional "
        "stream's other direction never ends (_ngtcp2.pyi, 'stop_sending')"),
}


def _skip_for(table: dict[str, tuple[str, str]], backend: str, name: str, client: str,
              server: str) -> str | None:
    side, why = table.get(name, ("", ""))
    ends = {"any": (client, server), "client": (client,), "server": (server,)}.get(side, ())
    return f"{backend}: {why}" if backend in ends else None


def _aiopquic_skip(name: str, client: str, server: str) -> str | None:
    return _skip_for(AIOPQUIC_SKIPS, "aiopquic", name, client, server)


def _native_skip(name: str, client: str, server: str) -> str | None:
    return _skip_for(NATIVE_SKIPS, "native", name, client, server)


def _pair_id(pair: tuple[str, str]) -> str:
    client, server = pair
    return client if client == server else f"{client}-to-{server}"


@pytest.fixture(params=PAIRS, ids=[_pair_id(p) for p in PAIRS], autouse=True)
def pairing(request: pytest.FixtureRequest,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    client, server = request.param
    name = request.node.originalname
    if (why := _aiopquic_skip(name, client, server) or _native_skip(name, client, server)):
        pytest.skip(why)
    monkeypatch.setenv(BACKEND_ENV, client)
    _current.update(client=client, server=server)
    yield client, server


def server_backend() -> str:
    return _current["server"]


def client_backend() -> str:
    return _current["client"]
