"""The Compatibility Descriptor (kvsp-draft §4.1) of the reference model.

``model_digest`` is computed over the weight files (``model.json`` and ``weights.bin``, in
ascending byte order of their names), ``tokenizer_digest`` over ``tokenizer.json``; geometry,
``kv_dtype`` fp32 and ``positional`` (RoPE with its theta stated explicitly, so no party relies
on a default) come from the config. ``adapters`` is absent: none is applied.
"""

from __future__ import annotations

from typing import Any

from ..kvsp.compat import make_descriptor, model_digest, tokenizer_digest
from ..kvsp.layout import LAYOUT
from .config import KV_DTYPE
from .errors import ModelError
from .weights import ModelFiles

__all__ = ["DEFAULT_BLOCK_TOKENS", "build_descriptor"]

#: Block size B in tokens (§4.2) when the caller does not choose one.
DEFAULT_BLOCK_TOKENS = 16


def build_descriptor(
    files: ModelFiles, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, model: str | None = None
) -> dict[str, Any]:
    """The descriptor of the model in ``files`` (a verified directory, see
    :func:`~kvsp_moq.model.weights.ensure_model_files`), validated with
    :func:`kvsp_moq.kvsp.compat.validate_descriptor`. ``model`` defaults to the config name."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ModelError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    config = files.config
    return make_descriptor(
        model=model if model is not None else config.name,
        model_digest=model_digest(files.weight_files),
        tokenizer_digest=tokenizer_digest(files.tokenizer_file),
        layers=config.layers,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        kv_dtype=KV_DTYPE,
        positional=config.positional,
        block_tokens=block_tokens,
        layout=LAYOUT,
    )
