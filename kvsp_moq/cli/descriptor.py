"""``kvsp descriptor``: the Compatibility Descriptor (kvsp-draft §4.1) a vLLM engine running the
KVSP connector derives for a local model, without starting the engine.

Holders (``[holder] descriptors``) and relays (``--transcode-descriptor``) transcode only the
blocks of descriptors they are given (§6.7, docs/binding.md §13), so an operator needs the
engine's descriptor before the engine runs. It is computed by the connector's own
:class:`~kvsp_moq.integrations.vllm.descriptor.EngineModel` from what vLLM would read: the
model directory's ``config.json`` (layers, KV heads, head dimension, RoPE), its weight files
and tokenizer (their digests), and the engine's settings that change the KV's bytes (the
served model name, ``--dtype``, ``--kv-cache-dtype``, the KVSP block size, the
tensor-parallel size and rank: each rank's blocks have their own descriptor, §4.1 "a replica
names all that makes its bytes differ"). The descriptor goes to stdout as JSON, its
Compatibility ID to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..integrations.vllm.descriptor import EngineModel, adapter_digest, kv_dtype_name, positional_of
from ..kvsp.compat import compat_id
from ..kvsp.errors import KvspError
from .errors import UsageError

__all__ = ["register"]


def _config(model: Path) -> dict[str, Any]:
    path = model / "config.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{model}: no config.json (give a local model directory)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: not a JSON object")
    return doc.get("text_config", doc) if isinstance(doc.get("text_config"), dict) else doc


def _int(config: dict[str, Any], key: str, model: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{model}/config.json: {key} is {value!r}, not a positive integer")
    return value


def engine_model(args: argparse.Namespace) -> EngineModel:
    """The :class:`EngineModel` vLLM's config would give (``EngineModel.of``), from the files."""
    model = Path(args.model)
    config = _config(model)
    heads = _int(config, "num_attention_heads", model)
    kv_heads = _int(config, "num_key_value_heads", model) if "num_key_value_heads" in config else heads
    head_dim = _int(config, "head_dim", model) if config.get("head_dim") else \
        _int(config, "hidden_size", model) // heads
    dtype = args.dtype or config.get("torch_dtype") or config.get("dtype")
    if args.kv_cache_dtype == "auto" and dtype in (None, "float32") and not args.dtype:
        raise UsageError(f"{model}/config.json states dtype {dtype!r}: give the engine's --dtype "
                         "(vLLM's 'auto' does not run every model in its checkpoint's dtype)")
    positional, extra = positional_of(SimpleNamespace(**config), head_dim)
    return EngineModel(model_dir=model, name=args.name or args.model, tokenizer=args.tokenizer or model,
                       layers=_int(config, "num_hidden_layers", model), total_kv_heads=kv_heads,
                       head_dim=head_dim, kv_dtype=kv_dtype_name(args.kv_cache_dtype, dtype),
                       positional=positional, positional_extra=extra, block_tokens=args.block_tokens,
                       world_size=args.tensor_parallel_size)


def cmd_descriptor(args: argparse.Namespace) -> int:
    if args.block_tokens <= 0:
        raise UsageError("--block-tokens must be a positive number of tokens")
    if not 0 <= args.rank < args.tensor_parallel_size:
        raise UsageError(f"--rank must be in [0, {args.tensor_parallel_size}) for --tensor-parallel-size "
                         f"{args.tensor_parallel_size}")
    try:
        adapters = [adapter_digest(path) for path in args.adapter] if args.adapter else None
        doc = engine_model(args).descriptor(args.rank, adapters)
        cid = compat_id(doc).hex()
    except KvspError as exc:
        raise UsageError(f"{args.model}: {exc}") from None
    print(json.dumps(doc, indent=2, sort_keys=True))
    print(f"compat_id {cid}", file=sys.stderr)
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("descriptor", help="print the Compatibility Descriptor a vLLM engine derives for a "
                                          "local model (§4.1), for holders and relays that transcode")
    p.add_argument("model", help="the local model directory, as given to vLLM (its path is the served "
                                 "model name unless --name)")
    p.add_argument("--name", help="vLLM's --served-model-name, where the engine sets one")
    p.add_argument("--tokenizer", help="vLLM's --tokenizer (a local directory or tokenizer.json), "
                                       "where it differs from the model's")
    p.add_argument("--dtype", help="vLLM's --dtype (default: config.json's torch_dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (default auto: the "
                                                            "model's dtype)")
    p.add_argument("--block-tokens", type=int, required=True,
                   help="the connector's block_tokens (default there: vLLM's --block-size)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0, help="the tensor-parallel rank whose descriptor to print")
    p.add_argument("--adapter", action="append", metavar="DIR",
                   help="a LoRA adapter's local directory, in the order the request applies them; "
                        "repeat for several")
    p.set_defaults(handler=cmd_descriptor)
