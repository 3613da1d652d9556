"""Backend matrix for the transport tests: every test of a module that imports ``pairing``
runs once per (client backend, server backend) pair of the installed QUIC libraries — each
library with itself, and aioquic against qh3 in both directions.

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

#: An aioquic client against a qh3 server: about one handshake in five completes only after
#: ~1.4 s and about one in 500-700 stalls until the handshake timeout (the qh3 server's core
#: fails "packet builder capacity exhausted"; docs/transport.md "Known gaps"). Only these
#: tests run on that pairing, so the suite stays reliable while the pairing stays covered.
STALLING_PAIR = ("aioquic", "qh3")
STALLING_PAIR_TESTS = frozenset({
    "test_handshake_with_each_alpn", "test_bidi_echo", "test_datagrams_both_ways",
})


def _pair_id(pair: tuple[str, str]) -> str:
    client, server = pair
    return client if client == server else f"{client}-to-{server}"


@pytest.fixture(params=PAIRS, ids=[_pair_id(p) for p in PAIRS], autouse=True)
def pairing(request: pytest.FixtureRequest,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    client, server = request.param
    if (client, server) == STALLING_PAIR and request.node.originalname not in STALLING_PAIR_TESTS:
        pytest.skip("aioquic client -> qh3 server handshakes can stall (docs/transport.md, Known gaps); "
                    "covered by the handshake, echo and datagram tests only")
    monkeypatch.setenv(BACKEND_ENV, client)
    _current.update(client=client, server=server)
    yield client, server


def server_backend() -> str:
    return _current["server"]


def client_backend() -> str:
    return _current["client"]
