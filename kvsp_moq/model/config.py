"""The reference model's configuration: a small decoder-only transformer (Llama-style:
RMSNorm, grouped-query attention with RoPE, SwiGLU MLP).

The members that fix the cache geometry map to the Compatibility Descriptor (kvsp-draft
§4.1): ``layers``, ``kv_heads``, ``head_dim``, ``kv_dtype`` and ``positional`` (RoPE with its
``theta``). The whole config is also written into the weight manifest, so ``model_digest``
covers it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..kvsp.registries import format_positional
from .errors import ModelError
from .tokenizer import ByteTokenizer

__all__ = ["DEFAULT_MODEL_NAME", "KV_DTYPE", "ModelConfig"]

DEFAULT_MODEL_NAME = "kvsp-ref-tiny-1"
#: The model computes in float32 and stores its KV cache as float32, so KV loaded from a block
#: is bit-identical to KV recomputed (registry name of §11.2.3, torch ``float32``).
KV_DTYPE = "fp32"


def _check_int(name: str, value: object, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ModelError(f"config {name} must be an integer >= {low}, got {value!r}")


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ModelError(f"config {name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ModelError(f"config {name} must be finite and > 0, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and weight seed. Defaults: 4 layers, d_model 128, 4 query heads over 2 KV
    heads of 32 dims, SwiGLU of 384, RoPE theta 10000, vocabulary of the byte tokenizer."""

    name: str = DEFAULT_MODEL_NAME
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = ByteTokenizer().vocab_size
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name or self.name in (".", ".."):
            raise ModelError(f"config name must be a non-empty file-name-safe string, got {self.name!r}")
        for name in ("layers", "d_model", "heads", "kv_heads", "head_dim", "ffn_dim", "vocab_size"):
            _check_int(name, getattr(self, name))
        _check_int("seed", self.seed, 0)
        _check_float("rope_theta", self.rope_theta)
        _check_float("norm_eps", self.norm_eps)
        if self.heads % self.kv_heads:
            raise ModelError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.vocab_size < ByteTokenizer().vocab_size:
            raise ModelError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.heads // self.kv_heads

    @property
    def positional(self) -> str:
        """The descriptor's ``positional`` member (§4.1): RoPE with its explicit theta."""
        return format_positional("rope", {"theta": self.rope_theta})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["rope_theta"] = float(self.rope_theta)
        data["norm_eps"] = float(self.norm_eps)
        return data

    @classmethod
    def from_json(cls, data: object) -> ModelConfig:
        """From parsed JSON (any value: not an object is a :class:`ModelError`)."""
        if not isinstance(data, Mapping):
            raise ModelError("config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ModelError(f"config has unknown members {sorted(unknown)}")
        return cls(**dict(data))
