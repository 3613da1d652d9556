"""``kvsp demo --engine vllm --disagg --decoders N``: prefill→decode over MOQT through the relay.

On loopback (``.engines``): the Index Service, the MOQT relay and an HTTP holder; one prefill
engine (``kv_producer``) and N decode engines (``kv_consumer``), vLLM's CPU build serving the
tiny Llama, each with the KVSP connector; the router (:mod:`kvsp_moq.control.router`)
on loopback HTTP in front of them. The prefill engine prefills in chunks of
:data:`CHUNK_TOKENS` tokens (vLLM's ``max_num_batched_tokens``: a long prompt takes several
forward passes, as on a GPU with chunked prefill).

1. every engine answers a short warm-up with the connector off (first-call costs out of the
   timings); the prefill engine computes each prompt alone with the connector off: the single
   engine's greedy output every decoder must match;
2. each prompt is POSTed to the router (``/v1/completions``, token ids): it sends it to the
   prefill engine (one token, the stream's producer) and, at the same time, to all N decode
   engines (the stream's consumers); the prefill engine publishes each layer of each block as
   its forward pass computes it, the relay fans it out to the N decoders, each verifies every
   layer before placing it and starts decoding once every block is in.

The report (stdout; ``--json``: one object) has, per prompt and decoder, ``outputs_match``,
``layers_received``, ``layers_received_before_prefill_finished`` (layers verified before the
end of a forward pass of the prefill engine for the prompt that was not its last: the last
one's end is reported with the request's own end, so this is a lower bound of the layers in
before the prefill finished), the decode TTFT (from the decoder's receipt of the request) and
the overlap (from the prefill engine's token, the end of its prefill, to the decoder's first
token) — CLOCK_MONOTONIC marks of the engines' processes on this host; and the relay's
counters (objects in from the prefill engine, objects out to the decoders). Exit 0 only if
every output matched and every decoder had layers before the prefill finished.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any

from ...control.http.server import serve_app
from ...control.router import DisaggRouter
from ...control.router.routes import make_app
from ...integrations.vllm.router import ProcessEngine
from ...integrations.vllm.tiny_model import TinyLlama
from .cluster import http_request
from .engines import BLOCK_TOKENS, VllmPlane
from .vllm import prompt_tokens, run_reported, vllm_version

__all__ = ["CHUNK_TOKENS", "cmd_demo_disagg", "decoder_line", "run_disagg"]

#: The prefill engine's token budget per forward pass (its chunked prefill).
CHUNK_TOKENS = 256
#: The prompts: 24 full blocks and a tail; distinct, so that no block is in any cache.
PROMPT_TOKENS = 24 * BLOCK_TOKENS + 17
PROMPTS = 2
MAX_TOKENS = 16
WARMUP_TOKENS = 40
#: The tiny Llama with more layers than the tests' (a forward pass long enough to stream in).
SHAPE = TinyLlama(layers=8)


def decoder_line(decoder: dict[str, Any], reference: list[int], prefill_end_ns: int | None,
                 prefill_token_ns: int | None = None) -> dict[str, Any]:
    """One decoder's answer to one routed prompt, judged (module notes): ``prefill_end_ns``,
    the end of the prefill's last reported forward pass; ``prefill_token_ns``, its token."""
    kvsp = decoder.get("kvsp", {})
    arrived = [int(t) for t in kvsp.get("layer_ns", [])]
    first_token_ns = decoder.get("first_token_ns")
    before = sum(1 for t in arrived if prefill_end_ns is not None and t < prefill_end_ns)
    return {
        "engine": decoder["engine"],
        "error": decoder.get("error"),
        "outputs_match": decoder.get("token_ids") == reference,
        "blocks_streamed": int(kvsp.get("blocks_streamed", 0)),
        "blocks_failed": int(kvsp.get("blocks_failed", 0)),
        "layers_received": len(arrived),
        "layers_received_before_prefill_finished": before,
        "decode_ttft_ms": decoder.get("ttft_ms"),
        "overlap_ms": round((int(first_token_ns) - prefill_token_ns) / 1e6, 3)
        if first_token_ns is not None and prefill_token_ns is not None else None,
        "token_ids": decoder.get("token_ids"),
    }


def _relay_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    keys = ("objects_in", "objects_out", "subscribes", "upstream_subscribes", "fetches", "upstream_fetches")
    return {k: int(after.get(f"relay_{k}_total", 0) - before.get(f"relay_{k}_total", 0)) for k in keys}


def run_disagg(plane: VllmPlane, model_dir: str | None, decoders: int, dtype: str = "float32") -> dict[str, Any]:
    """The scenario (module notes) on a started ``plane``; the report."""
    if not 1 <= decoders <= 3:
        raise ValueError("--decoders: 1 to 3")
    started = time.perf_counter()
    plane.start_plane()
    model, vocab = plane.model(model_dir, SHAPE)
    prefill = plane.start_engine("prefill", plane.kvsp_spec(model, "engine-a", dtype=dtype, kv_role="kv_producer",
                                                            max_num_batched_tokens=CHUNK_TOKENS))
    decode = [plane.start_engine(f"decode {i + 1}", plane.kvsp_spec(model, f"engine-{'bcd'[i]}", dtype=dtype,
                                                                     kv_role="kv_consumer"))
              for i in range(decoders)]
    plane.progress(f"engines        starting 1 prefill and {decoders} decode engines in parallel "
                   "(about 40 s each alone; minutes on a busy machine)")
    plane.wait_ready([prefill, *decode])

    prompts = [prompt_tokens(10 + i, PROMPT_TOKENS, vocab) for i in range(PROMPTS)]
    for engine in (prefill, *decode):
        plane.generate(engine, prompt_tokens(4, WARMUP_TOKENS, vocab), 2, kvsp=False)
    references = [plane.generate(prefill, p, MAX_TOKENS, kvsp=False)["token_ids"] for p in prompts]
    plane.progress(f"reference      the prefill engine alone, connector off: {len(prompts)} prompts of "
                   f"{PROMPT_TOKENS} tokens ({PROMPT_TOKENS // BLOCK_TOKENS} blocks), {MAX_TOKENS} tokens each")

    router = DisaggRouter(ProcessEngine(prefill), [ProcessEngine(d) for d in decode], fan_out=decoders)
    routed = asyncio.run(_route(router, plane, prompts))
    lines: list[dict[str, Any]] = []
    for i, (prompt, reference, (answer, relay)) in enumerate(zip(prompts, references, routed)):
        pre = answer["kvsp"]["prefill"]
        ends: list[int] = list(pre.get("kvsp", {}).get("forward_end_ns", []))
        prefill_end = max(int(t) for t in ends) if ends else None
        judged = [decoder_line(d, reference, prefill_end, pre.get("first_token_ns"))
                  for d in answer["kvsp"]["decoders"]]
        line = {"prompt": i + 1, "prompt_tokens": len(prompt), "prompt_blocks": len(prompt) // BLOCK_TOKENS,
                "prefill": {"error": pre.get("error"), "forward_passes_reported": len(ends),
                            "blocks_published": int(pre.get("kvsp", {}).get("blocks_published", 0)),
                            "router_ms": pre.get("router_ms")},
                "decoders": judged, "relay": relay}
        lines.append(line)
        for d in judged:
            plane.progress(f"prompt {i + 1} -> {d['engine']}: {d['layers_received']} layers streamed, "
                           f"{d['layers_received_before_prefill_finished']} before the prefill's next-to-last forward "
                           f"pass ended; decode TTFT {d['decode_ttft_ms']} ms; output "
                           f"{'==' if d['outputs_match'] else '!='} the single engine's")
    every: list[dict[str, Any]] = [d for line in lines for d in line["decoders"]]
    report: dict[str, Any] = {
        "engine": "vllm", "mode": "disagg", "vllm": vllm_version(), "dtype": dtype, "model": str(model),
        "block_tokens": BLOCK_TOKENS, "prefill_chunk_tokens": CHUNK_TOKENS, "decoders": decoders,
        "outputs_match": all(d["outputs_match"] for d in every),
        "layers_received_before_prefill_finished": min(d["layers_received_before_prefill_finished"] for d in every),
        "decode_ttft_ms": [d["decode_ttft_ms"] for d in every],
        "prompts": lines,
        "servers": plane.servers(),
        "measured": "times are CLOCK_MONOTONIC marks of the engines' own processes on this host",
    }
    report["ok"] = bool(report["outputs_match"] and report["layers_received_before_prefill_finished"] > 0)
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


async def _route(router: DisaggRouter, plane: VllmPlane, prompts: list[list[int]]) -> list[tuple[dict[str, Any], dict[str, int]]]:
    """Each prompt POSTed to the router's HTTP API on loopback; its answer and the relay's
    counters over it."""
    server = await serve_app(make_app(router))
    plane.progress(f"router         {server.url}v1/completions (prefill + {len(router.decoders)} decoders)")
    out = []
    try:
        for prompt in prompts:
            before = await asyncio.to_thread(plane.relay_stats)
            reply = await http_request(f"{server.url}v1/completions", "POST", timeout=600,
                                       body=json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS}).encode(),
                                       content_type="application/json")
            if reply.status != 200:
                raise RuntimeError(f"the router answered {reply.status}: {reply.body[:300]!r}")
            after = await asyncio.to_thread(plane.relay_stats)
            out.append((reply.json(), _relay_delta(before, after)))
    finally:
        with contextlib.suppress(Exception):
            await server.close()
    return out


def _print_report(report: dict[str, Any]) -> None:
    print(f"kvsp demo --engine vllm --disagg: 1 prefill engine, {report['decoders']} decode engines ({report['vllm']})")
    for line in report["prompts"]:
        print(f"  prompt {line['prompt']}: {line['prompt_tokens']} tokens, {line['prefill']['forward_passes_reported']} prefill "
              f"forward passes reported, relay objects in {line['relay']['objects_in']} / out {line['relay']['objects_out']}")
        for d in line["decoders"]:
            print(f"    {d['engine']:<9} match {d['outputs_match']}, layers {d['layers_received']} "
                  f"({d['layers_received_before_prefill_finished']} before prefill finished), decode TTFT "
                  f"{d['decode_ttft_ms']} ms, overlap {d['overlap_ms']} ms")
    print(f"  outputs match      {report['outputs_match']}")
    print(f"  ok                 {report['ok']}  ({report['seconds']} s)")


def cmd_demo_disagg(args: argparse.Namespace) -> int:
    return run_reported(args, lambda plane: run_disagg(plane, args.model_dir, args.decoders,
                                                       getattr(args, "dtype", "float32")),
                        _print_report, prefix="kvsp-demo-disagg-")
