"""A tiny random-weight Llama and its WordLevel tokenizer, written locally (docs/vllm.md).

vLLM needs a Hugging Face model directory; the tests, ``kvsp demo --engine vllm`` and
``kvsp bench vllm`` use this one so nothing is downloaded. :func:`write_tiny_llama` writes
``config.json``, ``model.safetensors`` (weights from a fixed seed: the same bytes, so the same
``model_digest``, on every run), ``generation_config.json``, ``tokenizer.json`` (a ``tokenizers``
WordLevel model over the words ``w0`` .. ``w{vocab-4}`` split on whitespace) and
``tokenizer_config.json``. It needs ``torch``, ``transformers`` and ``tokenizers`` (all three come
with the ``vllm`` extra) and imports them only when called.

The geometry is that of the issue's measurements: 2 KV heads x head_dim 32 (4 query heads,
hidden 128). Weights are drawn with unit-variance activations in mind (a linear map
of fan-in n gets N(0, 1/n)); the output head is scaled by ``logit_gain`` so greedy decoding has
clear winners (near-uniform logits would let argmax hang on rounding).

:data:`LLAMA3_8B_LAYERS` is another shape: each layer is Llama-3-8B's (hidden 4096, 32 query
heads, 8 KV heads x head_dim 128, intermediate 14336), few of them and a small vocabulary, so
that per layer its KV bytes and FLOPs per token are Llama-3-8B's (``kvsp bench vllm --geometry
llama8b``).
``dtype`` is that of the saved weights: the draw is the same (float32, from the seed), then
cast; the default, float32, writes exactly the bytes it always did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LLAMA3_8B_LAYERS", "TinyLlama", "prompt_words", "write_tiny_llama", "write_tiny_lora"]

#: Special tokens at the start of the vocabulary.
SPECIAL_TOKENS = ("[UNK]", "<s>", "</s>")


@dataclass(frozen=True)
class TinyLlama:
    """The shape of the tiny model (defaults: what the tests and the demo use)."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 4096
    rope_theta: float = 10000.0
    logit_gain: float = 8.0
    seed: int = 15
    #: The saved weights' dtype (``config.json``'s ``torch_dtype``): float32 or bfloat16.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"TinyLlama.dtype: one of {', '.join(_DTYPE_BYTES)}, not {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, kv_dtype_bytes: int | None = None) -> int:
        """Octets of K and V per token over all layers, in the weights' dtype unless
        ``kv_dtype_bytes`` is given (an engine running another dtype)."""
        width = _DTYPE_BYTES[self.dtype] if kv_dtype_bytes is None else kv_dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * width


#: Octets per element of the dtypes the weights may be saved in.
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

#: Llama-3-8B's layer (hidden 4096, 32 query heads, 8 KV heads x 128, intermediate 14336) in
#: bf16, 2 of them and a 512-word vocabulary (module notes).
LLAMA3_8B_LAYERS = TinyLlama(layers=2, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=512,
                             dtype="bfloat16")


def _words(vocab: int) -> list[str]:
    return list(SPECIAL_TOKENS) + [f"w{i}" for i in range(vocab - len(SPECIAL_TOKENS))]


def prompt_words(token_ids: list[int], vocab: int = TinyLlama.vocab) -> str:
    """The text whose tokenization is ``token_ids`` (ids of plain words, >= 3)."""
    words = _words(vocab)
    return " ".join(words[t] for t in token_ids)


def write_tiny_llama(directory: str | Path, shape: TinyLlama = TinyLlama()) -> Path:
    """Write the model into ``directory`` (created; files already there are replaced) and
    return its path. Deterministic: the same ``shape`` gives the same bytes."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype=shape.dtype,
    )
    generator = torch.Generator().manual_seed(shape.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                scale = 1.0 if "embed" in name else param.shape[-1] ** -0.5
                if name.startswith("lm_head"):
                    scale *= shape.logit_gain
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    if shape.dtype != "float32":
        model = model.to(getattr(torch, shape.dtype))
    model.save_pretrained(out, safe_serialization=True)
    vocab = {w: i for i, w in enumerate(_words(shape.vocab))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "[UNK]",
        "model_max_length": shape.max_positions,
    }, indent=1) + "\n")
    return out


def write_tiny_lora(directory: str | Path, shape: TinyLlama = TinyLlama(), *, rank: int = 8, seed: int = 1,
                    scale: float = 0.5) -> Path:
    """A LoRA adapter for the tiny model in PEFT's format (``adapter_config.json``,
    ``adapter_model.safetensors``) on ``k_proj`` and ``v_proj``, so the KV it gives differs from
    the base model's from layer 0 on. Deterministic: the same arguments give the same bytes."""
    import torch
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    kv_out = shape.kv_heads * shape.head_dim
    tensors = {}
    for layer in range(shape.layers):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn((rank, shape.hidden), generator=generator) * shape.hidden ** -0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn((kv_out, rank), generator=generator) * scale * rank ** -0.5
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": ["k_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": None, "modules_to_save": None,
    }, indent=1) + "\n")
    return out
