"""``kvsp bench vllm --disagg``: decode-side time to first token, prefill→decode three ways.

In one run (``cli.demo.engines``: IS, relay process and HTTP holder on loopback; a prefill
engine, ``kv_producer``, prefilling in chunks of ``--chunk-tokens``; a decode engine,
``kv_consumer``; vLLM's CPU build, the tiny Llama of ``kvsp demo --disagg``), each round on a
fresh prompt of ``--prompt-tokens`` tokens (so that no cache holds it):

- **stream**: the prompt goes to the prefill engine (one token, the stream's producer) and,
  at the same time, to the decode engine (the stream's consumer): the decoder takes each layer
  through the relay while the prefill computes (docs/vllm.md "Prefill→decode");
- **pull** (the NIXL-style flow): the prompt goes to the prefill engine; once it answered, to
  the decode engine, which FETCHes the complete blocks through the relay (the same stream's
  names: its SUBSCRIBE finds them complete and FETCHes them) — the transfer after the prefill;
- **recompute**: the prompt to the decode engine alone, the connector off for it.

Each way's time to first token is from the moment the bench sent the prompt (to the prefill
engine, or to the decoder for recompute) to the decoder's first token: CLOCK_MONOTONIC marks of
the bench's process and of the decoder's (one host); each way's ``prefill_ms`` (in ``params``:
to the prefill engine's token) shows what streaming costs the prefill itself. The **transfer time** of the prefill's KV
is the pull's decoder-side part: from the decoder's receipt of the request to its first token
(FETCH, verification, placing, the tail's compute). The **overlap** of the stream: from the end
of the prefill's last forward pass to the decoder's first token. Target (issue 29): the stream's
TTFT below the pull's by at least a third of the transfer time
(``vllm_disagg_stream_gain_over_transfer`` >= 0.333). Each figure is the best of ``--repeat``
rounds after an untimed warm-up round; every sample is in ``params``. The two engines run on
two halves of the machine's CPUs (as prefill and decode engines on two hosts would: otherwise the
decode engine's and the relay's work during the stream takes the CPU from the prefill's
forward pass, which pull never does); ``--no-cpu-split`` runs them on all. Every round checks that
the three first tokens agree and that the stream and the pull loaded every block (nothing failed).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ....bench.report import Figure
from ....integrations.vllm.engine_process import EngineProcess
from ....integrations.vllm.stream import PARAM
from ...demo.engines import BLOCK_TOKENS, VllmPlane
from ...demo.disagg import SHAPE
from .quic_backend import check_processes, default_backend, on_backend, quic_backend_env

__all__ = ["DEFAULT_CHUNK_TOKENS", "DEFAULT_PROMPT_TOKENS", "WAYS", "disagg_figures", "run_disagg"]

DEFAULT_PROMPT_TOKENS = 1024 + 17
DEFAULT_CHUNK_TOKENS = 256
WAYS = ("stream", "pull", "recompute")
REQUEST_S = 300.0


def _prompt(seed: int, tokens: int, vocab: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, vocab) for _ in range(tokens)]


def _ask(engine: EngineProcess, prompt: list[int], params: dict[str, Any] | None, salt: str | None = None) -> dict[str, Any]:
    one = {"prompt_token_ids": prompt, "max_tokens": 1, "kv_transfer_params": params, "cache_salt": salt}
    return dict(engine.batch([one], REQUEST_S)[0])


def _stream_params(stream_id: str, part: str) -> dict[str, Any]:
    return {PARAM: {"id": stream_id, "as": part}}


def _checked(way: str, answer: dict[str, Any], blocks: int) -> dict[str, Any]:
    kvsp = (answer.get("kv_transfer_params") or {}).get("kvsp", {})
    loaded = sum(int(kvsp.get(f"blocks_{via}", 0)) for via in ("streamed", "moqt", "http"))
    if int(kvsp.get("blocks_failed", 0)) or loaded != blocks:
        raise RuntimeError(f"{way}: the decoder loaded {loaded} of {blocks} blocks ({kvsp})")
    return kvsp


def one_round(prefill: EngineProcess, decoder: EngineProcess, prompt: list[int], pool: ThreadPoolExecutor,
              seed: int) -> dict[str, dict[str, Any]]:
    """The three ways on ``prompt`` (module notes): per way its TTFT and marks."""
    blocks = (len(prompt) - 1) // BLOCK_TOKENS
    out: dict[str, dict[str, Any]] = {}
    # stream: both at once
    sid = f"{random.Random(seed).getrandbits(128):032x}"
    t0 = time.monotonic_ns()
    pre = pool.submit(_ask, prefill, prompt, _stream_params(sid, "producer"))
    dec = _ask(decoder, prompt, _stream_params(sid, "consumer"))
    pre_answer = pre.result(REQUEST_S)
    kvsp = _checked("stream", dec, blocks)
    ends = (pre_answer.get("kv_transfer_params") or {}).get("kvsp", {}).get("forward_end_ns", [])
    out["stream"] = {"ttft_ms": (dec["first_token_ns"] - t0) / 1e6, "first": dec["token_ids"][:1],
                     "prefill_ms": (pre_answer["first_token_ns"] - t0) / 1e6,
                     "overlap_ms": (dec["first_token_ns"] - max(ends)) / 1e6 if ends else None,
                     "prefill_forward_passes": len(ends), "layers_before_prefill_end":
                         sum(1 for t in kvsp.get("layer_ns", []) if ends and t < max(ends))}
    # pull: the prefill first, then the decoder (another prompt: the first is in every cache now)
    pulled = list(reversed(prompt))
    sid = f"{random.Random(seed + 1).getrandbits(128):032x}"
    t0 = time.monotonic_ns()
    pre_answer = _ask(prefill, pulled, _stream_params(sid, "producer"))
    prefill_ms = (pre_answer["first_token_ns"] - t0) / 1e6
    dec = _ask(decoder, pulled, _stream_params(sid, "consumer"))
    _checked("pull", dec, blocks)
    out["pull"] = {"ttft_ms": (dec["first_token_ns"] - t0) / 1e6, "first": None, "prefill_ms": prefill_ms,
                   "transfer_ms": float(dec["first_token_s"]) * 1e3}
    # recompute: the decoder alone, the connector off, a fresh salt (vLLM's own cache misses)
    t0 = time.monotonic_ns()
    dec = _ask(decoder, prompt, {"kvsp": False}, salt=f"recompute-{seed}")
    out["recompute"] = {"ttft_ms": (dec["first_token_ns"] - t0) / 1e6, "first": dec["token_ids"][:1]}
    if out["stream"]["first"] != out["recompute"]["first"]:
        raise RuntimeError(f"the first tokens differ: stream {out['stream']['first']}, "
                           f"recompute {out['recompute']['first']}")
    return out


def cpu_split() -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """This process's CPUs in two halves (the prefill engine's, the decode engine's), as two
    hosts would have them; None with fewer than 2."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return tuple(cpus[:half]), tuple(cpus[half:])


def run_disagg(*, prompt_tokens: int, chunk_tokens: int, repeat: int, progress: Callable[[str], None],
               split: bool = True, backend: str | None = None) -> list[Figure]:
    """The bench (module notes); the relay and both engines on QUIC backend ``backend``
    (default: ``$KVSP_QUIC_BACKEND`` or aioquic; :mod:`.quic_backend`)."""
    halves = cpu_split() if split else None
    backend = backend or default_backend()
    with quic_backend_env(backend), VllmPlane(progress, prefix="kvsp-bench-disagg-") as plane, \
            ThreadPoolExecutor(2) as pool:
        kv = plane.start_plane()
        model, vocab = plane.model(None, SHAPE)
        prefill = plane.start_engine("prefill", on_backend(plane.kvsp_spec(
            model, "engine-a", kv_role="kv_producer", max_num_batched_tokens=chunk_tokens,
            cpus=halves[0] if halves else None), backend))
        decoder = plane.start_engine("decode", on_backend(plane.kvsp_spec(
            model, "engine-b", kv_role="kv_consumer", cpus=halves[1] if halves else None), backend))
        on = check_processes(backend, {"relay": kv.relay.process.pid, "prefill": prefill.process.pid,
                                       "decode": decoder.process.pid})
        progress(f"QUIC backend   {backend}: the relay, the prefill and decode engines (their environment)")
        if halves:
            progress(f"cpus           prefill engine on CPUs {list(halves[0])}, decode engine on {list(halves[1])} "
                     "(as on two hosts; --no-cpu-split shares them)")
        plane.wait_ready([prefill, decoder])
        samples: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
        for r in range(repeat + 1):  # round 0: the warm-up, not kept
            got = one_round(prefill, decoder, _prompt(100 + r, prompt_tokens, vocab), pool, seed=1000 + 10 * r)
            progress(f"round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(
                f"{w} {got[w]['ttft_ms']:.1f} ms" for w in WAYS))
            if r:
                for w in WAYS:
                    samples[w].append(got[w])
        params = {"prompt_tokens": prompt_tokens, "chunk_tokens": chunk_tokens, "block_tokens": BLOCK_TOKENS,
                  "layers": SHAPE.layers, "hidden": SHAPE.hidden, "rounds": repeat, "quic_backend": backend,
                  "quic_backend_processes": on,
                  "cpus": {"prefill": list(halves[0]), "decode": list(halves[1])} if halves else "shared"}
        return disagg_figures(samples, params)


def disagg_figures(samples: dict[str, list[dict[str, Any]]], params: dict[str, Any]) -> list[Figure]:
    """Each way's best TTFT beside the others', the stream's gain over the transfer time, the
    overlap (module notes); every sample in ``params``."""
    n = params["prompt_tokens"]
    best = {w: min(s["ttft_ms"] for s in samples[w]) for w in WAYS}
    transfer = min(s["transfer_ms"] for s in samples["pull"])
    overlaps = [s["overlap_ms"] for s in samples["stream"] if s["overlap_ms"] is not None]
    common = {**params, "samples": {w: [{k: v for k, v in s.items() if k != "first"} for s in samples[w]]
                                    for w in WAYS},
              "ttft": "from the bench sending the prompt to the decoder's first token (CLOCK_MONOTONIC, one host)"}
    name = {w: f"vllm_disagg_ttft_{w}_prompt{n}" for w in WAYS}
    gain = (best["pull"] - best["stream"]) / transfer if transfer > 0 else float("nan")
    out = [
        Figure(name["stream"], "ms", best["stream"], name["pull"], best["pull"], params=common),
        Figure(name["pull"], "ms", best["pull"], name["recompute"], best["recompute"], params=common),
        Figure(f"vllm_disagg_ttft_stream_vs_recompute_prompt{n}", "ms", best["stream"], name["recompute"],
               best["recompute"], params=common),
        Figure(f"vllm_disagg_stream_gain_over_transfer_prompt{n}", "fraction", gain, "target", 1 / 3,
               params={**common, "transfer_ms": transfer, "gain":
                       "(pull TTFT - stream TTFT) / the pull's transfer time (its decoder-side TTFT)"}),
    ]
    if overlaps:
        out.append(Figure(f"vllm_disagg_overlap_prompt{n}", "ms", min(overlaps), "vllm_disagg_transfer_ms",
                          transfer, params={**common, "overlap":
                                            "from the prefill's last forward pass to the decoder's first token"}))
    return out
