"""Deterministic weights of the reference model and their files.

Weights are drawn once from ``torch.Generator().manual_seed(config.seed)`` in a fixed tensor
order, written to a model directory, and from then on always *loaded from those files*: the
files, not the generator, define the model, and ``model_digest`` (kvsp-draft §4.1) is computed
over them. A torch release whose generator draws differently would write other files, hence
another ``model_digest`` and another ``compat_id`` — caches are never mixed up.

Files (format ``kvsp-ref-weights-1``, no pickle, deterministic bytes)::

    <dir>/model.json      manifest: config, tensor names/shapes/offsets, SHA-256 of weights.bin
    <dir>/weights.bin     every tensor, float32 little-endian, C order, concatenated
    <dir>/tokenizer.json  the byte tokenizer's definition file (tokenizer_digest, §4.1)

The weight files of ``model_digest`` are ``model.json`` and ``weights.bin`` (the manifest
carries the architecture, so the digest covers it); the tokenizer file has its own digest.
Writes are atomic (temporary file + rename, manifest last), so a crash never leaves a manifest
without its data; an existing model directory is verified and reused, never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .errors import ModelError, WeightsError
from .tokenizer import BYTE_TOKENS, ByteTokenizer

__all__ = [
    "DATA_FILE",
    "MANIFEST_FILE",
    "TOKENIZER_FILE",
    "WEIGHTS_FORMAT",
    "ModelFiles",
    "Weights",
    "default_model_dir",
    "ensure_model_files",
    "generate_weights",
    "load_weights",
    "tensor_shapes",
]

WEIGHTS_FORMAT = "kvsp-ref-weights-1"
MANIFEST_FILE = "model.json"
DATA_FILE = "weights.bin"
TOKENIZER_FILE = "tokenizer.json"
_LE_F32 = np.dtype("<f4")

# Output bias (not random): printable ASCII and newline are favoured so that generated text is
# readable; other bytes and BOS are strongly disfavoured; EOS is mildly disfavoured.
_PRINTABLE_BIAS = 2.0
_OTHER_BIAS = -8.0
_EOS_BIAS = -4.0


def tensor_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight tensor's name and shape, in file (and generation) order."""
    d, hd, f, v = config.d_model, config.head_dim, config.ffn_dim, config.vocab_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (v, d))]
    for layer in range(config.layers):
        p = f"layers.{layer}."
        shapes += [
            (p + "attn_norm", (d,)),
            (p + "wq", (config.heads * hd, d)),
            (p + "wk", (config.kv_heads * hd, d)),
            (p + "wv", (config.kv_heads * hd, d)),
            (p + "wo", (d, config.heads * hd)),
            (p + "mlp_norm", (d,)),
            (p + "w_gate", (f, d)),
            (p + "w_up", (f, d)),
            (p + "w_down", (d, f)),
        ]
    shapes += [("final_norm", (d,)), ("lm_head", (v, d)), ("lm_head_bias", (v,))]
    return shapes


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    """Scaled init: unit-variance activations through each projection (fan-in), a sharper
    query so attention depends on content, and spread logits so greedy decoding varies."""
    base = name.rsplit(".", 1)[-1]
    fan_in = shape[-1]
    scale = {"embed": 1.0, "wq": 2.0, "lm_head": 4.0}.get(base, 1.0)
    return scale if base == "embed" else scale / math.sqrt(fan_in)


def _output_bias(config: ModelConfig) -> torch.Tensor:
    bias = torch.full((config.vocab_size,), _OTHER_BIAS, dtype=torch.float32)
    for byte in list(range(0x20, 0x7F)) + [0x0A]:
        bias[byte] = _PRINTABLE_BIAS
    tokenizer = ByteTokenizer()
    if tokenizer.eos_id < config.vocab_size:
        bias[tokenizer.eos_id] = _EOS_BIAS
    assert BYTE_TOKENS <= config.vocab_size
    return bias


def generate_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Draw every tensor (float32, CPU) from ``torch.Generator().manual_seed(config.seed)`` in
    :func:`tensor_shapes` order. Norm weights are ones; the output bias is fixed."""
    gen = torch.Generator(device="cpu").manual_seed(config.seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(config):
        base = name.rsplit(".", 1)[-1]
        if base.endswith("norm"):
            out[name] = torch.ones(shape, dtype=torch.float32)
        elif base == "lm_head_bias":
            out[name] = _output_bias(config)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float32)
            out[name] = t * _init_std(name, shape)
    return out


@dataclass(frozen=True)
class Weights:
    """Loaded weights: float32 CPU tensors by name."""

    config: ModelConfig
    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ModelFiles:
    """A model directory whose files were verified."""

    directory: Path
    config: ModelConfig
    generated: bool  # True when this call wrote the files, False when they were reused

    @property
    def manifest_file(self) -> Path:
        return self.directory / MANIFEST_FILE

    @property
    def data_file(self) -> Path:
        return self.directory / DATA_FILE

    @property
    def tokenizer_file(self) -> Path:
        """The tokenizer definition file (``tokenizer_digest``, §4.1)."""
        return self.directory / TOKENIZER_FILE

    @property
    def weight_files(self) -> tuple[Path, Path]:
        """The weight files of ``model_digest`` (§4.1)."""
        return (self.manifest_file, self.data_file)


def default_model_dir(name: str) -> Path:
    """``$KVSP_MODEL_DIR/<name>`` if set, else ``$XDG_CACHE_HOME/kvsp/model/<name>`` (default
    ``~/.cache/kvsp/model/<name>``)."""
    root = os.environ.get("KVSP_MODEL_DIR")
    if root:
        return Path(root) / name
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvsp" / "model" / name


def _manifest(config: ModelConfig, data_sha256: str, data_bytes: int) -> dict[str, Any]:
    tensors = []
    offset = 0
    for name, shape in tensor_shapes(config):
        tensors.append({"name": name, "shape": list(shape), "offset": offset})
        offset += math.prod(shape) * _LE_F32.itemsize
    assert offset == data_bytes
    return {
        "format": WEIGHTS_FORMAT,
        "config": config.to_json(),
        "dtype": "fp32",
        "byte_order": "little",
        "data_file": DATA_FILE,
        "data_bytes": data_bytes,
        "data_sha256": data_sha256,
        "tensors": tensors,
    }


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=1) + "\n").encode("ascii")


def _serialize(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> bytes:
    parts = [tensors[name].contiguous().numpy().astype(_LE_F32, copy=False).tobytes()
             for name, _ in tensor_shapes(config)]
    return b"".join(parts)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_manifest(directory: Path) -> tuple[dict[str, Any], ModelConfig]:
    path = directory / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read weight manifest {path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != WEIGHTS_FORMAT:
        raise WeightsError(f"{path} is not a {WEIGHTS_FORMAT} manifest")
    try:
        config = ModelConfig.from_json(manifest.get("config", None))
    except ModelError as exc:
        raise WeightsError(f"{path}: bad config: {exc}") from None
    data_bytes = sum(math.prod(s) for _, s in tensor_shapes(config)) * _LE_F32.itemsize
    expected = _manifest(config, str(manifest.get("data_sha256")), data_bytes)
    if manifest != expected:
        raise WeightsError(f"{path}: manifest does not match its config (format {WEIGHTS_FORMAT})")
    return manifest, config


def _read_data(directory: Path, manifest: Mapping[str, Any]) -> bytes:
    path = directory / DATA_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WeightsError(f"cannot read weight data {path}: {exc}") from None
    if len(data) != manifest["data_bytes"]:
        raise WeightsError(f"{path} holds {len(data)} octets, the manifest says {manifest['data_bytes']}")
    if hashlib.sha256(data).hexdigest() != manifest["data_sha256"]:
        raise WeightsError(f"{path} does not match the SHA-256 in its manifest (corrupted?)")
    return data


def _check_tokenizer(directory: Path) -> None:
    path = directory / TOKENIZER_FILE
    tokenizer = ByteTokenizer()
    if not path.exists():
        tokenizer.write(path)
    elif path.read_bytes() != tokenizer.definition_bytes():
        raise WeightsError(f"{path} is not this model's tokenizer definition file")


def ensure_model_files(
    config: ModelConfig | None = None, directory: str | os.PathLike[str] | None = None
) -> ModelFiles:
    """The verified model directory for ``config`` (default :class:`ModelConfig`), generating
    the files once if the directory has no manifest yet.

    ``directory`` defaults to :func:`default_model_dir` of the config's name. Existing files
    are verified (manifest for this exact config, data size and SHA-256, tokenizer bytes) and
    reused; WeightsError if they belong to another config or are corrupted (they are never
    overwritten: delete the directory to regenerate).
    """
    config = config if config is not None else ModelConfig()
    path = Path(directory) if directory is not None else default_model_dir(config.name)
    path.mkdir(parents=True, exist_ok=True)
    if (path / MANIFEST_FILE).exists():
        manifest, found = _read_manifest(path)
        if found != config:
            raise WeightsError(f"{path} holds weights of another config: {found} (wanted {config})")
        _read_data(path, manifest)
        _check_tokenizer(path)
        return ModelFiles(path, config, generated=False)
    data = _serialize(config, generate_weights(config))
    _atomic_write(path / DATA_FILE, data)
    _check_tokenizer(path)
    manifest = _manifest(config, hashlib.sha256(data).hexdigest(), len(data))
    _atomic_write(path / MANIFEST_FILE, _manifest_bytes(manifest))  # last: marks completion
    return ModelFiles(path, config, generated=True)


def load_weights(directory: str | os.PathLike[str] | ModelFiles) -> Weights:
    """Load and verify the weights of a model directory (float32 CPU tensors)."""
    path = directory.directory if isinstance(directory, ModelFiles) else Path(directory)
    manifest, config = _read_manifest(path)
    data = _read_data(path, manifest)
    flat = np.frombuffer(data, dtype=_LE_F32).astype(np.float32)  # native order, writable copy
    tensors: dict[str, torch.Tensor] = {}
    for entry in manifest["tensors"]:
        start = entry["offset"] // _LE_F32.itemsize
        count = math.prod(entry["shape"])
        array = flat[start : start + count].reshape(entry["shape"])
        tensors[entry["name"]] = torch.from_numpy(array)
    return Weights(config, tensors)
