"""MOQT naming of blocks (binding v1, DESIGN.md §4; kvsp-draft §4.4 moqt_namespace)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.kvsp.errors import NamingError
from kvsp_moq.kvsp.naming import (BlockName, check_full_track_name, decode_moqt_namespace,
                                  encode_moqt_namespace, scope_prefix, track_name)

VEC = json.loads((Path(__file__).parent / "vectors/core/core.json").read_text())["namespaces"][0]
FIELDS = tuple(bytes.fromhex(f) for f in VEC["fields"])


def test_pinned_namespace_both_directions() -> None:
    name = BlockName.from_fields(FIELDS)
    assert name.namespace_fields() == FIELDS
    assert name.moqt_namespace() == VEC["moqt_namespace"]
    assert "=" not in VEC["moqt_namespace"]
    assert BlockName.from_moqt_namespace(VEC["moqt_namespace"]) == name


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16),
       st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16))
def test_round_trip(c: bytes, s: bytes, k: bytes, r: bytes) -> None:
    name = BlockName(c, s, k, r)
    text = name.moqt_namespace()
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    assert raw == b"".join(bytes([len(f)]) + f for f in name.namespace_fields())
    assert BlockName.from_moqt_namespace(text) == name


def test_new_replica_ids_are_fresh() -> None:
    a = BlockName.new_replica(bytes(32), bytes(16), bytes(32))
    b = BlockName.new_replica(bytes(32), bytes(16), bytes(32))
    assert a.replica_id != b.replica_id and len(a.replica_id) == 16


@pytest.mark.parametrize("fields", [
    FIELDS[:4], FIELDS + (b"x",), (b"kvsp-2",) + FIELDS[1:], (FIELDS[0], FIELDS[1][:31]) + FIELDS[2:],
    FIELDS[:4] + (FIELDS[4] + b"x",),
])
def test_non_block_namespaces_are_rejected(fields: tuple[bytes, ...]) -> None:
    with pytest.raises(NamingError):
        BlockName.from_fields(fields)


@pytest.mark.parametrize("text", ["", "a", "ab=c", "abc=", "ab+c", "ab/c", "AQ", "Ag", "BWt2c3At",
                                  "A" * 10000, "é"])
def test_malformed_moqt_namespace(text: str) -> None:
    with pytest.raises(NamingError):
        BlockName.from_moqt_namespace(text)


def test_non_canonical_padding_bits_rejected() -> None:
    good = encode_moqt_namespace([b"a"])  # "AWE"
    assert decode_moqt_namespace(good) == (b"a",)
    with pytest.raises(NamingError, match="canonical"):
        decode_moqt_namespace(good[:-1] + "F")


def test_moqt_limits() -> None:
    check_full_track_name([b"x"] * 32, b"")
    with pytest.raises(NamingError, match="32 fields"):
        check_full_track_name([b"x"] * 33, b"")
    with pytest.raises(NamingError, match="empty"):
        encode_moqt_namespace([b"kvsp-1", b""])
    with pytest.raises(NamingError, match="4096"):
        check_full_track_name([b"x" * 4000], b"y" * 97)
    check_full_track_name([b"x" * 4000], b"y" * 96)


@given(st.text(max_size=300))
def test_decoder_only_raises_naming_error(text: str) -> None:
    try:
        decode_moqt_namespace(text)
    except NamingError:
        pass


def test_track_names_and_scope_prefix() -> None:
    assert track_name("raw") == b"raw"
    with pytest.raises(NamingError):
        track_name("zstd")
    assert scope_prefix(FIELDS[1], FIELDS[2]) == FIELDS[:3]
    with pytest.raises(NamingError):
        scope_prefix(b"x", FIELDS[2])
