"""``kvsp bench vllm``: engine B's time to first token for an N-token shared prefix, three ways.

In one run (``cli.demo.engines``: IS, relay process and HTTP holder on loopback, vLLM engine
processes on CPU, block size 32):

- **KVSP**: engine A computes the prompt and publishes its blocks (MOQT through the relay,
  HTTP holder, records at the IS); engine B, with the ``KVSPConnector``, looks them up and
  loads them over MOQT through the relay, layer by layer, into its paged cache. The relay has
  never seen the prompt (a fresh prefix each round: its cache is cold, it fetches from A's
  holder); a second request of B for the same prompt is the warm-relay figure;
- **recompute**: engine B with the connector off for the request;
- **ExampleConnector**: vLLM's own reference connector (``ExampleConnector``: safetensors
  files on local disk, one per layer) in engine C: the round's first request computes and
  writes them, the second loads them.

The prompt is the N-token prefix and 2 more tokens, so that every connector loads exactly the
N prefix tokens (KVSP's full-hit rule loads ``(len - 1) // B`` blocks; the ExampleConnector
loads ``(len - 2) // B`` of them) and computes the 2 others. A time to first token is engine
B's (or C's) ``llm.generate`` of the prompt with ``max_tokens=1``, measured in the engine's
process. A warm-up round is not timed; each figure is the best of ``--repeat`` rounds (the
least disturbed on a shared machine), every sample in its ``params``. Each round checks that
B's KVSP load hit all N tokens over MOQT with nothing failed, and that the three first tokens
agree (greedy).

The model is the connector's tiny Llama (4 layers, 2 KV heads x 32) with ``--hidden``
(default 128, the tests' model; the KV per token does not grow with it, the compute does), or
a local model with ``--model-dir``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ...bench.report import Figure, emit
from ...integrations.vllm.engine_process import EngineSpec
from ...integrations.vllm.tiny_model import TinyLlama
from ..demo.engines import BLOCK_TOKENS, VllmPlane, interrupts_as_keyboard_interrupt, kvsp_stats, require_vllm
from ..errors import UsageError

__all__ = ["Samples", "check_round", "figures", "register_arguments", "run"]

#: The prompt's tokens after the prefix (module notes).
TAIL_TOKENS = 2
WAYS = ("kvsp", "kvsp_warm_relay", "recompute", "example_connector", "example_connector_store")


@dataclass
class Samples:
    """Times to first token (ms) of each way, one per timed round."""

    prefix_tokens: int
    ms: dict[str, list[float]] = field(default_factory=lambda: {w: [] for w in WAYS})
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, way: str, answer: dict[str, Any]) -> None:
        self.ms[way].append(round(float(answer["elapsed_s"]) * 1e3, 3))


def check_round(prefix_tokens: int, answers: dict[str, dict[str, Any]], relay: dict[str, dict[str, float]]) -> None:
    """What a round must show (module notes); RuntimeError names what did not. ``relay`` has
    the relay's counter increments during B's two KVSP requests (``kvsp``: FETCHes of every
    block, each upstream to A's holder; ``kvsp_warm_relay``: every block FETCHed again, none
    upstream). The connector's worker counters (``blocks_moqt``...) are checked where vLLM
    returned them: a request that ends in the step that loads its blocks (``max_tokens=1``)
    finishes before that step's counters reach the scheduler, so it has the scheduler's
    figures (``external_tokens``) only."""
    blocks = prefix_tokens // BLOCK_TOKENS
    published = kvsp_stats(answers["publish"]).get("blocks_published", 0)
    if published < blocks:
        raise RuntimeError(f"engine A published {published} blocks of the {blocks}-block prefix")
    for way, upstream in (("kvsp", blocks), ("kvsp_warm_relay", 0)):
        stats = kvsp_stats(answers[way])
        loaded = stats.get("blocks_moqt", blocks) == blocks and not stats.get("blocks_failed") \
            and not stats.get("blocks_http")
        if stats.get("external_tokens") != prefix_tokens or not loaded:
            raise RuntimeError(f"{way}: engine B did not load the {blocks} prefix blocks over MOQT: {stats}")
        seen = relay[way]
        if seen.get("relay_fetches_total") != blocks or seen.get("relay_upstream_fetches_total", 0) != upstream:
            raise RuntimeError(f"{way}: the relay did not serve the {blocks} blocks ({upstream} upstream): {seen}")
    firsts = {way: answers[way]["token_ids"][:1] for way in answers}
    if len({tuple(t) for t in firsts.values()}) != 1:
        raise RuntimeError(f"the first tokens differ: {firsts}")


def figures(samples: Samples, params: dict[str, Any]) -> list[Figure]:
    """The figures: each way's best time beside recomputing's, and KVSP beside vLLM's own
    connector; every sample in ``params``."""
    n = samples.prefix_tokens
    best = {w: min(v) for w, v in samples.ms.items()}
    common = {**params, "prefix_tokens": n, "rounds": len(samples.ms["kvsp"]),
              "samples_ms": samples.ms, **samples.details}
    name = {w: f"vllm_ttft_{w}_prefix{n}" for w in WAYS}
    return [
        Figure(name["kvsp"], "ms", best["kvsp"], name["recompute"], best["recompute"], params=common),
        Figure(name["kvsp_warm_relay"], "ms", best["kvsp_warm_relay"], name["recompute"], best["recompute"],
               params=common),
        Figure(name["example_connector"], "ms", best["example_connector"], name["recompute"], best["recompute"],
               params=common),
        Figure(f"vllm_ttft_kvsp_vs_example_connector_prefix{n}", "ms", best["kvsp"], name["example_connector"],
               best["example_connector"], params=common),
    ]


def _fresh_prompt(seed: int, prefix_tokens: int, vocab: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(3, vocab) for _ in range(prefix_tokens + TAIL_TOKENS)]


def run(*, prefix_tokens: int, repeat: int, hidden: int, model_dir: str | None,
        progress: Any = None) -> list[Figure]:
    """Start the plane and the three engines, run a warm-up round and ``repeat`` timed rounds."""
    say = progress or (lambda message: None)
    with interrupts_as_keyboard_interrupt(), VllmPlane(say, prefix="kvsp-bench-vllm-") as plane:
        plane.start_plane()
        shape = TinyLlama(hidden=hidden, heads=hidden // 32, intermediate=2 * hidden)
        model, vocab = plane.model(model_dir, shape)
        max_len = prefix_tokens + 4 * BLOCK_TOKENS
        a = plane.start_engine("engine A", plane.kvsp_spec(model, "engine-a", max_model_len=max_len))
        b = plane.start_engine("engine B", plane.kvsp_spec(model, "engine-b", max_model_len=max_len))
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": str(plane.workdir / "example-kv")}}
        c = plane.start_engine("engine C", EngineSpec(str(model), block_size=BLOCK_TOKENS, max_model_len=max_len,
                                                      kv_transfer_config=example))
        plane.wait_ready([a, b, c])
        samples = Samples(prefix_tokens)
        for n in range(repeat + 1):  # round 0 warms every path up, untimed
            prompt = _fresh_prompt(1000 + n, prefix_tokens, vocab)
            # A's time is not measured: 2 tokens, so its publication counters come back (see check_round)
            answers = {"publish": plane.generate(a, prompt, 2)}
            relay: dict[str, dict[str, float]] = {}
            for way in ("kvsp", "kvsp_warm_relay"):
                before = plane.relay_stats()
                answers[way] = plane.generate(b, prompt, 1)
                after = plane.relay_stats()
                relay[way] = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("relay_")}
            answers["recompute"] = plane.generate(b, prompt, 1, kvsp=False)
            answers["example_connector_store"] = plane.generate(c, prompt, 1)
            answers["example_connector"] = plane.generate(c, prompt, 1)
            check_round(prefix_tokens, answers, relay)
            if n == 0:
                octets = int(relay["kvsp"].get("relay_bytes_out_total", 0))
                samples.details = {"blocks": prefix_tokens // BLOCK_TOKENS, "kv_bytes_per_load": octets}
                say(f"warm-up round done: {prefix_tokens} prefix tokens = {prefix_tokens // BLOCK_TOKENS} blocks, "
                    f"{octets} KV bytes out of the relay per load")
                continue
            for way in WAYS:
                samples.add(way, answers[way])
            say(f"round {n}/{repeat}: " + ", ".join(f"{w} {samples.ms[w][-1]:.1f} ms" for w in WAYS))
        params = {"model": "tiny-llama" if model_dir is None else str(model), "hidden": hidden if model_dir is None
                  else None, "block_tokens": BLOCK_TOKENS, "relay": "cold (a fresh prefix each round)"}
        return figures(samples, params)


def register_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--prefix-tokens", type=int, default=1024, metavar="N",
                   help=f"tokens of the shared prefix, a multiple of {BLOCK_TOKENS} (default 1024)")
    q.add_argument("--repeat", type=int, default=3, help="timed rounds, each with a fresh prefix; the best is kept")
    q.add_argument("--hidden", type=int, default=128,
                   help="hidden size of the tiny Llama, a multiple of 32 (default 128: the tests' model); "
                        "heads = hidden / 32, the KV per token stays 2 heads x 32")
    q.add_argument("--model-dir", metavar="DIR", default=None,
                   help="a local Hugging Face model directory instead of the tiny Llama")


def _progress(message: str) -> None:
    print(f"[bench vllm] {message}", file=sys.stderr, flush=True)


def cmd(args: argparse.Namespace) -> int:
    n = args.prefix_tokens
    if n < BLOCK_TOKENS or n % BLOCK_TOKENS:
        raise UsageError(f"--prefix-tokens must be a positive multiple of {BLOCK_TOKENS}")
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    if args.hidden < 32 or args.hidden % 32:
        raise UsageError("--hidden must be a positive multiple of 32")
    require_vllm()
    started = time.perf_counter()
    try:
        figs = run(prefix_tokens=n, repeat=args.repeat, hidden=args.hidden, model_dir=args.model_dir,
                   progress=_progress)
    except KeyboardInterrupt:
        _progress("interrupted: everything stopped, exit 130")
        return 130
    emit(figs)
    _progress(f"done in {time.perf_counter() - started:.0f} s; everything stopped")
    return 0
