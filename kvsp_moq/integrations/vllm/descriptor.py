"""The Compatibility Descriptor (kvsp-draft §4.1) of the model a vLLM engine runs.

Two engines may share KV only when everything that determines the KV bytes agrees; §4.1
lists what, and this module derives each member from the engine:

- ``model_digest``: SHA-256 over the weight files of the model directory (``*.safetensors``,
  else ``*.bin``), in ascending byte order of their names (:func:`~kvsp_moq.kvsp.compat.model_digest`);
- ``tokenizer_digest``: SHA-256 of ``tokenizer.json``;
- geometry: ``layers`` (``num_hidden_layers``), ``kv_heads`` (per tensor-parallel rank:
  what one engine's paged cache holds), ``head_dim``;
- ``kv_dtype``: the KV cache's element type (``cache_dtype``, or the model dtype for ``auto``);
- ``positional``: RoPE with ``theta`` stated (and the scaling type and factor when the config
  has them), so no party relies on a default;
- ``block_tokens``: vLLM's block size (one KVSP block = one vLLM block);
- ``layout``: ``kvsp-layout-1`` (the connector converts, :mod:`.layout`).

:func:`build_descriptor` takes plain values; :func:`descriptor_of_engine` reads them from a
``VllmConfig`` (duck-typed: no vLLM import here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...kvsp.compat import model_digest, tokenizer_digest, validate_descriptor
from ...kvsp.errors import DescriptorError
from ...kvsp.layout import LAYOUT

__all__ = ["build_descriptor", "descriptor_of_engine", "kv_dtype_name", "positional_of", "weight_files"]

#: torch dtype names (``str(torch.float32)`` without ``torch.``) -> §11.2 element types.
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16",
           "fp8": "fp8-e4m3", "fp8_e4m3": "fp8-e4m3", "fp8_e5m2": "fp8-e5m2"}


def weight_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a Hugging Face model directory (safetensors preferred)."""
    root = Path(model_dir)
    for pattern in ("*.safetensors", "*.bin"):
        files = sorted(p for p in root.glob(pattern) if p.is_file())
        if files:
            return files
    raise DescriptorError("model_digest", f"no *.safetensors or *.bin weight files in {root}")


def kv_dtype_name(cache_dtype: str, model_dtype: object) -> str:
    """The element type of the KV cache: ``cache_dtype`` unless ``auto``, else the model's."""
    name = str(model_dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    if name not in _DTYPES:
        raise DescriptorError("kv_dtype", f"KV cache dtype {name!r} has no KVSP element type")
    return _DTYPES[name]


def positional_of(hf_config: Any) -> str:
    """The ``positional`` member from a Hugging Face config (RoPE models)."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise DescriptorError("positional", "the model config states no rope_theta")
    text = f"rope;theta={float(theta):g}"
    kind = rope.get("rope_type") or rope.get("type")
    if kind and kind != "default":
        text += f";scaling={kind}"
        if rope.get("factor") is not None:
            text += f";factor={float(rope['factor']):g}"
        if rope.get("original_max_position_embeddings") is not None:
            text += f";original_max_position={int(rope['original_max_position_embeddings'])}"
    return text


def build_descriptor(model_dir: str | Path, *, model: str, layers: int, kv_heads: int, head_dim: int,
                     kv_dtype: str, positional: str, block_tokens: int) -> dict[str, Any]:
    """The validated descriptor document (a JSON object) of the model in ``model_dir``."""
    root = Path(model_dir)
    tokenizer = root / "tokenizer.json"
    if not tokenizer.is_file():
        raise DescriptorError("tokenizer_digest", f"no tokenizer.json in {root}")
    document: dict[str, Any] = {
        "model": model,
        "model_digest": model_digest(weight_files(root)),
        "tokenizer_digest": tokenizer_digest(tokenizer),
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_dtype": kv_dtype,
        "positional": positional,
        "block_tokens": block_tokens,
        "layout": LAYOUT,
    }
    validate_descriptor(document)
    return document


def descriptor_of_engine(vllm_config: Any, model_name: str | None = None) -> dict[str, Any]:
    """The descriptor of the engine's model (module notes), from a ``VllmConfig``."""
    mc = vllm_config.model_config
    model_dir = Path(mc.model)
    if not model_dir.is_dir():
        raise DescriptorError("model_digest", f"{mc.model} is not a local model directory: the digests "
                              "are computed over its files (download it first)")
    hf = mc.hf_text_config
    name = model_name or (mc.served_model_name if isinstance(mc.served_model_name, str) else None) or model_dir.name
    return build_descriptor(
        model_dir,
        model=name,
        layers=int(hf.num_hidden_layers),
        kv_heads=int(mc.get_num_kv_heads(vllm_config.parallel_config)),
        head_dim=int(mc.get_head_size()),
        kv_dtype=kv_dtype_name(str(vllm_config.cache_config.cache_dtype), mc.dtype),
        positional=positional_of(hf),
        block_tokens=int(vllm_config.cache_config.block_size),
    )
