"""The reference decoder-only transformer: prefill with an optional prefix cache, and decode.

Per layer l (pre-norm, Llama-style)::

    h  = x + Wo · attn(RoPE(Wq·n), RoPE(Wk·n), Wv·n)     n = RMSNorm(x)
    x' = h + SwiGLU(RMSNorm(h))

Every computation is float32, the cache's ``kv_dtype`` (kvsp-draft §4.1), so a prefix loaded
from a block feeds attention exactly the octets a recomputation would have produced.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from .cache import KVCache, LayerKV, resolve_device
from .config import ModelConfig
from .errors import ModelError
from .layerwise import LayerwisePrefill
from .ops import apply_rope, attention, rms_norm, rope_tables, swiglu
from .prefill import Prefill, TokenIds
from .tokenizer import ByteTokenizer
from .weights import ModelFiles, Weights, ensure_model_files, load_weights

__all__ = ["ReferenceModel"]


class ReferenceModel:
    """The model on one device (``cpu`` or ``cuda[:i]``) with weights loaded from files."""

    def __init__(self, weights: Weights, device: Any = None) -> None:
        self.config: ModelConfig = weights.config
        self.device = resolve_device(device)
        self.tokenizer = ByteTokenizer()
        self._w = {name: t.to(self.device) for name, t in weights.tensors.items()}

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str] | None = None,
        config: ModelConfig | None = None,
        device: Any = None,
    ) -> ReferenceModel:
        """Generate the files once if needed (:func:`ensure_model_files`), then load them."""
        return cls(load_weights(ensure_model_files(config, directory)), device)

    @classmethod
    def from_files(cls, files: ModelFiles, device: Any = None) -> ReferenceModel:
        return cls(load_weights(files), device)

    # -- inputs ---------------------------------------------------------------------------------

    def token_tensor(self, token_ids: TokenIds) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor on the model's device; ModelError if any id is
        outside the vocabulary."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.ndim != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise ModelError("token ids must be a 1-D integer tensor")
            ids = token_ids.to(device=self.device, dtype=torch.int64)
        else:
            values = list(token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in values):
                raise ModelError("token ids must be integers")
            ids = torch.tensor(values, dtype=torch.int64, device=self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ModelError(f"token ids must lie in [0, {self.config.vocab_size})")
        return ids

    def new_cache(self, capacity: int = 64) -> KVCache:
        return KVCache(self.config, self.device, capacity)

    def _check_cache(self, cache: KVCache) -> None:
        if cache.config != self.config:
            raise ModelError("the cache was made for another model config")
        if cache.device != self.device:
            raise ModelError(f"the cache is on {cache.device}, the model on {self.device}")

    # -- the pieces (also driven layer by layer by LayerwisePrefill) ----------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T, d_model]`` embeddings of token ids."""
        return F.embedding(ids, self._w["embed"])

    def forward_layer(self, layer: int, x: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, LayerKV]:
        """Run ``layer`` on the new tokens' activations ``x`` ``[T, d]``. Their positions start
        at the tokens the cache holds in that layer; their K and V are appended to it. Returns
        the layer output and the new tokens' (K, V)."""
        c, w = self.config, self._w
        p = f"layers.{layer}."
        t = x.shape[0]
        start = cache.layer_length(layer)
        positions = torch.arange(start, start + t, device=self.device)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
        n = rms_norm(x, w[p + "attn_norm"], c.norm_eps)
        q = apply_rope(F.linear(n, w[p + "wq"]).view(t, c.heads, c.head_dim), cos, sin)
        k = apply_rope(F.linear(n, w[p + "wk"]).view(t, c.kv_heads, c.head_dim), cos, sin)
        v = F.linear(n, w[p + "wv"]).view(t, c.kv_heads, c.head_dim)
        cache.append(layer, k, v)
        k_all, v_all = cache.layer(layer)
        h = x + F.linear(attention(q, k_all, v_all, start), w[p + "wo"])
        m = rms_norm(h, w[p + "mlp_norm"], c.norm_eps)
        out = h + swiglu(m, w[p + "w_gate"], w[p + "w_up"], w[p + "w_down"])
        return out, (k, v)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, vocab]`` logits from the last layer's output."""
        n = rms_norm(x, self._w["final_norm"], self.config.norm_eps)
        return F.linear(n, self._w["lm_head"], self._w["lm_head_bias"])

    # -- prefill and decode ---------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, token_ids: TokenIds, prefix: KVCache | None = None) -> Prefill:
        """Compute ``token_ids`` after the tokens of ``prefix`` (None: from position 0).

        ``prefix`` is extended in place with the new tokens' KV and returned as
        ``Prefill.cache``; build it from loaded blocks with :meth:`KVCache.from_layers` /
        :meth:`KVCache.from_blocks`.
        """
        ids = self.token_tensor(token_ids)
        if ids.numel() == 0:
            raise ModelError("prefill needs at least one token")
        cache = prefix if prefix is not None else self.new_cache(max(64, ids.numel()))
        self._check_cache(cache)
        _ = cache.length  # ModelError unless every layer holds the same tokens
        x = self.embed(ids)
        new_kv = []
        for layer in range(self.config.layers):
            x, kv = self.forward_layer(layer, x, cache)
            new_kv.append(kv)
        return Prefill(self.head(x), tuple(new_kv), cache)

    def decode(self, token_id: int, cache: KVCache) -> torch.Tensor:
        """One decode step: append ``token_id`` to ``cache`` and return the ``[vocab]`` logits
        of the next token."""
        return self.prefill([token_id], cache).logits[-1]

    def layerwise(self, token_ids: TokenIds, prefix_tokens: int) -> LayerwisePrefill:
        """A :class:`~kvsp_moq.model.layerwise.LayerwisePrefill` of ``token_ids`` after a
        prefix of ``prefix_tokens`` tokens whose layers arrive one by one."""
        return LayerwisePrefill(self, token_ids, prefix_tokens)
