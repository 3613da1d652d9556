"""kvsp_moq.model: tokenizer, config, weight files, Compatibility Descriptor (kvsp-draft
§4.1) and samplers (§4.4 ``sampler``, §6.8). The KV paths are in tests/test_model_kv.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvsp_moq.kvsp.compat import compat_id, model_digest, tokenizer_digest, validate_descriptor
from kvsp_moq.model import (
    BOS_ID,
    EOS_ID,
    ByteTokenizer,
    ModelConfig,
    ModelError,
    Sampler,
    SamplerError,
    SamplerState,
    TokenizerError,
    WeightsError,
    build_descriptor,
    default_model_dir,
    ensure_model_files,
    load_weights,
)
from kvsp_moq.model.weights import DATA_FILE, MANIFEST_FILE, TOKENIZER_FILE, tensor_shapes


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # The test machine's cores are shared: one intra-op thread avoids oversubscription.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "KVSP über MOQT ✓\n"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(b"\x00\xff", bos=False, eos=True) == [0, 255, EOS_ID]
    assert tok.decode_bytes(list(range(256))) == bytes(range(256))
    assert tok.vocab_size == 258


def test_tokenizer_rejects_bad_ids() -> None:
    tok = ByteTokenizer()
    for bad in ([258], [-1], [1, 2, 1000], [True], [1.0]):
        with pytest.raises(TokenizerError, match="outside"):
            tok.decode(bad)  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="special token"):
        tok.decode_bytes([65, EOS_ID], skip_special=False)
    with pytest.raises(TokenizerError, match="str or bytes"):
        tok.encode(123)  # type: ignore[arg-type]


def test_tokenizer_file_is_deterministic_and_digestible(tmp_path: Path) -> None:
    a = ByteTokenizer().write(tmp_path / "a.json")
    b = ByteTokenizer().write(tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes() == ByteTokenizer().definition_bytes()
    assert json.loads(a.read_bytes())["special_tokens"] == {"bos": BOS_ID, "eos": EOS_ID}
    assert tokenizer_digest(a) == tokenizer_digest(b)
    assert ByteTokenizer.load(a) == ByteTokenizer()
    other = tmp_path / "other.json"
    other.write_text('{"format": "something-else"}')
    with pytest.raises(TokenizerError, match="not a kvsp-byte-tokenizer-1"):
        ByteTokenizer.load(other)


# ---------------------------------------------------------------------------------------------
# Config


def test_config_validation() -> None:
    c = ModelConfig()
    assert (c.layers, c.d_model, c.heads, c.kv_heads, c.head_dim) == (4, 128, 4, 2, 32)
    assert c.group_size == 2 and c.positional == "rope;theta=10000"
    assert ModelConfig.from_json(c.to_json()) == c
    for bad in ({"heads": 3}, {"head_dim": 31}, {"layers": 0}, {"rope_theta": 0.0},
                {"vocab_size": 10}, {"name": "a/b"}, {"seed": -1}, {"layers": True}):
        with pytest.raises(ModelError):
            ModelConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="unknown members"):
        ModelConfig.from_json({"layers": 2, "dropout": 0.1})


# ---------------------------------------------------------------------------------------------
# Weight files and the descriptor

SMALL = ModelConfig(name="kvsp-test-small", layers=2, d_model=64, heads=2, kv_heads=1,
                    head_dim=32, ffn_dim=128, seed=3)


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_weights_are_deterministic(tmp_path: Path) -> None:
    a = ensure_model_files(SMALL, tmp_path / "a")
    b = ensure_model_files(SMALL, tmp_path / "b")
    assert a.generated and b.generated
    assert sorted(_file_bytes(a.directory)) == [MANIFEST_FILE, TOKENIZER_FILE, DATA_FILE]
    assert _file_bytes(a.directory) == _file_bytes(b.directory)
    assert model_digest(a.weight_files) == model_digest(b.weight_files)
    da, db = build_descriptor(a), build_descriptor(b)
    assert da == db and compat_id(da) == compat_id(db)
    # another seed is another model: other weights, other model_digest, other compat_id
    c = ensure_model_files(ModelConfig(**{**SMALL.to_json(), "seed": 4}), tmp_path / "c")
    dc = build_descriptor(c)
    assert dc["model_digest"] != da["model_digest"] and compat_id(dc) != compat_id(da)
    assert dc["tokenizer_digest"] == da["tokenizer_digest"]


def test_weights_reload_and_regeneration_is_skipped(tmp_path: Path) -> None:
    first = ensure_model_files(SMALL, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    again = ensure_model_files(SMALL, tmp_path)
    assert not again.generated
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    weights = load_weights(first)
    assert weights.config == SMALL
    assert [(n, tuple(t.shape)) for n, t in weights.tensors.items()] == tensor_shapes(SMALL)
    assert all(t.dtype == torch.float32 for t in weights.tensors.values())


def test_weight_files_are_verified(tmp_path: Path) -> None:
    files = ensure_model_files(SMALL, tmp_path)
    with pytest.raises(WeightsError, match="another config"):
        ensure_model_files(ModelConfig(**{**SMALL.to_json(), "seed": 9}), tmp_path)
    data = bytearray(files.data_file.read_bytes())
    data[100] ^= 1
    files.data_file.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="SHA-256"):
        ensure_model_files(SMALL, tmp_path)
    with pytest.raises(WeightsError, match="SHA-256"):
        load_weights(tmp_path)
    files.data_file.write_bytes(bytes(data[:-4]))
    with pytest.raises(WeightsError, match="octets"):
        load_weights(tmp_path)
    files.manifest_file.write_text("{}")
    with pytest.raises(WeightsError, match="manifest"):
        load_weights(tmp_path)


def test_default_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSP_MODEL_DIR", str(tmp_path))
    assert default_model_dir("m") == tmp_path / "m"
    monkeypatch.delenv("KVSP_MODEL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_model_dir("m") == tmp_path / "cache" / "kvsp" / "model" / "m"
    monkeypatch.setenv("KVSP_MODEL_DIR", str(tmp_path / "env"))
    files = ensure_model_files(SMALL)  # default directory comes from the environment
    assert files.directory == tmp_path / "env" / SMALL.name and files.generated


def test_descriptor_is_valid_and_stable(tmp_path: Path) -> None:
    files = ensure_model_files(SMALL, tmp_path)
    doc = build_descriptor(files, block_tokens=64)
    parsed = validate_descriptor(doc)
    assert parsed.model == SMALL.name and "adapters" not in doc
    assert (parsed.layers, parsed.kv_heads, parsed.head_dim) == (2, 1, 32)
    assert parsed.kv_dtype.name == "fp32" and parsed.layout == "kvsp-layout-1"
    assert parsed.positional.name == "rope" and parsed.positional.params == {"theta": 10000.0}
    assert parsed.block_tokens == 64
    assert doc["model_digest"] == model_digest([tmp_path / MANIFEST_FILE, tmp_path / DATA_FILE])
    assert doc["tokenizer_digest"] == tokenizer_digest(tmp_path / TOKENIZER_FILE)
    # stable: the same files give the same compat_id; block size is part of the identity
    assert compat_id(build_descriptor(ensure_model_files(SMALL, tmp_path), block_tokens=64)) == compat_id(doc)
    assert compat_id(build_descriptor(files, block_tokens=16)) != compat_id(doc)
    with pytest.raises(ModelError):
        build_descriptor(files, block_tokens=0)


# ---------------------------------------------------------------------------------------------
# Samplers


def _logits(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(258, generator=gen) * 3


def test_greedy_sampler() -> None:
    s = Sampler.greedy()
    logits = torch.zeros(258)
    logits[[7, 9]] = 5.0
    assert s.sample(logits) == 7  # first index on ties
    assert s.step == 1 and s.state.to_json() == {
        "method": "greedy", "params": {}, "seed": 0, "step": 1, "deterministic": False}


def test_top_p_restored_at_any_step_reproduces_the_draws() -> None:
    s = Sampler.top_p(0.9, temperature=0.8, seed=7)
    draws = [s.sample(_logits(i)) for i in range(40)]
    assert len(set(draws)) > 10  # a real sample, not an argmax
    for step in (0, 1, 17, 39):
        checkpoint = json.loads(json.dumps(s.state.at_step(step).to_json()))
        restored = Sampler(SamplerState.from_json(checkpoint))
        assert [restored.sample(_logits(i)) for i in range(step, 40)] == draws[step:]
    other = Sampler.top_p(0.9, temperature=0.8, seed=8)
    assert [other.sample(_logits(i)) for i in range(40)] != draws


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.full((258,), -30.0)
    logits[[3, 4, 5]] = torch.tensor([2.0, 1.0, 0.0])  # probs ~ .665 .245 .090
    s = Sampler.top_p(0.8, seed=1)
    assert {s.sample(logits) for _ in range(200)} == {3, 4}
    s = Sampler.top_p(0.5, seed=1)
    assert {s.sample(logits) for _ in range(50)} == {3}


def test_sampler_rejects_bad_state() -> None:
    for method, params, seed, step in (
        ("beam", {}, 0, 0), ("top-p", {}, 0, 0), ("top-p", {"p": 0.0}, 0, 0),
        ("top-p", {"p": 1.5}, 0, 0), ("top-p", {"p": 0.9, "temperature": 0}, 0, 0),
        ("top-p", {"p": 0.9, "k": 3}, 0, 0), ("greedy", {"p": 0.9}, 0, 0),
        ("greedy", {}, -1, 0), ("greedy", {}, 0, -2), ("greedy", {}, 2 ** 64, 0),
    ):
        with pytest.raises(SamplerError):
            Sampler.restore(method, params, seed, step)
    with pytest.raises(SamplerError, match="REQUIRED"):
        SamplerState.from_json({"method": "greedy", "seed": 0})
    with pytest.raises(SamplerError, match="NaN"):
        Sampler.greedy().sample(torch.tensor([0.0, float("nan")]))
    with pytest.raises(SamplerError, match="1-D"):
        Sampler.greedy().sample(torch.zeros(2, 3))
    # a checkpoint written by another party with p only restores with temperature 1
    state = SamplerState.from_json({"method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": 3,
                                    "deterministic": False, "future": 1})
    assert state.params == {"p": 0.9, "temperature": 1.0} and state.step == 3


def test_no_pickle_in_weight_files(tmp_path: Path) -> None:
    files = ensure_model_files(SMALL, tmp_path)
    manifest = json.loads(files.manifest_file.read_bytes())
    assert manifest["format"] == "kvsp-ref-weights-1" and manifest["byte_order"] == "little"
    assert os.path.getsize(files.data_file) == manifest["data_bytes"]
