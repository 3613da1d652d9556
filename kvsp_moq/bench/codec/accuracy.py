"""Accuracy of a codec against raw on the reference model (docs/model.md): the prompt's KV is
coded block by block (a container per block, as a holder would serve it), decoded, and the
model continues from it; the raw container of the same blocks is the baseline.

- ``logit_err``: the largest |logit(coded) - logit(raw)| over ``steps`` decode steps of one
  prompt, teacher-forced on the raw greedy continuation (both runs compute the same steps the
  same way, so raw against raw is exactly 0);
- ``top1``: the fraction of those steps whose argmax agrees with raw's;
- ``greedy``: the fraction of ``prompts`` prompts whose greedy output (``new_tokens`` tokens)
  equals raw's token for token.

Random weights flatter lossy codecs: their KV is near-Gaussian, with no outlier channels.
:func:`outlier_model` is the same model with the K projection of one rotary pair per KV head
scaled up by ``scale`` and the matching Q projection scaled down by it, so attention scores
and the model's output are unchanged (RoPE turns a pair as a whole) while its K cache has the
few large channels real LLMs have (KIVI, KVQuant: K outliers are per channel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...kvsp.codecs import decode_block, encode_block
from ...kvsp.codecs.elements import from_float32, to_float32
from ...kvsp.layout import Geometry
from ...model import KVCache, ModelConfig, ReferenceModel, Sampler, generate, model_geometry
from ...model.weights import Weights, generate_weights

__all__ = ["BF16_ROUNDING", "Accuracy", "evaluate", "outlier_model", "prompts", "reference_model"]

BF16_ROUNDING = "bf16-rounding"
"""Not a codec: the fp32 KV rounded to bf16 (the dtype engines store) and back, the error a
deployment already accepts; :func:`evaluate` takes it among the codecs, for context."""

_WORDS = (
    "the cache of a shared prompt prefix is stored in tiers and found through an index while "
    "relays fan one upstream copy out to many instances so that a request lands on warm blocks "
    "and decoding resumes after a failure with every layer verified before use"
).split()


def prompts(count: int, tokens: int, seed: int = 1) -> list[list[int]]:
    """``count`` prompts of ``tokens`` byte tokens each (BOS, then words in a seeded order)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        text = " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=tokens)).encode()
        out.append([256] + list(text[: tokens - 1]))
    return out


def reference_model(config: ModelConfig | None = None) -> ReferenceModel:
    """The reference model, its weights generated in memory (no files written)."""
    config = config or ModelConfig()
    return ReferenceModel(Weights(config, generate_weights(config)))


def outlier_model(config: ModelConfig | None = None, scale: float = 16.0) -> ReferenceModel:
    """:func:`reference_model` with one outlier rotary pair per KV head in its K cache (the
    lowest-frequency pair, dims D/2 - 1 and D - 1), ``scale`` times larger; the matching Q
    rows are divided by ``scale``, so q . k, and so the output, are unchanged."""
    c = config or ModelConfig()
    tensors = generate_weights(c)
    dims = [c.head_dim // 2 - 1, c.head_dim - 1]
    for layer in range(c.layers):
        wk = tensors[f"layers.{layer}.wk"].view(c.kv_heads, c.head_dim, -1)
        wq = tensors[f"layers.{layer}.wq"].view(c.heads, c.head_dim, -1)
        wk[:, dims] *= scale
        wq[:, dims] /= scale
    return ReferenceModel(Weights(c, tensors))


@dataclass(frozen=True)
class Accuracy:
    """One codec's figures on one model (see the module docstring)."""

    logit_err: float
    top1: float
    greedy: float
    kv_rel_err: float  # ||KV' - KV|| / ||KV|| over the coded blocks, K and V together


def _blocks_kv(cache: KVCache, tokens: int, block_tokens: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    out = []
    for start in range(0, tokens, block_tokens):
        layers = cache.tokens(start, start + block_tokens)
        out.append([(k.numpy().copy(), v.numpy().copy()) for k, v in layers])
    return out


def _through_codec(codec: str, blocks: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]],
                   geometry: Geometry) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    if codec == BF16_ROUNDING:
        return [[(to_float32(from_float32(k, "bf16"), "bf16"), to_float32(from_float32(v, "bf16"), "bf16"))
                 for k, v in block] for block in blocks]
    return [decode_block(encode_block(codec, list(block), geometry), geometry) for block in blocks]


def _cache(model: ReferenceModel, blocks: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]]) -> KVCache:
    tensors = [[(torch.from_numpy(np.array(k, dtype=np.float32)), torch.from_numpy(np.array(v, dtype=np.float32)))
                for k, v in block] for block in blocks]
    return KVCache.from_blocks(model.config, tensors, model.device)


def _rel_err(coded: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]],
             raw: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]]) -> float:
    num = den = 0.0
    for coded_block, raw_block in zip(coded, raw, strict=True):
        for (ck, cv), (rk, rv) in zip(coded_block, raw_block, strict=True):
            for c, r in ((ck, rk), (cv, rv)):
                num += float(np.sum((c.astype(np.float64) - r) ** 2))
                den += float(np.sum(r.astype(np.float64) ** 2))
    return (num / den) ** 0.5 if den else 0.0


def _greedy(model: ReferenceModel, prompt: list[int], cache: KVCache, new_tokens: int) -> list[int]:
    return [t.token_id for t in generate(model, prompt, Sampler.greedy(), new_tokens, cache=cache, stop_ids=())]


def evaluate(
    model: ReferenceModel,
    codecs: Sequence[str],
    prompt_list: Sequence[list[int]],
    *,
    block_tokens: int,
    steps: int,
    new_tokens: int,
) -> tuple[dict[str, Accuracy], dict[str, float]]:
    """Figures of each codec in ``codecs`` (include ``raw``: the baseline) on ``model``.

    Each prompt holds whole blocks and one token more (computed, as a request's tail is). The
    second value describes raw's logits over the teacher-forced steps: their standard deviation
    and the median gap between the best and second-best logit (what an error must reach to
    change a greedy token)."""
    geometry = model_geometry(model.config)
    coded_tokens = len(prompt_list[0]) - 1
    if coded_tokens <= 0 or coded_tokens % block_tokens:
        raise ValueError(f"prompts must hold whole blocks of {block_tokens} tokens and one more")
    raw_blocks = []
    for prompt in prompt_list:
        out = model.prefill(prompt[:coded_tokens])
        raw_blocks.append(_blocks_kv(out.cache, coded_tokens, block_tokens))
    coded = {codec: [_through_codec(codec, blocks, geometry) for blocks in raw_blocks] for codec in codecs}
    # Teacher-forced steps on prompt 0: raw's greedy continuation, then every codec's logits.
    first = prompt_list[0]
    reference = _greedy(model, first, _cache(model, coded["raw"][0]), steps)
    forced = [first[-1], *reference[:-1]]
    logits = {codec: model.prefill(forced, _cache(model, coded[codec][0])).logits for codec in codecs}
    raw_logits = logits["raw"]
    raw_greedy = [_greedy(model, p, _cache(model, coded["raw"][i]), new_tokens) for i, p in enumerate(prompt_list)]
    figures = {}
    for codec in codecs:
        err = float((logits[codec] - raw_logits).abs().max())
        top1 = float((logits[codec].argmax(dim=-1) == raw_logits.argmax(dim=-1)).double().mean())
        same = sum(_greedy(model, p, _cache(model, coded[codec][i]), new_tokens) == raw_greedy[i]
                   for i, p in enumerate(prompt_list))
        rel = float(np.mean([_rel_err(c, r) for c, r in zip(coded[codec], raw_blocks, strict=True)]))
        figures[codec] = Accuracy(err, top1, same / len(prompt_list), rel)
    top2 = raw_logits.topk(2, dim=-1).values
    context = {"raw_logit_std": float(raw_logits.std()),
               "raw_median_top1_gap": float((top2[:, 0] - top2[:, 1]).median())}
    return figures, context
