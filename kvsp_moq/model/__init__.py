"""A small reference decoder-only transformer (torch) for the KVSP demo and for session
migration tests (docs/model.md).

- byte-level tokenizer with a definition file (``tokenizer_digest``, kvsp-draft §4.1);
- deterministic weights generated once from a seed into raw files (``model_digest``, §4.1);
- the Compatibility Descriptor of the model (§4.1);
- prefill/decode with a KV cache in the layout of §4.3, prefixes built from loaded buffers,
  and a layer-wise prefill that computes layer l as soon as layer l of the prefix is loaded;
- greedy and top-p samplers restorable from (method, params, seed, step) (§6.8).

Imports ``kvsp_moq.kvsp``, numpy and torch.
"""

from .blocks import (
    block_sections,
    encode_block,
    kv_from_container,
    kv_from_sections,
    layer_payload,
    model_geometry,
)
from .cache import KVCache, LayerKV, check_layer_kv, join_layer_kv
from .config import DEFAULT_MODEL_NAME, KV_DTYPE, ModelConfig
from .descriptor import DEFAULT_BLOCK_TOKENS, build_descriptor
from .errors import ModelError, SamplerError, TokenizerError, WeightsError
from .generate import GeneratedToken, generate
from .layerwise import LayerwisePrefill, WaitLayer
from .sampler import GREEDY, TOP_P, Sampler, SamplerState
from .tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from .prefill import Prefill, PrefillModel, TokenIds
from .transformer import ReferenceModel
from .weights import (
    ModelFiles,
    Weights,
    default_model_dir,
    ensure_model_files,
    generate_weights,
    load_weights,
)

__all__ = [
    "BOS_ID",
    "ByteTokenizer",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_MODEL_NAME",
    "EOS_ID",
    "GREEDY",
    "GeneratedToken",
    "KVCache",
    "KV_DTYPE",
    "LayerKV",
    "LayerwisePrefill",
    "ModelConfig",
    "ModelError",
    "ModelFiles",
    "Prefill",
    "PrefillModel",
    "ReferenceModel",
    "Sampler",
    "SamplerError",
    "SamplerState",
    "TOP_P",
    "TokenIds",
    "TokenizerError",
    "WaitLayer",
    "Weights",
    "WeightsError",
    "block_sections",
    "build_descriptor",
    "check_layer_kv",
    "default_model_dir",
    "encode_block",
    "ensure_model_files",
    "generate",
    "generate_weights",
    "join_layer_kv",
    "kv_from_container",
    "kv_from_sections",
    "layer_payload",
    "load_weights",
    "model_geometry",
]
