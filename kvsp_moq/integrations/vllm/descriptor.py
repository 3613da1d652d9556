"""The Compatibility Descriptor (kvsp-draft §4.1) of the model a vLLM engine runs.

Two engines may share KV only when everything that determines the KV bytes agrees (DESIGN.md
§9: "a replica names everything that makes its bytes differ"); §4.1 lists what, and this
module derives each member from the engine:

- ``model_digest``: SHA-256 over the weight files of the model directory (``*.safetensors``,
  else ``*.bin``), in ascending byte order of their names, computed once per host
  (:mod:`.digest_cache`);
- ``tokenizer_digest``: SHA-256 of ``tokenizer.json`` of the tokenizer the engine is
  configured with (``--tokenizer``; the model directory when none is named);
- ``adapters`` (per request): the digest of the LoRA adapter's weight files, computed like
  ``model_digest``; absent without an adapter (§4.1: never an empty array);
- geometry: ``layers``, ``kv_heads`` (per tensor-parallel rank: what one worker's paged cache
  holds), ``head_dim``;
- ``kv_dtype``: the KV cache's element type (``cache_dtype``, or the model dtype for ``auto``);
- ``positional``: RoPE in the one canonical text every producer uses
  (:func:`~kvsp_moq.kvsp.registries.format_positional`: ``theta`` always stated, ``dim`` for a
  partial rotary, ``scaling``/``factor``/``original_max_position`` when the model runs scaled);
- ``block_tokens``: the connector's ``block_tokens`` (default vLLM's block size; a KVSP block is
  a whole number of vLLM's blocks, its pages);
- ``layout``: ``kvsp-layout-1`` (the connector converts, :mod:`.layout`).

Members beyond §4.1's (docs/decisions/0002: unknown members are part of the identity):

- ``tensor_parallel`` (only when the engine runs tensor-parallel): ``{"rank", "world_size",
  "kv_heads": [first, end)}`` — the shard a rank holds. Ranks hold different heads, and the
  same heads computed at another parallel size differ in their last bits (the all-reduce sums
  in another order), so each rank's blocks have a Compatibility ID of their own and a rank can
  never load another rank's heads (docs/binding.md "Tensor parallelism").
- ``positional_extra``: RoPE parameters the registry has no syntax for (Llama 3.1's
  ``low_freq_factor``, YaRN's ``beta_fast``...), exactly as the model's config states them.
- ``kv_scales`` (fp8 KV caches only): ``sha-256:`` over each layer's K and V scale (float32
  little-endian, layer by layer: k0 v0 k1 v1 ...) that the fp8 elements are quantized with.
  The same fp8 bits mean other values under other scales, so the scales are part of the
  identity; the descriptor states the checkpoint's (``*.layers.N.*k_scale`` / ``v_scale``
  tensors, 1.0 where it has none, as vLLM does) and each worker checks, once its layers exist,
  that the scales it really runs with are those (:func:`kv_scales_digest`; a worker whose
  scales differ shares nothing).

:class:`EngineModel` reads all of it from a ``VllmConfig`` once (duck-typed: no vLLM import
here) and gives the descriptor of any rank and adapter.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...kvsp.compat import make_descriptor, tokenizer_digest
from ...kvsp.errors import DescriptorError
from ...kvsp.layout import LAYOUT
from ...kvsp.registries import format_positional
from .digest_cache import files_digest

__all__ = ["EngineModel", "Shard", "adapter_digest", "build_descriptor", "checkpoint_kv_scales", "kv_dtype_name",
           "kv_scales_digest", "positional_of", "shard_of", "weight_files"]

#: torch dtype names (``str(torch.float32)`` without ``torch.``) -> §11.2 element types.
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16",
           "fp8": "fp8-e4m3", "fp8_e4m3": "fp8-e4m3", "fp8_e5m2": "fp8-e5m2"}

#: Hugging Face ``rope_type`` -> the registry's ``scaling`` (``default``: no scaling).
_ROPE_SCALING = {"linear": "linear", "dynamic": "ntk", "ntk": "ntk", "yarn": "yarn", "llama3": "llama3"}

#: RoPE members carried by ``positional`` itself (the rest go to ``positional_extra``).
_ROPE_CONSUMED = frozenset({"rope_theta", "rope_type", "type", "factor", "original_max_position_embeddings",
                            "partial_rotary_factor"})


def weight_files(model_dir: str | Path, *, member: str = "model_digest") -> list[Path]:
    """The weight files of a Hugging Face model or adapter directory (safetensors preferred)."""
    root = Path(model_dir)
    for pattern in ("*.safetensors", "*.bin"):
        files = sorted(p for p in root.glob(pattern) if p.is_file())
        if files:
            return files
    raise DescriptorError(member, f"no *.safetensors or *.bin weight files in {root}")


def adapter_digest(adapter_dir: str | Path) -> str:
    """An ``adapters`` entry (§4.1, "in the same form as model_digest"): SHA-256 over the
    adapter's weight files in ascending byte order of their names (cached per host)."""
    root = Path(adapter_dir)
    if not root.is_dir():
        raise DescriptorError("adapters", f"LoRA adapter {adapter_dir} is not a local directory: its digest "
                              "is computed over its files")
    return files_digest(weight_files(root, member="adapters"))


def kv_dtype_name(cache_dtype: str, model_dtype: object) -> str:
    """The element type of the KV cache: ``cache_dtype`` unless ``auto``, else the model's."""
    name = str(model_dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    if name not in _DTYPES:
        raise DescriptorError("kv_dtype", f"KV cache dtype {name!r} has no KVSP element type")
    return _DTYPES[name]


def _rope_of(hf_config: Any) -> dict[str, Any]:
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(rope, Mapping):
        raise DescriptorError("positional", f"the model config's RoPE parameters are not an object: {rope!r}")
    if rope and all(isinstance(v, Mapping) for v in rope.values()):
        # Per-layer-type parameters (Gemma 3's full and sliding attention): not one encoding.
        raise DescriptorError("positional", "RoPE parameters per layer type are not describable "
                              f"in one positional member ({sorted(rope)})")
    return dict(rope)


def positional_of(hf_config: Any, head_dim: int | None = None) -> tuple[str, dict[str, Any] | None]:
    """The ``positional`` member from a Hugging Face config (RoPE models), in the canonical
    text (:func:`~kvsp_moq.kvsp.registries.format_positional`), and the ``positional_extra``
    member (RoPE parameters the registry has no syntax for; None when there are none)."""
    rope = _rope_of(hf_config)
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise DescriptorError("positional", "the model config states no rope_theta")
    params: dict[str, object] = {"theta": float(theta)}
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        if head_dim is None:
            raise DescriptorError("positional", "a partial rotary needs the head dimension")
        params["dim"] = int(head_dim * float(partial))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        scaling = _ROPE_SCALING.get(str(kind))
        if scaling is None:
            raise DescriptorError("positional", f"RoPE scaling {kind!r} is not in the registry "
                                  f"({', '.join(sorted(set(_ROPE_SCALING.values())))}): not shared")
        params["scaling"] = scaling
        if rope.get("factor") is not None:
            params["factor"] = float(rope["factor"])
        if rope.get("original_max_position_embeddings") is not None:
            params["original_max_position"] = int(rope["original_max_position_embeddings"])
    try:
        text = format_positional("rope", params)
    except ValueError as exc:
        raise DescriptorError("positional", str(exc)) from None
    extra = {str(k): v for k, v in sorted(rope.items()) if k not in _ROPE_CONSUMED and v is not None}
    return text, (extra or None)


@dataclass(frozen=True)
class Shard:
    """The tensor-parallel shard one rank's paged cache holds: KV heads ``[first, first + kv_heads)``
    of the model's, at parallel size ``world_size``."""

    rank: int
    world_size: int
    first: int
    kv_heads: int

    def member(self) -> dict[str, Any]:
        """The descriptor's ``tensor_parallel`` member (module notes)."""
        return {"rank": self.rank, "world_size": self.world_size, "kv_heads": [self.first, self.first + self.kv_heads]}


def shard_of(total_kv_heads: int, world_size: int, rank: int) -> Shard:
    """The KV heads rank ``rank`` of ``world_size`` holds, as vLLM splits them: consecutive
    ranges when there are at least as many heads as ranks, else each head replicated on
    ``world_size // total_kv_heads`` consecutive ranks."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DescriptorError("tensor_parallel", f"rank {rank} is not in a world of {world_size}")
    if total_kv_heads >= world_size:
        if total_kv_heads % world_size:
            raise DescriptorError("tensor_parallel", f"{total_kv_heads} KV heads do not split over {world_size} ranks")
        per = total_kv_heads // world_size
        return Shard(rank, world_size, rank * per, per)
    if world_size % total_kv_heads:
        raise DescriptorError("tensor_parallel", f"{world_size} ranks do not replicate {total_kv_heads} KV heads evenly")
    return Shard(rank, world_size, rank // (world_size // total_kv_heads), 1)


def build_descriptor(*, model: str, model_digest: str, tokenizer_digest: str, layers: int, kv_heads: int,
                     head_dim: int, kv_dtype: str, positional: str, block_tokens: int,
                     adapters: Sequence[str] | None = None, shard: Shard | None = None,
                     positional_extra: Mapping[str, Any] | None = None,
                     kv_scales: str | None = None) -> dict[str, Any]:
    """The validated descriptor document (a JSON object), written by the one formatter the
    reference model uses too (:func:`~kvsp_moq.kvsp.compat.make_descriptor`). ``shard`` is
    named only when the engine is tensor-parallel (a world of one describes the whole model,
    as §4.1 does)."""
    extensions: dict[str, Any] = {}
    if positional_extra:
        extensions["positional_extra"] = dict(positional_extra)
    if shard is not None and shard.world_size > 1:
        extensions["tensor_parallel"] = shard.member()
    if kv_scales is not None:
        extensions["kv_scales"] = kv_scales
    elif kv_dtype.startswith("fp8"):
        raise DescriptorError("kv_scales", "an fp8 KV cache's descriptor states its scales")
    return make_descriptor(model=model, model_digest=model_digest, tokenizer_digest=tokenizer_digest, layers=layers,
                           kv_heads=kv_heads, head_dim=head_dim, kv_dtype=kv_dtype, positional=positional,
                           block_tokens=block_tokens, layout=LAYOUT, adapters=adapters, extensions=extensions)


_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\..*?(k_scale|v_scale)$")


def kv_scales_digest(scales: Sequence[tuple[float, float]]) -> str:
    """The ``kv_scales`` member (module notes) of per-layer ``(k_scale, v_scale)``."""
    packed = b"".join(struct.pack("<ff", k, v) for k, v in scales)
    return "sha-256:" + hashlib.sha256(packed).hexdigest()


def checkpoint_kv_scales(files: Sequence[Path], layers: int) -> list[tuple[float, float]]:
    """Each layer's ``(k_scale, v_scale)`` as the checkpoint states them (``*.layers.N.*k_scale``
    and ``v_scale`` scalar tensors of its safetensors files), 1.0 where it states none."""
    scales = [[1.0, 1.0] for _ in range(layers)]
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    if not safetensors:
        return [(k, v) for k, v in scales]
    from safetensors import safe_open  # comes with vLLM (and transformers)

    for file in safetensors:
        try:
            with safe_open(str(file), framework="pt") as f:
                found_scales = [(m, f.get_tensor(name)) for name in f.keys()
                                if (m := _SCALE_NAME.search(name)) and int(m.group(1)) < layers]
        except Exception as exc:  # safetensors' own error types: the file is not one
            raise DescriptorError("kv_scales", f"cannot read the KV scales of {file}: {exc}") from None
        for found, value in found_scales:
            if value.numel() != 1:
                raise DescriptorError("kv_scales", f"{found.group(0)} is not one scale per layer "
                                      f"({tuple(value.shape)}); per-head KV scales are not supported")
            scales[int(found.group(1))][0 if found.group(2) == "k_scale" else 1] = float(value.item())
    return [(k, v) for k, v in scales]


def _tokenizer_file(tokenizer: str | Path) -> Path:
    path = Path(tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DescriptorError("tokenizer_digest", f"no tokenizer.json at {tokenizer} (the engine's tokenizer "
                              "must be a local directory or file: its digest is computed over it)")
    return file


class EngineModel:
    """What a vLLM engine's KV depends on, read once from its ``VllmConfig`` (module notes);
    :meth:`descriptor` gives the descriptor of any rank and adapter."""

    def __init__(self, *, model_dir: str | Path, name: str, tokenizer: str | Path, layers: int, total_kv_heads: int,
                 head_dim: int, kv_dtype: str, positional: str, positional_extra: Mapping[str, Any] | None,
                 block_tokens: int, world_size: int = 1, page_tokens: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.name = name
        self.layers = layers
        self.total_kv_heads = total_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.positional = positional
        self.positional_extra = dict(positional_extra) if positional_extra else None
        #: B of the Block Keys (a KVSP block) and vLLM's block size (a page of the paged cache);
        #: a KVSP block is ``block_tokens // page_tokens`` pages.
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens or block_tokens
        if self.block_tokens % self.page_tokens:
            raise DescriptorError("block_tokens", f"{block_tokens} tokens is not a whole number of vLLM's "
                                  f"{self.page_tokens}-token blocks")
        self.world_size = world_size
        files = weight_files(self.model_dir)
        self.model_digest = files_digest(files)
        self.tokenizer_digest = tokenizer_digest(_tokenizer_file(tokenizer))
        #: fp8 only: the scales the checkpoint states (each worker checks its own against them).
        self.kv_scales = kv_scales_digest(checkpoint_kv_scales(files, layers)) if kv_dtype.startswith("fp8") else None

    @classmethod
    def of(cls, vllm_config: Any, model_name: str | None = None, block_tokens: int | None = None) -> EngineModel:
        """``block_tokens``: the KVSP block size (default: vLLM's block size, which it must be a
        multiple of)."""
        mc = vllm_config.model_config
        model_dir = Path(mc.model)
        if not model_dir.is_dir():
            raise DescriptorError("model_digest", f"{mc.model} is not a local model directory: the digests "
                                  "are computed over its files (download it first)")
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
            raise DescriptorError("layers", "pipeline parallelism splits the layers over engines; the KVSP "
                                  "connector shares whole blocks of every layer (not supported)")
        hf = mc.hf_text_config
        head_dim = int(mc.get_head_size())
        positional, extra = positional_of(hf, head_dim)
        name = model_name or (mc.served_model_name if isinstance(mc.served_model_name, str) else None) or model_dir.name
        return cls(model_dir=model_dir, name=name, tokenizer=getattr(mc, "tokenizer", None) or model_dir,
                   layers=int(hf.num_hidden_layers), total_kv_heads=int(mc.get_total_num_kv_heads()),
                   head_dim=head_dim,
                   kv_dtype=kv_dtype_name(str(vllm_config.cache_config.cache_dtype), mc.dtype),
                   positional=positional, positional_extra=extra,
                   block_tokens=block_tokens or int(vllm_config.cache_config.block_size),
                   page_tokens=int(vllm_config.cache_config.block_size),
                   world_size=int(getattr(parallel, "tensor_parallel_size", 1)))

    def shard(self, rank: int) -> Shard:
        return shard_of(self.total_kv_heads, self.world_size, rank)

    def descriptor(self, rank: int = 0, adapters: Sequence[str] | None = None) -> dict[str, Any]:
        """The descriptor of rank ``rank``'s blocks under ``adapters`` (digests, in order)."""
        shard = self.shard(rank)
        return build_descriptor(model=self.name, model_digest=self.model_digest,
                                tokenizer_digest=self.tokenizer_digest, layers=self.layers,
                                kv_heads=shard.kv_heads, head_dim=self.head_dim, kv_dtype=self.kv_dtype,
                                positional=self.positional, block_tokens=self.block_tokens, adapters=adapters,
                                shard=shard, positional_extra=self.positional_extra, kv_scales=self.kv_scales)
