"""Layer-wise prefill: compute layer l of the new tokens as soon as layer l of the prefix is
loaded (kvsp-draft §4.3: "The ascending layer order allows a receiver to start using layer l
as soon as it has been received, overlapping computation with loading").

Synchronous use — the caller provides layers in ascending order::

    lp = model.layerwise(new_ids, prefix_tokens=P)
    for l in range(model.config.layers):
        k, v = ...                      # layer l of the prefix, [P, kv_heads, head_dim]
        lp.step(l, k, v)                # computes layer l of the new tokens now
    result = lp.finish()                # logits + cache (prefix + new tokens)

Asynchronous use, e.g. over a layer sink (one block)::

    result = await lp.run(sink.wait_for_layer)

(several blocks: ``async def wait(l): return join_layer_kv([await s.wait_for_layer(l) for s in sinks])``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from .cache import LayerKV, check_layer_kv
from .errors import ModelError
from .prefill import Prefill, PrefillModel, TokenIds

__all__ = ["LayerwisePrefill", "WaitLayer"]

WaitLayer = Callable[[int], Awaitable[LayerKV]]
"""``await wait_layer(l)`` returns layer l's (K, V) of the prefix once it is loaded."""


class LayerwisePrefill:
    """The prefill of ``token_ids`` after a prefix of ``prefix_tokens`` tokens, driven one layer
    at a time. Produces exactly the logits and cache of ``model.prefill`` with a prefix cache
    holding the same buffers (same code path per layer)."""

    def __init__(self, model: PrefillModel, token_ids: TokenIds, prefix_tokens: int) -> None:
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ModelError(f"prefix_tokens must be an integer >= 0, got {prefix_tokens!r}")
        self.model = model
        self.prefix_tokens = prefix_tokens
        ids = model.token_tensor(token_ids)
        if ids.numel() == 0:
            raise ModelError("prefill needs at least one token")
        self.cache = model.new_cache(prefix_tokens + ids.numel())
        with torch.no_grad():
            self._x = model.embed(ids)
        self._next = 0
        self._new_kv: list[LayerKV] = []
        self._result: Prefill | None = None

    @property
    def next_layer(self) -> int:
        """The layer :meth:`step` expects next (== layers when all are computed)."""
        return self._next

    @property
    def computed_layers(self) -> tuple[int, ...]:
        """Layers of the new tokens computed so far (ascending)."""
        return tuple(range(self._next))

    @property
    def done(self) -> bool:
        return self._next == self.model.config.layers

    def step(self, layer: int, prefix_k: torch.Tensor | None, prefix_v: torch.Tensor | None) -> LayerKV:
        """Layer ``layer`` of the prefix is loaded: compute that layer of the new tokens now.

        ``prefix_k``/``prefix_v`` are ``[prefix_tokens, kv_heads, head_dim]`` float32 on any
        device (copied into the model's cache), or None when ``prefix_tokens`` is 0. Layers
        must come in ascending order (ModelError otherwise). Returns the new tokens' (K, V) of
        this layer, e.g. to publish it while later layers are still being computed.
        """
        if self.done:
            raise ModelError("all layers are computed already")
        if layer != self._next:
            raise ModelError(f"layers must be consumed in ascending order: expected layer "
                             f"{self._next}, got {layer!r}")
        if prefix_k is None and prefix_v is None:
            if self.prefix_tokens:
                raise ModelError(f"layer {layer}: the prefix holds {self.prefix_tokens} tokens, got none")
        else:
            n = check_layer_kv(self.model.config, layer, prefix_k, prefix_v)
            if n != self.prefix_tokens:
                raise ModelError(f"layer {layer}: prefix holds {n} tokens, expected {self.prefix_tokens}")
            assert prefix_k is not None and prefix_v is not None
            self.cache.append(layer, prefix_k, prefix_v)
        with torch.no_grad():
            self._x, kv = self.model.forward_layer(layer, self._x, self.cache)
        self._new_kv.append(kv)
        self._next += 1
        return kv

    def finish(self) -> Prefill:
        """The logits and the cache (prefix + new tokens), after the last layer."""
        if not self.done:
            raise ModelError(f"layer {self._next} is not computed yet")
        if self._result is None:
            with torch.no_grad():
                logits = self.model.head(self._x)
            self._result = Prefill(logits, tuple(self._new_kv), self.cache)
        return self._result

    async def run(self, wait_layer: WaitLayer) -> Prefill:
        """Drive every remaining layer: ``await wait_layer(l)`` then :meth:`step` it, in
        ascending order; returns :meth:`finish`. With a zero-token prefix nothing is awaited."""
        while not self.done:
            layer = self._next
            if self.prefix_tokens:
                k, v = await wait_layer(layer)
                self.step(layer, k, v)
            else:
                self.step(layer, None, None)
        return self.finish()
