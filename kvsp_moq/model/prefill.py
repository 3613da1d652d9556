"""What a prefill produces and what the layer-wise prefill needs from a model.

:class:`Prefill` is the result of :meth:`ReferenceModel.prefill
<kvsp_moq.model.transformer.ReferenceModel.prefill>` and of
:meth:`LayerwisePrefill.finish <kvsp_moq.model.layerwise.LayerwisePrefill.finish>`;
:class:`PrefillModel` is the part of the model that
:class:`~kvsp_moq.model.layerwise.LayerwisePrefill` drives one layer at a time (kvsp-draft
§4.3), so that module does not import the transformer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .cache import KVCache, LayerKV
from .config import ModelConfig

__all__ = ["Prefill", "PrefillModel", "TokenIds"]

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class Prefill:
    """The result of a prefill of T new tokens.

    ``logits``: ``[T, vocab]`` float32 (row i predicts the token after new token i);
    ``new_kv``: per layer the (K, V) of the new tokens ``[T, kv_heads, head_dim]`` (the
    tensors that were copied into the cache, not views of it); ``cache``: the prefix followed by the new tokens, ready for decoding.
    """

    logits: torch.Tensor
    new_kv: tuple[LayerKV, ...]
    cache: KVCache


class PrefillModel(Protocol):
    """The pieces of a model that a layer-wise prefill runs (the reference model has them)."""

    @property
    def config(self) -> ModelConfig: ...

    def token_tensor(self, token_ids: TokenIds) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor on the model's device."""
        ...

    def new_cache(self, capacity: int = 64) -> KVCache: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T, d_model]`` embeddings of token ids."""
        ...

    def forward_layer(self, layer: int, x: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, LayerKV]:
        """Run ``layer`` on ``x``, appending the new tokens' K and V to ``cache``."""
        ...

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, vocab]`` logits from the last layer's output."""
        ...
