"""Interop with caprid-relay 0.1.0 (Mux's Python SDK on aioquic 1.3; client only, drafts 22
and 20): its subscriber against our server, and its publisher (which waits for the server's
SUBSCRIBE_NAMESPACE, the moq-relay ingest model) feeding our server. See docs/interop.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from interop import peers
from interop.cases import GROUPS, OBJECTS, SIZE
from interop.testing import describe, expected_objects, peer_bin, run_case

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def caprid() -> Path:
    return peer_bin(peers.CAPRID)


@pytest.mark.parametrize("draft", [22, 20])
def test_caprid_subscriber_to_our_server(caprid: Path, tmp_path: Path, draft: int) -> None:
    r = run_case("caprid-sub", draft, caprid, tmp_path)
    info = describe(r)
    assert r.get("version") == draft and r.get("peer_protocol") == f"moqt-{draft}", info
    events = r.get("peer_events") or []
    assert events and events[-1]["event"] == "end", info
    got = [e for e in events if e["event"] == "object"]
    assert len(got) == GROUPS * OBJECTS, info
    assert {(e["group"], e["object"]): e["sha256"] for e in got} == expected_objects(
        GROUPS, OBJECTS, SIZE), info
    assert all(e["status"] == "normal" and e["len"] == SIZE for e in got), info
    done = [e for e in events if e["event"] == "publisher_done"]
    assert [(d["status"], d["stream_count"]) for d in done] == [(0x2, GROUPS)], info
    assert sum(e["event"] == "subgroup_end" for e in events) == GROUPS, info


@pytest.mark.parametrize("draft", [22, 20])
def test_caprid_publisher_to_our_server(caprid: Path, tmp_path: Path, draft: int) -> None:
    r = run_case("caprid-pub", draft, caprid, tmp_path)
    info = describe(r)
    assert r.get("version") == draft, info
    assert r.get("namespace_update") == ["namespace", ["caprid"]], info
    assert r.get("error") is None, info
    objs = r["objects"]
    assert len(objs) == GROUPS * OBJECTS and all(o["status"] == 0 for o in objs), info
    assert {(o["group"], o["object"]): o["sha256"] for o in objs} == expected_objects(
        GROUPS, OBJECTS, SIZE), info
    assert r["publish_done"] == {"status": 0x2, "stream_count": GROUPS}, info
    assert r["data_streams"] == GROUPS, info
    assert [e["event"] for e in r["peer_events"]][-2:] == ["written", "end"], info
