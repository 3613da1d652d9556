"""Compatibility Descriptor and ID (kvsp-draft §4.1) against pinned, independently computed vectors."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from kvsp_moq.kvsp.compat import compat_id, model_digest, tokenizer_digest, validate_descriptor
from kvsp_moq.kvsp.errors import DescriptorError, KvspError

VECTORS = json.loads((Path(__file__).parent / "vectors/core/core.json").read_text())
BASE = VECTORS["descriptors"]["llama-like"]["descriptor"]


@pytest.mark.parametrize("name", sorted(VECTORS["descriptors"]))
def test_compat_id_matches_pinned_vector(name: str) -> None:
    vec = VECTORS["descriptors"][name]
    assert compat_id(vec["descriptor"]).hex() == vec["compat_id"]


def test_compat_id_is_independent_of_member_order_and_whitespace() -> None:
    shuffled = dict(reversed(list(BASE.items())))
    assert compat_id(shuffled) == compat_id(json.loads(json.dumps(BASE, indent=4)))


def test_validated_members_are_typed() -> None:
    d = validate_descriptor(BASE)
    assert (d.layers, d.kv_heads, d.head_dim, d.block_tokens) == (32, 8, 128, 16)
    assert d.kv_dtype.name == "bf16" and d.kv_dtype.itemsize == 2
    assert d.positional.name == "rope" and d.positional.params == {"theta": 500000.0}
    assert d.adapters is None


def _without(member: str) -> dict:
    doc = copy.deepcopy(BASE)
    del doc[member]
    return doc


def _with(member: str, value: object) -> dict:
    doc = copy.deepcopy(BASE)
    doc[member] = value
    return doc


@pytest.mark.parametrize("member", sorted(BASE))
def test_every_required_member_is_required(member: str) -> None:
    with pytest.raises(DescriptorError) as exc:
        compat_id(_without(member))
    assert exc.value.member == member


BAD_VALUES = [
    ("model", ""), ("model", 7),
    ("model_digest", "sha-256:" + "A" * 64), ("model_digest", "sha-256:" + "a" * 63),
    ("model_digest", "sha256:" + "a" * 64), ("model_digest", "a" * 64), ("tokenizer_digest", None),
    ("layers", 0), ("layers", -1), ("layers", 1.5), ("layers", True), ("layers", "32"), ("kv_heads", 2**40),
    ("head_dim", 128.0), ("block_tokens", 0),
    ("kv_dtype", "fp64"), ("kv_dtype", "BF16"), ("kv_dtype", 2),
    ("positional", "yarn"), ("positional", "rope;theta"), ("positional", "rope;theta=-1"),
    ("positional", "rope;theta=1;theta=2"), ("positional", "rope;beta=2"), ("positional", "none;x=1"),
    ("positional", "rope;theta=nan"), ("positional", "alibi;max_bias=inf"),
    ("layout", "kvsp-layout-2"),
]


@pytest.mark.parametrize(("member", "value"), BAD_VALUES)
def test_bad_member_values_name_the_member(member: str, value: object) -> None:
    with pytest.raises(DescriptorError) as exc:
        validate_descriptor(_with(member, value))
    assert exc.value.member == member
    assert member in str(exc.value)


def test_adapters_empty_array_is_an_error_but_absent_is_fine() -> None:
    with pytest.raises(DescriptorError, match="empty array"):
        validate_descriptor(_with("adapters", []))
    with pytest.raises(DescriptorError) as exc:
        validate_descriptor(_with("adapters", ["sha-256:" + "a" * 64, "bogus"]))
    assert exc.value.member == "adapters[1]"
    assert validate_descriptor(_with("adapters", ["sha-256:" + "a" * 64])).adapters == (b"\xaa" * 32,)


def test_adapters_change_the_identity() -> None:
    with_adapter = _with("adapters", ["sha-256:" + "a" * 64])
    assert compat_id(with_adapter) != compat_id(BASE)


@pytest.mark.parametrize("doc", [None, [], "x", 1])
def test_non_object_descriptor(doc: object) -> None:
    with pytest.raises(DescriptorError):
        validate_descriptor(doc)


def test_positional_parameters_are_parsed() -> None:
    d = validate_descriptor(_with("positional", "rope;theta=10000;dim=64;scaling=yarn;factor=4;original_max_position=8192"))
    assert d.positional.params == {"theta": 10000.0, "dim": 64, "scaling": "yarn", "factor": 4.0,
                                   "original_max_position": 8192}
    assert validate_descriptor(_with("positional", "alibi")).positional.name == "alibi"


def test_unknown_members_are_part_of_the_identity() -> None:
    vec = VECTORS["descriptors"]["with-adapters"]
    assert "ñ-unknown-member" in vec["descriptor"]
    assert compat_id(vec["descriptor"]).hex() == vec["compat_id"]


def test_non_canonicalizable_value_is_a_descriptor_error() -> None:
    with pytest.raises(KvspError):
        compat_id(_with("x-extra", float("nan")))


def test_model_digest_streams_files_in_byte_order_of_names(tmp_path: Path) -> None:
    # "B" (0x42) sorts before "a" (0x61) in byte order, though not in case-insensitive order.
    parts = {"a-00002.safetensors": b"second" * 1000, "B-00001.safetensors": b"first" * 3000,
             "a-00001.safetensors": b"middle"}
    for name, data in parts.items():
        (tmp_path / name).write_bytes(data)
    expected = hashlib.sha256(parts["B-00001.safetensors"] + parts["a-00001.safetensors"]
                              + parts["a-00002.safetensors"]).hexdigest()
    assert model_digest([tmp_path]) == "sha-256:" + expected
    assert model_digest(sorted(tmp_path.iterdir(), reverse=True)) == "sha-256:" + expected


def test_model_digest_of_a_file_larger_than_one_read(tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * 4096 + 17)  # > 3 MiB, not a multiple of the read size
    (tmp_path / "w.bin").write_bytes(data)
    assert model_digest([tmp_path / "w.bin"]) == "sha-256:" + hashlib.sha256(data).hexdigest()


def test_model_digest_errors(tmp_path: Path) -> None:
    with pytest.raises(DescriptorError):
        model_digest([])
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    (tmp_path / "x" / "w").write_bytes(b"1")
    (tmp_path / "y" / "w").write_bytes(b"2")
    with pytest.raises(DescriptorError, match="share a file name"):
        model_digest([tmp_path / "x" / "w", tmp_path / "y" / "w"])


def test_tokenizer_digest(tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_bytes(b'{"vocab": 256}')
    assert tokenizer_digest(tmp_path / "tok.json") == "sha-256:" + hashlib.sha256(b'{"vocab": 256}').hexdigest()


def test_one_canonical_positional_text() -> None:
    """Every producer writes numbers one way (an integer value as an integer, else the shortest
    round trip) and parameters in the registry's order, so one model has one positional text."""
    from kvsp_moq.kvsp.registries import format_number, format_positional

    assert format_positional("rope", {"theta": 1e6}) == "rope;theta=1000000"
    assert format_positional("rope", {"theta": 1000000}) == "rope;theta=1000000"
    assert format_positional("rope", {"factor": 2.5, "scaling": "yarn", "theta": 10000.0, "dim": 64.0}) \
        == "rope;theta=10000;dim=64;scaling=yarn;factor=2.5"
    assert format_positional("rope", {"theta": 1e4, "factor": None}) == "rope;theta=10000"
    assert format_positional("none") == "none"
    assert format_number(0.1) == "0.1" and format_number(-0.0) == "0"
    for name, params in (("rotary", {}), ("rope", {"beta": 1.0}), ("rope", {"theta": -1.0}),
                         ("rope", {"scaling": "longrope"}), ("rope", {"theta": float("inf")})):
        with pytest.raises(ValueError):
            format_positional(name, params)
