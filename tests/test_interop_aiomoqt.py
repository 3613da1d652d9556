"""Interop with aiomoqt 0.13.3 (Python on aiopquic/picoquic; needs Python >= 3.12), on drafts
22, 20 and 18: its subscriber example and client API against our server; its publisher example
against our server (xfail: we refuse PUBLISH) and, through aiomoqt's own relay, to our client;
``moq-pub-server`` against our client.

aiomoqt's servers ignore the bind address, so ``moq-pub-server`` runs only inside
``unshare -n`` with loopback only, and our client with it in the same namespace. The client-only
cases use the namespace too where it is available. See docs/interop.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from interop import peers
from interop.cases import GROUPS, OBJECTS, PUB_EXAMPLE_GROUP, RELAY_OBJECTS, SIZE, TRACK, ns_of
from interop.testing import (aiomoqt_counted, describe, expected_objects, peer_bin,
                             run_case, sha256)

pytestmark = pytest.mark.interop

DRAFTS = [22, 20, 18]
ISOLATE = peers.can_isolate()
# (draft, transport): every draft over raw QUIC, and over WebTransport on draft 22 (the
# WebTransport matrix, tests/test_interop_wt.py, covers aiomoqt on every draft).
CELLS = pytest.mark.parametrize(("draft", "transport"),
                                [(d, "quic") for d in DRAFTS] + [(22, "webtransport")])


@pytest.fixture(scope="module")
def aiomoqt() -> Path:
    return peer_bin(peers.AIOMOQT)


def _needs_isolation() -> None:
    if not ISOLATE:
        pytest.skip("LOUD SKIP: aiomoqt's servers listen on every address; they run only in "
                    "a loopback-only network namespace (unshare -n needs root)")


@pytest.mark.parametrize("draft", DRAFTS)
def test_aiomoqt_sub_example_to_our_server(aiomoqt: Path, tmp_path: Path, draft: int) -> None:
    r = run_case("aiomoqt-sub-example", draft, aiomoqt, tmp_path, isolate=ISOLATE)
    info = describe(r)
    assert r.get("version") == draft and r.get("peer_draft") == draft, info
    assert (r.get("peer_total_objects"), r.get("peer_total_groups")) == (GROUPS * OBJECTS,
                                                                         GROUPS), info
    assert r.get("peer_rc") == 0, info


@CELLS
def test_aiomoqt_subscriber_to_our_server(aiomoqt: Path, tmp_path: Path, draft: int,
                                          transport: str) -> None:
    r = run_case("aiomoqt-sub", draft, aiomoqt, tmp_path, isolate=ISOLATE,
                 transport=transport)
    info = describe(r)
    assert r.get("version") == draft and r.get("peer_draft") == draft, info
    events = r.get("peer_events") or []
    assert events and events[-1]["event"] == "end" and events[-1]["closed"], info
    got = [e for e in events if e["event"] == "object"]
    assert len(got) == GROUPS * OBJECTS, info
    assert {(e["group"], e["object"]): e["sha256"] for e in got} == expected_objects(
        GROUPS, OBJECTS, SIZE), info
    assert all(e["status"] == 0 and e["len"] == SIZE and e["subgroup"] in (0, None)
               for e in got), info


@CELLS
def test_aiomoqt_pub_example_to_our_server(aiomoqt: Path, tmp_path: Path, draft: int,
                                           transport: str) -> None:
    """Their publisher example PUBLISHes (forward=0) to our server, which accepts the track
    and turns it on with REQUEST_UPDATE forward=1; the objects arrive with exact bytes."""
    r = run_case("aiomoqt-pub-example", draft, aiomoqt, tmp_path, isolate=ISOLATE,
                 transport=transport)
    info = describe(r)
    assert r.get("version") == draft and r.get("peer_draft") == draft, info
    assert r.get("error") is None, info
    assert r.get("published") == ["/".join(ns_of("aiomoqt")[:2]), TRACK], info
    normal = [o for o in r["objects"] if o["status"] == 0]
    want = [(g, o) for g in range(2) for o in range(PUB_EXAMPLE_GROUP)][:RELAY_OBJECTS]
    assert [(o["group"], o["object"]) for o in normal] == want, info
    assert all(o["sha256"] == sha256(aiomoqt_counted(o["group"], o["object"], SIZE))
               and o["len"] == SIZE for o in normal), info


@CELLS
def test_aiomoqt_pub_server_to_our_client(aiomoqt: Path, tmp_path: Path, draft: int,
                                          transport: str) -> None:
    _needs_isolation()
    r = run_case("aiomoqt-pub-server", draft, aiomoqt, tmp_path, isolate=True,
                 transport=transport)
    info = describe(r)
    assert r.get("version") == draft, info
    assert r.get("error") is None, info
    objs = r["objects"]
    normal = [o for o in objs if o["status"] == 0]
    assert {(o["group"], o["object"]): o["sha256"] for o in normal} == expected_objects(
        GROUPS, OBJECTS, SIZE, maker=aiomoqt_counted), info
    assert len(normal) == GROUPS * OBJECTS and all(o["len"] == SIZE for o in normal), info
    # moq-pub-server closes each group with an END_OF_GROUP status object (0x3) at object 4.
    eog = [(o["group"], o["object"]) for o in objs if o["status"] == 3]
    assert eog == [(g, OBJECTS) for g in range(GROUPS - 1)] or eog == [
        (g, OBJECTS) for g in range(GROUPS)], info


@CELLS
def test_aiomoqt_pub_example_via_aiomoqt_relay_to_our_client(aiomoqt: Path, tmp_path: Path,
                                                             draft: int, transport: str) -> None:
    """Their publisher example's objects reach our subscriber through their own relay (which
    accepts the bare PUBLISH and turns it on with REQUEST_UPDATE forward=1)."""
    _needs_isolation()
    r = run_case("aiomoqt-relay-pub-example", draft, aiomoqt, tmp_path, isolate=True,
                 transport=transport)
    info = describe(r)
    assert r.get("version") == draft and r.get("peer_draft") == draft, info
    assert r.get("error") is None, info
    normal = [o for o in r["objects"] if o["status"] == 0]
    want = [(g, o) for g in range(2) for o in range(PUB_EXAMPLE_GROUP)][:RELAY_OBJECTS]
    assert [(o["group"], o["object"]) for o in normal] == want, info
    assert all(o["sha256"] == sha256(aiomoqt_counted(o["group"], o["object"], SIZE))
               and o["len"] == SIZE for o in normal), info
