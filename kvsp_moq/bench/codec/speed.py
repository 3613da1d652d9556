"""Compression ratio and encode/decode MB/s of each codec, one core, on real KV in the dtype
engines store (bf16) and a layer geometry of a real model (8 KV heads of 128 dims, Llama-3-8B's):
the reference architecture widened to that geometry (random weights, computed KV), blocks of
``block_tokens`` tokens, one layer at a time as a holder or an instance codes them.

MB/s are octets of the raw layer (K and V sections in kvsp-layout-1) per second, coded or
decoded. The raw baseline copies those octets once (the least any codec's output costs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...kvsp.codecs import decode_layer, encode_layer
from ...kvsp.codecs.elements import from_float32
from ...kvsp.layout import Geometry
from ...model import ModelConfig
from ..report import best_seconds
from .accuracy import prompts, reference_model

__all__ = ["SPEED_CONFIG", "Speed", "measure", "sample_layers"]

SPEED_CONFIG = ModelConfig(name="kvsp-bench-codec-wide", layers=4, d_model=512, heads=16,
                           kv_heads=8, head_dim=128, ffn_dim=1024)
"""The reference architecture at Llama-3-8B's KV geometry (kv_heads 8, head_dim 128)."""


@dataclass(frozen=True)
class Speed:
    """One codec over the sample: octets in and out, and the best seconds of each pass."""

    raw_bytes: int
    coded_bytes: int
    encode_s: float
    decode_s: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.coded_bytes

    @property
    def encode_mbps(self) -> float:
        return self.raw_bytes / self.encode_s / 1e6

    @property
    def decode_mbps(self) -> float:
        return self.raw_bytes / self.decode_s / 1e6


def sample_layers(blocks: int, block_tokens: int, config: ModelConfig = SPEED_CONFIG
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray]], Geometry]:
    """(K, V) bf16 bit patterns of every layer of ``blocks`` prompts of ``block_tokens`` tokens."""
    model = reference_model(config)
    geometry = Geometry.from_descriptor_fields(config.kv_heads, config.head_dim, "bf16")
    layers = []
    for prompt in prompts(blocks, block_tokens, seed=2):
        cache = model.prefill(prompt).cache
        for layer in range(config.layers):
            k, v = cache.layer(layer)
            layers.append((from_float32(k.numpy(), "bf16"), from_float32(v.numpy(), "bf16")))
    return layers, geometry


def measure(codec: str, layers: Sequence[tuple[np.ndarray, np.ndarray]], geometry: Geometry,
            repeat: int) -> Speed:
    """Encode then decode every layer of the sample with ``codec`` (best of ``repeat``); the
    decoded layers are checked (bit for bit where the codec is lossless)."""
    tokens = layers[0][0].shape[0]
    raw_bytes = sum(k.nbytes + v.nbytes for k, v in layers)
    if codec == "raw":  # the baseline: the section octets copied once, and back
        sections = [(k.tobytes(), v.tobytes()) for k, v in layers]
        encode_s = best_seconds(lambda: [(k.tobytes(), v.tobytes()) for k, v in layers], repeat)
        decode_s = best_seconds(lambda: [tuple(np.array(a) for a in decode_layer("raw", k, v, geometry, tokens))
                                  for k, v in sections], repeat)
        return Speed(raw_bytes, raw_bytes, encode_s, decode_s)
    coded = [encode_layer(codec, k, v, geometry, tokens) for k, v in layers]
    encode_s = best_seconds(lambda: [encode_layer(codec, k, v, geometry, tokens) for k, v in layers], repeat)
    decode_s = best_seconds(lambda: [decode_layer(codec, k, v, geometry, tokens) for k, v in coded], repeat)
    for (k, v), (ks, vs) in zip(layers, coded, strict=True):
        dk, dv = decode_layer(codec, ks, vs, geometry, tokens)
        if dk.shape != k.shape or (codec == "zstd-planes" and not (np.array_equal(dk, k) and np.array_equal(dv, v))):
            raise AssertionError(f"{codec} did not round-trip the sample")
    coded_bytes = sum(len(memoryview(k)) + len(memoryview(v)) for k, v in coded)
    return Speed(raw_bytes, coded_bytes, encode_s, decode_s)
