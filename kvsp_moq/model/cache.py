"""The reference model's KV cache, held per layer in the layout of kvsp-draft §4.3.

Layer ``l`` holds K and V as ``[tokens, kv_heads, head_dim]`` float32 (``kv_dtype`` fp32,
§4.1), token index slowest: a token range of a layer *is* the content of a raw section
(kvsp-layout-1). K is stored after RoPE at its absolute position, as inference engines cache
it, so a block's K is only valid at the positions it was computed for — which its Block Key
(§4.2, a whole prefix) guarantees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .config import ModelConfig
from .errors import ModelError

__all__ = ["LayerKV", "KVCache", "check_layer_kv", "join_layer_kv", "resolve_device"]

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""(K, V) of one layer, each ``[tokens, kv_heads, head_dim]``."""

_DTYPE = torch.float32
_MIN_CAPACITY = 64


def resolve_device(device: Any = None) -> torch.device:
    """``cpu`` (None) or ``cuda[:i]`` with the index made explicit, so equal devices compare
    equal; ModelError for CUDA without a device, or another device type."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"device {dev} requested but CUDA is not available")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    raise ModelError(f"device {dev} is not supported (cpu or cuda)")


def check_layer_kv(config: ModelConfig, layer: int, k: object, v: object) -> int:
    """Check one layer's (K, V) against the config: float32 tensors shaped
    ``[n, kv_heads, head_dim]`` with the same n. Returns n; ModelError otherwise."""
    want = (config.kv_heads, config.head_dim)
    for name, t in (("K", k), ("V", v)):
        if not isinstance(t, torch.Tensor):
            raise ModelError(f"layer {layer}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != _DTYPE:
            raise ModelError(f"layer {layer}: {name} is {t.dtype}, the model's kv_dtype is fp32 "
                             f"(torch.float32); converting would change the cache")
        if t.ndim != 3 or tuple(t.shape[1:]) != want:
            raise ModelError(f"layer {layer}: {name} shape {tuple(t.shape)} is not "
                             f"[tokens, {want[0]}, {want[1]}] (kvsp-layout-1)")
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if k.shape[0] != v.shape[0]:
        raise ModelError(f"layer {layer}: K holds {k.shape[0]} tokens but V {v.shape[0]}")
    return int(k.shape[0])


def join_layer_kv(parts: Sequence[LayerKV]) -> LayerKV:
    """One layer's (K, V) of consecutive blocks joined in token order (e.g. the layer ``l``
    of each block's sink, first block first)."""
    if not parts:
        raise ModelError("join_layer_kv needs at least one (K, V)")
    if len(parts) == 1:
        return parts[0]
    return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])


class KVCache:
    """Per-layer K and V of one sequence on one device, grown in place as tokens are added.

    Layers may temporarily hold different token counts (a layer-wise prefill fills layer l
    before l + 1); :attr:`length` requires them to agree.
    """

    def __init__(self, config: ModelConfig, device: Any = None, capacity: int = _MIN_CAPACITY) -> None:
        self.config = config
        self.device = resolve_device(device)
        capacity = max(int(capacity), 1)
        shape = (capacity, config.kv_heads, config.head_dim)
        self._k = [torch.empty(shape, dtype=_DTYPE, device=self.device) for _ in range(config.layers)]
        self._v = [torch.empty(shape, dtype=_DTYPE, device=self.device) for _ in range(config.layers)]
        self._lengths = [0] * config.layers

    # -- construction from loaded buffers -------------------------------------------------------

    @classmethod
    def from_layers(cls, config: ModelConfig, layers: Sequence[LayerKV], device: Any = None) -> KVCache:
        """A prefix cache from one (K, V) per layer, e.g. the buffers of a layer sink
        (``TorchSink.layer(l)``) for layers 0..layers-1; the tensors are copied to ``device``."""
        if len(layers) != config.layers:
            raise ModelError(f"a prefix needs all {config.layers} layers, got {len(layers)}")
        counts = {check_layer_kv(config, l, k, v) for l, (k, v) in enumerate(layers)}
        if len(counts) != 1:
            raise ModelError(f"prefix layers hold different token counts {sorted(counts)}")
        cache = cls(config, device, capacity=max(counts.pop(), _MIN_CAPACITY))
        for l, (k, v) in enumerate(layers):
            cache.append(l, k, v)
        return cache

    @classmethod
    def from_blocks(cls, config: ModelConfig, blocks: Sequence[Sequence[LayerKV]], device: Any = None) -> KVCache:
        """A prefix cache from consecutive blocks: ``blocks[b][l]`` is (K, V) of layer ``l`` of
        block ``b`` (block 0 holds tokens 0..B-1, §4.2)."""
        if not blocks:
            return cls(config, device)
        layers = [join_layer_kv([block[l] for block in blocks]) for l in range(config.layers)]
        return cls.from_layers(config, layers, device)

    # -- access ---------------------------------------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.config.layers:
            raise ModelError(f"layer {layer!r} is outside 0..{self.config.layers - 1}")

    def layer_length(self, layer: int) -> int:
        self._check_layer(layer)
        return self._lengths[layer]

    @property
    def length(self) -> int:
        """Tokens held (every layer holds the same number)."""
        if len(set(self._lengths)) != 1:
            raise ModelError(f"layers hold different token counts {self._lengths} (prefill incomplete)")
        return self._lengths[0]

    def layer(self, layer: int) -> LayerKV:
        """Views of (K, V) of ``layer``: ``[tokens, kv_heads, head_dim]``."""
        n = self.layer_length(layer)
        return self._k[layer][:n], self._v[layer][:n]

    def tokens(self, start: int, end: int) -> list[LayerKV]:
        """Views of tokens ``[start, end)`` of every layer: one (K, V) per layer."""
        n = self.length
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise ModelError(f"token range [{start}, {end}) is outside the cache's [0, {n})")
        return [(self._k[l][start:end], self._v[l][start:end]) for l in range(self.config.layers)]

    # -- mutation -------------------------------------------------------------------------------

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add tokens to ``layer`` (copied to the cache's device)."""
        self._check_layer(layer)
        n = check_layer_kv(self.config, layer, k, v)
        start = self._lengths[layer]
        self._reserve(layer, start + n)
        self._k[layer][start : start + n].copy_(k)
        self._v[layer][start : start + n].copy_(v)
        self._lengths[layer] = start + n

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` tokens of every layer."""
        n = self.length
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= n:
            raise ModelError(f"cannot truncate a cache of {n} tokens to {tokens!r}")
        self._lengths = [tokens] * self.config.layers

    def _reserve(self, layer: int, needed: int) -> None:
        capacity = self._k[layer].shape[0]
        if needed <= capacity:
            return
        size = max(needed, 2 * capacity)
        for store in (self._k, self._v):
            grown = torch.empty((size, *store[layer].shape[1:]), dtype=_DTYPE, device=self.device)
            grown[: self._lengths[layer]].copy_(store[layer][: self._lengths[layer]])
            store[layer] = grown
