"""Interop with moq-rs 0.5.1 (moq-ffi 0.4.18, the moq-dev Rust stack; PyPI ``moq-rs``).

Both directions, our ALPN pinned per draft. Payloads are compared byte for byte (SHA-256 of
``interop/peer_scripts/payload.py``), with counts, PUBLISH_DONE and the negotiated version.
See docs/interop.md for the matrix and moq-rs's deviations.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from interop import peers
from interop.cases import GROUPS, OBJECTS, SIZE
from interop.testing import describe, expected_objects, peer_bin, run_case

pytestmark = pytest.mark.interop

@pytest.fixture(scope="module")
def moqrs() -> Path:
    return peer_bin(peers.MOQ_RS)


# Every case over raw QUIC (moqt://) and over WebTransport (https://: moq-rs's server and
# client speak both; docs/interop.md "WebTransport").
TRANSPORTS = pytest.mark.parametrize("transport", ["quic", "webtransport"])


@TRANSPORTS
@pytest.mark.parametrize("draft", [22, 20, 18])
def test_moqrs_server_publishes_to_our_client(moqrs: Path, tmp_path: Path, draft: int,
                                              transport: str) -> None:
    r = run_case("moqrs-pub", draft, moqrs, tmp_path, transport=transport)
    info = describe(r)
    assert r.get("version") == draft, info
    # moq-rs maps its broadcast path to a namespace split on "/".
    assert r["peer_publish_namespace"] == ["publish_namespace", ["kvsp", "interop", "moqrs"]], info
    assert r["error"] is None, info
    objs = r["objects"]
    normal = {(o["group"], o["object"]): o["sha256"] for o in objs if o["status"] == 0}
    assert normal == expected_objects(GROUPS, OBJECTS, SIZE), info
    assert all(o["len"] == SIZE for o in objs if o["status"] == 0), info
    # moq-rs ends the track with an END_OF_TRACK status object (0x4) in a group of its own.
    status = [(o["group"], o["object"], o["status"]) for o in objs if o["status"] != 0]
    assert status == [(GROUPS, 0, 4)], info
    assert r["publish_done"]["status"] == 0x2, info  # TRACK_ENDED
    assert r["publish_done"]["stream_count"] == r["data_streams"] == GROUPS + 1, info


def _check_peer_objects(r: dict) -> None:
    info = describe(r)
    events = r.get("peer_events") or []
    assert events and events[-1]["event"] == "end", info
    got = [(e["group"], e["object"], e["sha256"]) for e in events if e["event"] == "object"]
    want = expected_objects(GROUPS, OBJECTS, SIZE)
    assert len(got) == len(want), info
    assert {(g, o): h for g, o, h in got} == want, info
    assert all(e["len"] == SIZE for e in events if e["event"] == "object"), info


@TRANSPORTS
@pytest.mark.parametrize("draft", [22, 20, 18])
def test_moqrs_client_subscribes_to_our_server(moqrs: Path, tmp_path: Path, draft: int,
                                               transport: str) -> None:
    # Draft 22 uses our default ALPN list: moq-rs offers moq-lite first, then its IETF
    # versions newest first, and our server's preference picks moqt-22.
    alpn = "moqt-22,moqt-21,moqt-20,moqt-18" if draft == 22 else ""
    r = run_case("moqrs-sub", draft, moqrs, tmp_path, alpn=alpn, transport=transport)
    assert r.get("version") == draft, describe(r)
    _check_peer_objects(r)
