"""Between the model's cache and the KV Block Container (kvsp-draft §4.3, codec raw,
kvsp-layout-1).

A block is tokens ``[a, b)`` (normally ``[i*B, (i+1)*B)``, §4.2) of every layer. Its raw
sections are the cache's ``[b-a, kv_heads, head_dim]`` float32 slices, C order, little-endian;
binding v1's object payload of layer l is K || V, whose SHA-256 is the layer digest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..kvsp.container import BytesLike, decode_container
from ..kvsp.layout import Geometry, decode_raw_layer, encode_raw_block, encode_raw_layer
from .cache import KVCache, LayerKV, check_layer_kv
from .config import KV_DTYPE, ModelConfig
from .errors import ModelError

__all__ = [
    "block_sections",
    "encode_block",
    "kv_from_container",
    "kv_from_sections",
    "layer_payload",
    "model_geometry",
]


def model_geometry(config: ModelConfig) -> Geometry:
    """The cache geometry of §4.1 (kv_heads, head_dim, kv_dtype fp32)."""
    return Geometry.from_descriptor_fields(config.kv_heads, config.head_dim, KV_DTYPE)


def _layer_range(config: ModelConfig, first: int, last: int | None) -> range:
    last = config.layers - 1 if last is None else last
    if not 0 <= first <= last < config.layers:
        raise ModelError(f"layer range {first}-{last} is outside 0-{config.layers - 1}")
    return range(first, last + 1)


def block_sections(
    cache: KVCache, start: int, end: int, first_layer: int = 0, last_layer: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(K, V) numpy arrays ``[end-start, kv_heads, head_dim]`` (little-endian float32, C
    order, host memory) of tokens ``[start, end)`` for layers first..last (default: all)."""
    if start >= end:
        raise ModelError(f"a block holds at least one token, got [{start}, {end})")
    layers = cache.tokens(start, end)
    out = []
    for layer in _layer_range(cache.config, first_layer, last_layer):
        k, v = layers[layer]
        out.append(tuple(t.detach().to("cpu").contiguous().numpy().astype("<f4", copy=False) for t in (k, v)))
    return out  # type: ignore[return-value]


def encode_block(
    cache: KVCache, start: int, end: int, first_layer: int = 0, last_layer: int | None = None
) -> bytes:
    """The KVB1 container (codec raw) of tokens ``[start, end)``, layers first..last."""
    sections = block_sections(cache, start, end, first_layer, last_layer)
    return encode_raw_block(sections, model_geometry(cache.config), first_layer)


def layer_payload(cache: KVCache, layer: int, start: int, end: int) -> bytes:
    """Binding v1 object payload of ``layer`` for tokens ``[start, end)``: K section || V
    section; its SHA-256 is the layer digest (§4.3)."""
    ((k, v),) = block_sections(cache, start, end, layer, layer)
    k_view, v_view = encode_raw_layer(k, v, model_geometry(cache.config))
    return bytes(k_view) + bytes(v_view)


def kv_from_sections(config: ModelConfig, layer: int, k: np.ndarray, v: np.ndarray, device: Any = None) -> LayerKV:
    """Torch (K, V) (copies, on ``device``) of one layer's decoded raw sections (the arrays of
    :func:`kvsp_moq.kvsp.layout.decode_raw_layer`)."""
    tensors = tuple(torch.from_numpy(np.array(a, dtype=np.float32)).to(device or "cpu") for a in (k, v))
    check_layer_kv(config, layer, *tensors)
    return tensors  # type: ignore[return-value]


def kv_from_container(config: ModelConfig, data: BytesLike, device: Any = None) -> list[LayerKV]:
    """(K, V) of every layer held by a codec-raw container, in ascending layer order (layer
    ``header.first_layer`` first)."""
    geometry = model_geometry(config)
    container = decode_container(data, geometry=geometry)
    tokens = container.header.token_count
    out: list[LayerKV] = []
    for view in container.layers():
        if view.index >= config.layers:
            raise ModelError(f"the container holds layer {view.index}; the model has {config.layers}")
        k, v = decode_raw_layer(view.k, view.v, geometry, tokens)
        out.append(kv_from_sections(config, view.index, k, v, device))
    return out
