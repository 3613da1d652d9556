"""``kvsp bench codec``: per codec (kvsp_moq.kvsp.codecs), the compression ratio, encode and
decode MB/s on one core (:mod:`.speed`), and accuracy against raw on the reference model and on
the same model with outlier K channels (:mod:`.accuracy`). Every figure is named
``codec_<codec>_<figure>`` and stands beside the same figure of codec raw, same run.

| figure | unit | what |
|---|---|---|
| ``ratio`` | x | raw octets / coded octets (bf16 KV, 8 x 128 geometry) |
| ``encode``, ``decode`` | MB/s | raw octets coded / decoded per second, one core |
| ``logit_err`` | logit | max |logit - raw logit| over the teacher-forced decode steps |
| ``top1`` | fraction | decode steps whose argmax agrees with raw's |
| ``greedy`` | fraction | prompts whose greedy output equals raw's |

The accuracy figures carry the suffix ``_outliers`` for the outlier model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..report import Figure
from .accuracy import BF16_ROUNDING, evaluate, outlier_model, prompts, reference_model
from .speed import measure, sample_layers

__all__ = ["BENCH_CODECS", "accuracy_figures", "run", "speed_figures"]

BENCH_CODECS = ("fp8-e4m3", "int8", "zstd-planes")


def speed_figures(codecs: Sequence[str], *, blocks: int, block_tokens: int, repeat: int,
                  link_mbit: float) -> list[Figure]:
    """``ratio``, ``encode`` and ``decode`` of each codec beside raw's."""
    layers, geometry = sample_layers(blocks, block_tokens)
    raw = measure("raw", layers, geometry, repeat)
    link_mbps = link_mbit / 8
    layer_bytes = raw.raw_bytes / len(layers)
    figures = []
    for codec in codecs:
        got = measure(codec, layers, geometry, repeat)
        params: dict[str, object] = {
            "dtype": "bf16", "kv_heads": geometry.kv_heads, "head_dim": geometry.head_dim,
            "block_tokens": block_tokens, "layers": len(layers), "layer_bytes": int(layer_bytes),
            "cores": 1, "link_MBps": link_mbps,
            # A layer is sent in coded_bytes / link; coding keeps pace when it takes less.
            "link_ms_per_coded_layer": round(layer_bytes / got.ratio / link_mbps / 1e3, 4),
        }
        figures += [
            Figure(f"codec_{codec}_ratio", "x", got.ratio, "codec_raw_ratio", raw.ratio, params=params),
            Figure(f"codec_{codec}_encode", "MB/s", got.encode_mbps, "codec_raw_encode", raw.encode_mbps,
                   params={**params, "ms_per_layer": round(got.encode_s / len(layers) * 1e3, 4)}),
            Figure(f"codec_{codec}_decode", "MB/s", got.decode_mbps, "codec_raw_decode", raw.decode_mbps,
                   params={**params, "ms_per_layer": round(got.decode_s / len(layers) * 1e3, 4)}),
        ]
    return figures


def accuracy_figures(codecs: Sequence[str], *, prompt_count: int, prompt_blocks: int, block_tokens: int,
                     steps: int, new_tokens: int, outlier_scale: float) -> list[Figure]:
    """``logit_err``, ``top1`` and ``greedy`` of each codec beside raw's, on the reference
    model and (suffix ``_outliers``) on its outlier variant."""
    prompt_list = prompts(prompt_count, prompt_blocks * block_tokens + 1)
    figures = []
    for suffix, model in (("", reference_model()), ("_outliers", outlier_model(scale=outlier_scale))):
        results, context = evaluate(model, ("raw", *codecs, BF16_ROUNDING), prompt_list,
                                    block_tokens=block_tokens, steps=steps, new_tokens=new_tokens)
        raw, bf16 = results["raw"], results[BF16_ROUNDING]
        # For scale: the same figures for the KV rounded to bf16, the error engines accept.
        context |= {"bf16_logit_err": bf16.logit_err, "bf16_top1": bf16.top1, "bf16_greedy": bf16.greedy}
        for codec in codecs:
            got = results[codec]
            params: dict[str, object] = {
                "model": "kvsp-ref-tiny-1" + ("+outliers" if suffix else ""), "kv_dtype": "fp32",
                "prompt_tokens": prompt_blocks * block_tokens + 1, "block_tokens": block_tokens,
                "steps": steps, "prompts": prompt_count, "new_tokens": new_tokens,
                "kv_rel_err": float(f"{got.kv_rel_err:.4g}"),
                **({"outlier_scale": outlier_scale} if suffix else {}),
                **{k: float(f"{v:.4g}") for k, v in context.items()},
            }
            figures += [
                Figure(f"codec_{codec}_logit_err{suffix}", "logit", got.logit_err,
                       f"codec_raw_logit_err{suffix}", raw.logit_err, params=params),
                Figure(f"codec_{codec}_top1{suffix}", "fraction", got.top1,
                       f"codec_raw_top1{suffix}", raw.top1, params=params),
                Figure(f"codec_{codec}_greedy{suffix}", "fraction", got.greedy,
                       f"codec_raw_greedy{suffix}", raw.greedy, params=params),
            ]
    return figures


def run(*, codecs: Sequence[str] = BENCH_CODECS, prompt_count: int = 32, prompt_blocks: int = 2,
        block_tokens: int = 64, steps: int = 256, new_tokens: int = 32, speed_blocks: int = 4,
        repeat: int = 3, link_mbit: float = 1000.0, outlier_scale: float = 16.0) -> list[Figure]:
    """Every figure of ``kvsp bench codec`` (torch on one thread: the figures are per core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = speed_figures(codecs, blocks=speed_blocks, block_tokens=block_tokens, repeat=repeat,
                                link_mbit=link_mbit)
        figures += accuracy_figures(codecs, prompt_count=prompt_count, prompt_blocks=prompt_blocks,
                                    block_tokens=block_tokens, steps=steps, new_tokens=new_tokens,
                                    outlier_scale=outlier_scale)
    finally:
        torch.set_num_threads(threads)
    return figures

