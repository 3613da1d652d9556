"""Scopes and Block Keys (kvsp-draft §4.2), checked against hmac/hashlib computed here."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_moq.kvsp.blockkeys import ZERO_KEY, BlockKeyChain, block_keys, next_block_key, pack_tokens
from kvsp_moq.kvsp.errors import BlockKeyError, ScopeError
from kvsp_moq.kvsp.scope import scope_id

VECTORS = json.loads((Path(__file__).parent / "vectors/core/core.json").read_text())
SCOPE_KEY = bytes(range(32))
COMPAT = hashlib.sha256(b"some descriptor").digest()


def reference_keys(scope_key: bytes, compat: bytes, tokens: list[int], b: int) -> list[bytes]:
    prev, keys = bytes(32), []
    for i in range(len(tokens) // b):
        msg = b"KVSP-BLOCK-1\x00" + compat + prev + struct.pack(f">{b}I", *tokens[i * b:(i + 1) * b])
        prev = hmac.new(scope_key, msg, hashlib.sha256).digest()
        keys.append(prev)
    return keys


def test_scope_id_vector() -> None:
    vec = VECTORS["scopes"][0]
    assert scope_id(bytes.fromhex(vec["scope_key"])).hex() == vec["scope_id"]
    key = b"\x07" * 48
    assert scope_id(key) == hashlib.sha256(b"KVSP-SCOPE-1\x00" + key).digest()[:16]


@pytest.mark.parametrize("size", [0, 1, 31])
def test_short_scope_key_is_an_error(size: int) -> None:
    with pytest.raises(ScopeError, match="at least 32"):
        scope_id(bytes(size))
    with pytest.raises(ScopeError):
        block_keys(bytes(size), COMPAT, list(range(16)), 16)


def test_block_key_vector() -> None:
    vec = VECTORS["block_keys"][0]
    keys = block_keys(bytes.fromhex(vec["scope_key"]), bytes.fromhex(vec["compat_id"]),
                      vec["tokens"], vec["block_tokens"])
    assert [k.hex() for k in keys] == vec["keys"]


def test_only_complete_blocks_have_keys() -> None:
    assert block_keys(SCOPE_KEY, COMPAT, list(range(15)), 16) == []
    assert len(block_keys(SCOPE_KEY, COMPAT, list(range(47)), 16)) == 2
    assert block_keys(SCOPE_KEY, COMPAT, [], 16) == []


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200), b=st.integers(1, 20),
       splits=st.lists(st.integers(0, 200), max_size=6))
def test_chain_equals_reference_for_any_feeding(tokens: list[int], b: int, splits: list[int]) -> None:
    expected = reference_keys(SCOPE_KEY, COMPAT, tokens, b)
    assert block_keys(SCOPE_KEY, COMPAT, tokens, b) == expected
    chain = BlockKeyChain(SCOPE_KEY, COMPAT, b)
    got: list[bytes] = []
    cuts = sorted({min(s, len(tokens)) for s in splits} | {0, len(tokens)})
    for lo, hi in zip(cuts, cuts[1:]):
        got += chain.extend(tokens[lo:hi])
    assert got == expected
    assert chain.pending == len(tokens) % b
    assert chain.index == len(expected)
    assert chain.last_key == (expected[-1] if expected else ZERO_KEY)


def test_resuming_from_previous_key_hashes_only_the_new_block() -> None:
    tokens = list(range(64))
    expected = reference_keys(SCOPE_KEY, COMPAT, tokens, 16)
    resumed = BlockKeyChain(SCOPE_KEY, COMPAT, 16, previous=expected[2], index=3)
    assert resumed.extend(tokens[48:]) == [expected[3]]
    assert next_block_key(SCOPE_KEY, COMPAT, expected[2], tokens[48:]) == expected[3]
    assert next_block_key(SCOPE_KEY, COMPAT, ZERO_KEY, tokens[:16]) == expected[0]


def test_numpy_tokens_are_accepted() -> None:
    tokens = np.arange(32, dtype=np.uint32)
    assert block_keys(SCOPE_KEY, COMPAT, tokens, 16) == reference_keys(SCOPE_KEY, COMPAT, list(range(32)), 16)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"], [2**70], [None], [[1, 2]]])
def test_tokens_must_fit_uint32(bad: list[object]) -> None:
    with pytest.raises(BlockKeyError):
        pack_tokens(bad)  # type: ignore[arg-type]
    with pytest.raises(BlockKeyError):
        block_keys(SCOPE_KEY, COMPAT, list(range(15)) + bad, 16)  # type: ignore[operator]


def test_token_boundaries_encode_as_network_order_uint32() -> None:
    assert pack_tokens([0, 1, 2**32 - 1]) == b"\x00\x00\x00\x00\x00\x00\x00\x01\xff\xff\xff\xff"


@pytest.mark.parametrize("kwargs", [dict(compat_id=b"short"), dict(block_tokens=0), dict(block_tokens=True),
                                    dict(previous=b"x" * 31), dict(previous=b"x" * 32, index=0),
                                    dict(index=2)])
def test_bad_chain_parameters(kwargs: dict) -> None:
    args = dict(scope_key=SCOPE_KEY, compat_id=COMPAT, block_tokens=16) | kwargs
    previous = args.pop("previous", ZERO_KEY)
    index = args.pop("index", 0)
    with pytest.raises(BlockKeyError):
        BlockKeyChain(args["scope_key"], args["compat_id"], args["block_tokens"], previous=previous, index=index)


def test_keys_differ_across_scopes_and_compat_ids() -> None:
    tokens = list(range(16))
    a = block_keys(SCOPE_KEY, COMPAT, tokens, 16)
    assert a != block_keys(b"\x01" * 32, COMPAT, tokens, 16)
    assert a != block_keys(SCOPE_KEY, bytes(32), tokens, 16)
