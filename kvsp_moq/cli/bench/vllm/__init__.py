"""``kvsp bench vllm``: engine B's time to first token for an N-token shared prefix, every way.

In one run (``cli.demo.engines``: IS, relay process and HTTP holder on loopback, vLLM engine
processes on CPU, block size 32):

- **KVSP**: engine A computes the prompt and publishes its blocks (MOQT through the relay,
  HTTP holder, records at the IS); engine B, with the ``KVSPConnector``, looks them up and
  loads them over MOQT through the relay (asynchronously: the request waits outside the batch
  until every block arrived verified) into its paged cache. The relay has never seen the prompt
  (a fresh prefix each round: its cache is cold, it fetches from A's holder); a second request
  of B for the same prompt is the warm-relay figure;
- **local hit**: the same prompt on B once more, vLLM's own prefix-cache hit: only the 2 tail
  tokens are computed (the floor every way is measured against in the load rates below);
- **recompute**: engine B with the connector off for the request;
- **ExampleConnector**: vLLM's own reference connector (``ExampleConnector``: safetensors
  files on local disk, one per layer) in engine C: the round's first request computes and
  writes them, the second loads them;
- **LMCache**, where ``lmcache`` and ``redis-server`` are installed (``.lmcache``;
  ``--no-lmcache`` leaves it out): LMCache's multi-process server with a Redis L2 and its L1
  skipped, both started by the bench, and vLLM's ``LMCacheMPConnector`` in engine D (its prefix
  cache off): the round's first request computes and stores, the bench waits until the store is
  in Redis only, the second loads it from Redis. The bench says "lmcache not installed",
  "lmcache: redis-server not installed" or "lmcache failed: why" and goes on without the row.

vLLM's own prefix cache is on in engines A, B and C (its default), so each request that must
not be an engine's own hit carries a ``cache_salt`` (vLLM keys its cache on it): B's warm-relay
request the secret salt that selects the KVSP scope (the plane's ``scope_salt``), C's load a
fresh one (the ExampleConnector finds its files by the tokens), the recompute a fresh one with
the connector off. B's local hit has the cold load's (no salt).

The prompt is the N-token prefix and 2 more tokens, so that every connector loads exactly the
N prefix tokens (KVSP's full-hit rule loads ``(len - 1) // B`` blocks; the ExampleConnector
loads ``(len - 2) // B`` of them; LMCache its whole chunks) and computes the 2 others. A time
to first token is the engine's ``llm.generate`` of the prompt with ``max_tokens=1``, measured
in the engine's process. A warm-up round is not timed; each figure is the best of ``--repeat``
rounds (the least disturbed on a shared machine), every sample in its ``params``. Each round
checks that B's KVSP load hit all N tokens over MOQT with nothing failed (and moved the KV
octets of the prefix where the worker's counters came back), that the local hit loaded nothing,
and that all first tokens agree (greedy).

**Effective load rate** (``vllm_kvsp_load_rate_prefixN``, cold relay, and
``vllm_kvsp_warm_relay_load_rate_prefixN``, MB/s): the KV octets B loaded for the prefix
(N x layers x 2 x KV heads x head_dim x the engine's dtype's octets) divided by the time the
load added to the request: the best KVSP time to first token minus the best local-hit one.
Both requests compute the same 2 tail tokens after the same N cached ones, so the difference is
the IS lookup, the FETCHes, the verification, the copies into the paged cache and the engine
steps the request waited out: everything the load costs, nothing it does not (dividing by the
whole time to first token would charge the load with the compute every way does; that rate is
in ``params.rate_over_ttft_mb_s``). Its baseline is ``kvsp bench kv``'s direct MOQT rate for one
block of the same octets, measured in the same run (``.direct``: its holder in its own
process, one connection, the block's layers as the model's).

``--backend NAME`` (default ``$KVSP_QUIC_BACKEND`` or aioquic) is the QUIC backend of every
process of the bench that speaks QUIC: the relay, engines A and B's connectors, the direct row's
holder and loader (:mod:`.quic_backend`: a backend this build cannot run is refused before
anything starts; each process is checked to have started with it; ``params.quic_backend``).
Engines C and D speak no QUIC.

``--geometry tiny`` (default) is the connector's tiny Llama (4 layers, 2 KV heads x 32, fp32)
with ``--hidden`` (default 128, the tests' model; the KV per token does not grow with it, the
compute does); ``--geometry llama8b`` is 2 of Llama-3-8B's layers in bf16 (hidden 4096, 32
query heads, 8 KV heads x 128, intermediate 14336, a 512-word vocabulary), so that the KV octets
per token per FLOP are Llama-3-8B's; ``--model-dir`` a local model (fp32).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ....bench.report import Figure, emit
from ....integrations.vllm.engine_process import EngineProcess, EngineSpec
from ....integrations.vllm.tiny_model import LLAMA3_8B_LAYERS, TinyLlama
from ...demo.engines import (
    BLOCK_TOKENS,
    VllmPlane,
    interrupts_as_keyboard_interrupt,
    kv_bytes_per_token_layer,
    kvsp_stats,
    require_vllm,
)
from ...errors import UsageError
from .direct import TOKEN_BYTES, DirectRate, direct_rate
from .lmcache import (
    BACKEND,
    LmcacheServer,
    check_lmcache,
    check_redis_load,
    chunk_tokens,
    lmcache_missing,
    redis_missing,
)
from .quic_backend import check_backend, check_processes, default_backend, on_backend, quic_backend_env

__all__ = ["GEOMETRIES", "Samples", "check_round", "figures", "kv_bytes_per_token_layer", "register_arguments",
           "run"]

#: The prompt's tokens after the prefix (module notes).
TAIL_TOKENS = 2
WAYS = ("kvsp", "kvsp_warm_relay", "local_hit", "recompute", "example_connector", "example_connector_store")
LMCACHE_WAYS = ("lmcache", "lmcache_store")
GEOMETRIES = ("tiny", "llama8b")
#: The tiny Llama's hidden size unless ``--hidden`` says otherwise.
DEFAULT_HIDDEN = 128
#: KVSP block size of engines A and B (``--block-tokens``): 8 of vLLM's 32-token blocks, the
#: chunk LMCache uses (256 tokens), so that a prefix is 8x fewer FETCHes and records.
DEFAULT_BLOCK_TOKENS = 256


@dataclass
class Samples:
    """Times to first token (ms) of each way, one per timed round; the KV octets B loads for the
    prefix and the direct baseline of the load rates."""

    prefix_tokens: int
    ms: dict[str, list[float]] = field(default_factory=lambda: {w: [] for w in WAYS + LMCACHE_WAYS})
    details: dict[str, Any] = field(default_factory=dict)
    kv_bytes: int = 0
    direct: DirectRate | None = None

    def add(self, way: str, answer: dict[str, Any]) -> None:
        self.ms[way].append(round(float(answer["elapsed_s"]) * 1e3, 3))


def check_round(prefix_tokens: int, answers: dict[str, dict[str, Any]], relay: dict[str, dict[str, float]],
                kv_bytes: int | None = None, block_tokens: int = BLOCK_TOKENS) -> None:
    """What a round must show (module notes); RuntimeError names what did not. ``relay`` has
    the relay's counter increments during B's two KVSP requests (``kvsp``: FETCHes of every
    block, each upstream to A's holder; ``kvsp_warm_relay``: every block FETCHed again, none
    upstream). The connector's worker counters (``blocks_moqt``, ``bytes_moqt``...) are checked
    where vLLM returned them (``bytes_moqt`` against ``kv_bytes`` where given): a request that
    ends in the step that loads its blocks (``max_tokens=1``) finishes before that step's
    counters reach the scheduler, so it has the scheduler's figures (``external_tokens``) only.
    ``local_hit`` must be vLLM's own hit of every prefix block, nothing loaded. ``block_tokens``:
    the KVSP block size (a block is one FETCH)."""
    blocks = prefix_tokens // block_tokens
    published = kvsp_stats(answers["publish"]).get("blocks_published", 0)
    if published < blocks:
        raise RuntimeError(f"engine A published {published} blocks of the {blocks}-block prefix")
    for way, upstream in (("kvsp", blocks), ("kvsp_warm_relay", 0)):
        stats = kvsp_stats(answers[way])
        loaded = stats.get("blocks_moqt", blocks) == blocks and not stats.get("blocks_failed") \
            and not stats.get("blocks_http")
        if stats.get("external_tokens") != prefix_tokens or not loaded:
            raise RuntimeError(f"{way}: engine B did not load the {blocks} prefix blocks over MOQT: {stats}")
        if kv_bytes is not None and stats.get("bytes_moqt", kv_bytes) != kv_bytes:
            raise RuntimeError(f"{way}: engine B loaded {stats['bytes_moqt']} octets, the prefix's KV is {kv_bytes}")
        seen = relay[way]
        if seen.get("relay_fetches_total") != blocks or seen.get("relay_upstream_fetches_total", 0) != upstream:
            raise RuntimeError(f"{way}: the relay did not serve the {blocks} blocks ({upstream} upstream): {seen}")
    local = kvsp_stats(answers["local_hit"])
    if local.get("local_tokens") != prefix_tokens or local.get("external_tokens", 0) or local.get("blocks_moqt", 0):
        raise RuntimeError(f"local_hit: not vLLM's own hit of the {blocks} prefix blocks: {local}")
    firsts = {way: answers[way]["token_ids"][:1] for way in answers}
    if len({tuple(t) for t in firsts.values()}) != 1:
        raise RuntimeError(f"the first tokens differ: {firsts}")


def _rate_figure(name: str, way: str, samples: Samples, best: dict[str, float], common: dict[str, Any]) -> Figure:
    """KV octets / (way's best TTFT - the local hit's) beside the direct rate (module notes)."""
    direct = samples.direct
    assert direct is not None
    load_ms = best[way] - best["local_hit"]
    rate = samples.kv_bytes / (load_ms / 1e3) / 1e6 if load_ms > 0 else float("nan")
    params = {**common, **direct.params(), "kv_bytes": samples.kv_bytes, "ttft_ms": best[way],
              "local_hit_ttft_ms": best["local_hit"], "load_ms": round(load_ms, 3),
              "rate_over_ttft_mb_s": round(samples.kv_bytes / (best[way] / 1e3) / 1e6, 3),
              "rate": "kv_bytes / (ttft_ms - local_hit_ttft_ms), best of the rounds each"}
    return Figure(name, "MB/s", rate, direct.name, direct.mb_s, params=params)


def figures(samples: Samples, params: dict[str, Any]) -> list[Figure]:
    """The figures: each way's best time beside recomputing's, KVSP beside vLLM's own
    connector and LMCache's (where measured in every round), the effective load rates beside
    the direct rate (where measured); every sample in ``params``."""
    n = samples.prefix_tokens
    rounds = len(samples.ms["kvsp"])
    best = {w: min(v) for w, v in samples.ms.items() if v}
    common = {**params, "prefix_tokens": n, "rounds": rounds,
              "samples_ms": {w: v for w, v in samples.ms.items() if v}, **samples.details}
    name = {w: f"vllm_ttft_{w}_prefix{n}" for w in WAYS + LMCACHE_WAYS}
    out = [
        Figure(name["kvsp"], "ms", best["kvsp"], name["recompute"], best["recompute"], params=common),
        Figure(name["kvsp_warm_relay"], "ms", best["kvsp_warm_relay"], name["recompute"], best["recompute"],
               params=common),
        Figure(name["local_hit"], "ms", best["local_hit"], name["recompute"], best["recompute"], params=common),
        Figure(name["example_connector"], "ms", best["example_connector"], name["recompute"], best["recompute"],
               params=common),
        Figure(f"vllm_ttft_kvsp_vs_example_connector_prefix{n}", "ms", best["kvsp"], name["example_connector"],
               best["example_connector"], params=common),
    ]
    if rounds and len(samples.ms["lmcache"]) == rounds:
        out += [
            Figure(name["lmcache"], "ms", best["lmcache"], name["recompute"], best["recompute"], params=common),
            Figure(f"vllm_ttft_kvsp_vs_lmcache_prefix{n}", "ms", best["kvsp"], name["lmcache"], best["lmcache"],
                   params=common),
            Figure(f"vllm_ttft_kvsp_warm_relay_vs_lmcache_prefix{n}", "ms", best["kvsp_warm_relay"],
                   name["lmcache"], best["lmcache"], params=common),
        ]
    if samples.direct is not None and samples.kv_bytes:
        out += [_rate_figure(f"vllm_kvsp_load_rate_prefix{n}", "kvsp", samples, best,
                             {**common, "relay": "cold (a fresh prefix each round)"}),
                _rate_figure(f"vllm_kvsp_warm_relay_load_rate_prefix{n}", "kvsp_warm_relay", samples, best,
                             {**common, "relay": "warm (the same prefix from the relay's cache)"})]
    return out


def _fresh_prompt(seed: int, prefix_tokens: int, vocab: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(3, vocab) for _ in range(prefix_tokens + TAIL_TOKENS)]


def _shape(geometry: str, hidden: int) -> TinyLlama:
    if geometry == "llama8b":
        return LLAMA3_8B_LAYERS
    return TinyLlama(hidden=hidden, heads=hidden // 32, intermediate=2 * hidden)


class _Lmcache:
    """LMCache's server (with its Redis L2) and engine D (None until started, and once they
    failed: module notes); ``status`` goes into the figures' params, ``redis`` too: what Redis
    did in each round, the warm-up round 0 included (the keys the store added, LMCache's L1
    objects when the load was asked, the GETs Redis answered during the load)."""

    def __init__(self, server: LmcacheServer) -> None:
        self.server = server
        self.engine: EngineProcess | None = None
        self.status = f"LMCacheMPConnector, {BACKEND}"
        self.redis: list[dict[str, int]] = []

    def fail(self, why: object, say: Any, samples: Samples) -> None:
        say(f"lmcache failed: {why}")
        self.engine = None
        self.status = f"failed: {str(why).splitlines()[0][:200]}"
        for way in LMCACHE_WAYS:
            samples.ms[way].clear()
        self.redis.clear()

    def round(self, plane: VllmPlane, prompt: list[int], first_token: list[int]) -> dict[str, dict[str, Any]]:
        """Store, wait until it is in Redis only, load; the checks of the module notes."""
        assert self.engine is not None
        server = self.server
        before, counted = len(server.retrieved()), server.redis.counters()
        answers = {"lmcache_store": plane.generate(self.engine, prompt, 1)}
        l1_objects = server.wait_in_redis()  # as engine A's flush: the store done before the load
        stored = server.redis.counters()
        answers["lmcache"] = plane.generate(self.engine, prompt, 1)
        loaded = server.redis.counters()
        got = server.wait_retrieved(before + 1)
        check_lmcache(len(prompt) - TAIL_TOKENS, answers, got[before:], first_token)
        evidence = {"round": len(self.redis), "stored_keys": stored["keys"] - counted["keys"],
                    "l1_objects_at_load": l1_objects,
                    "redis_gets_during_load": loaded["gets"] - stored["gets"]}
        check_redis_load(evidence["stored_keys"], l1_objects, evidence["redis_gets_during_load"])
        self.redis.append(evidence)
        return answers


def run(*, prefix_tokens: int, repeat: int, hidden: int = DEFAULT_HIDDEN, geometry: str = "tiny",
        model_dir: str | None = None, lmcache: bool = True, block_tokens: int = DEFAULT_BLOCK_TOKENS,
        backend: str | None = None, progress: Any = None) -> list[Figure]:
    """Start the plane and the engines, measure the direct rate, run a warm-up round and
    ``repeat`` timed rounds; the relay, engines A and B and the direct row on QUIC backend
    ``backend`` (default: ``$KVSP_QUIC_BACKEND`` or aioquic; :mod:`.quic_backend`)."""
    say = progress or (lambda message: None)
    backend = backend or default_backend()
    with contextlib.ExitStack() as stack:
        stack.enter_context(quic_backend_env(backend))  # before the relay and the engines start
        server: LmcacheServer | None = None
        lm_status = "off (--no-lmcache)"
        if lmcache:
            missing = lmcache_missing() or redis_missing()
            if missing:
                say(missing)
                lm_status = "not installed" if lmcache_missing() else "redis-server not installed"
            else:
                server = LmcacheServer(chunk_tokens(prefix_tokens, BLOCK_TOKENS), say)
                stack.callback(server.close)  # after the engines (the plane closes first)
        stack.enter_context(interrupts_as_keyboard_interrupt())
        plane = stack.enter_context(VllmPlane(say, prefix="kvsp-bench-vllm-"))
        kv = plane.start_plane()
        shape = _shape(geometry, hidden)
        model, vocab = plane.model(model_dir, shape)
        dtype = "float32" if model_dir is not None else shape.dtype
        layers, per_token_layer = kv_bytes_per_token_layer(model, dtype)
        samples = Samples(prefix_tokens, kv_bytes=prefix_tokens * layers * per_token_layer)
        say(f"KV of the prefix: {prefix_tokens} tokens x {layers} layers x {per_token_layer} octets ({dtype}) = "
            f"{samples.kv_bytes} octets")
        max_len = prefix_tokens + 4 * BLOCK_TOKENS
        a = plane.start_engine("engine A", on_backend(plane.kvsp_spec(
            model, "engine-a", max_model_len=max_len, dtype=dtype, block_tokens=block_tokens), backend))
        b = plane.start_engine("engine B", on_backend(plane.kvsp_spec(
            model, "engine-b", max_model_len=max_len, dtype=dtype, block_tokens=block_tokens), backend))
        on = check_processes(backend, {"relay": kv.relay.process.pid, "engine A": a.process.pid,
                                       "engine B": b.process.pid})
        say(f"QUIC backend   {backend}: the relay, engines A and B (their environment), the direct row")
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": str(plane.workdir / "example-kv")}}
        c = plane.start_engine("engine C", EngineSpec(str(model), block_size=BLOCK_TOKENS, max_model_len=max_len,
                                                      dtype=dtype, kv_transfer_config=example))
        lm: _Lmcache | None = None
        if server is not None:
            lm = _Lmcache(server)
            try:
                server.start()
                lm.engine = plane.start_engine("engine D", server.spec(str(model), max_model_len=max_len, dtype=dtype,
                                                                       block_tokens=BLOCK_TOKENS))
            except (RuntimeError, OSError) as exc:  # its server, engine D: the row goes
                lm.fail(exc, say, samples)
        plane.wait_ready([a, b, c])
        if lm is not None and lm.engine is not None:
            try:
                plane.wait_ready([lm.engine])
            except (RuntimeError, OSError) as exc:  # its server, engine D: the row goes
                lm.fail(exc, say, samples)
        layer_bytes = -(-prefix_tokens * per_token_layer // TOKEN_BYTES) * TOKEN_BYTES
        samples.direct = direct_rate(layers, layer_bytes, repeat=max(3, repeat), backend=backend)
        say(f"direct MOQT load of a {layers} x {layer_bytes}-octet block ({samples.direct.name}): "
            f"{samples.direct.block_s * 1e3:.1f} ms, {samples.direct.mb_s:.0f} MB/s")
        for n in range(repeat + 1):  # round 0 warms every path up, untimed
            prompt = _fresh_prompt(1000 + n, prefix_tokens, vocab)
            # A's time is not measured: 2 tokens, so its publication counters come back (see check_round)
            answers = {"publish": plane.generate(a, prompt, 2)}
            if not a.flush(30):  # A's background publications: at the IS before B asks
                raise RuntimeError("engine A's publications did not complete within 30 s")
            relay: dict[str, dict[str, float]] = {}
            for way, salt in (("kvsp", None), ("kvsp_warm_relay", plane.scope_salt)):
                before = plane.relay_stats()
                answers[way] = plane.generate(b, prompt, 1, cache_salt=salt)
                after = plane.relay_stats()
                relay[way] = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("relay_")}
            answers["local_hit"] = plane.generate(b, prompt, 1)  # the cold load's salt: B's own cache
            answers["recompute"] = plane.generate(b, prompt, 1, kvsp=False)
            answers["example_connector_store"] = plane.generate(c, prompt, 1)
            answers["example_connector"] = plane.generate(c, prompt, 1, cache_salt=f"load-{n}")
            check_round(prefix_tokens, answers, relay, samples.kv_bytes, block_tokens)
            if lm is not None and lm.engine is not None:
                try:
                    answers.update(lm.round(plane, prompt, answers["recompute"]["token_ids"][:1]))
                except (RuntimeError, OSError) as exc:  # engine D died, or LMCache did not load (from Redis)
                    lm.fail(exc, say, samples)
            if n == 0:
                octets = int(relay["kvsp"].get("relay_bytes_out_total", 0))
                samples.details = {"blocks": prefix_tokens // block_tokens, "kv_bytes": samples.kv_bytes,
                                   "relay_bytes_out_per_load": octets}
                say(f"warm-up round done: {prefix_tokens} prefix tokens = {prefix_tokens // block_tokens} KVSP blocks, "
                    f"{samples.kv_bytes} KV octets, {octets} octets out of the relay per load")
                continue
            for way in WAYS + LMCACHE_WAYS:
                if way in answers:
                    samples.add(way, answers[way])
            say(f"round {n}/{repeat}: " + ", ".join(f"{w} {v[-1]:.1f} ms" for w, v in samples.ms.items() if v))
        params: dict[str, Any] = {
            "model": "tiny-llama" if model_dir is None else str(model),
            "geometry": geometry if model_dir is None else None,
            "hidden": shape.hidden if model_dir is None else None, "dtype": dtype, "layers": layers,
            "block_tokens": block_tokens, "vllm_block_tokens": BLOCK_TOKENS, "quic_backend": backend,
            "quic_backend_processes": on,
            "relay": "cold (a fresh prefix each round)", "lmcache": lm.status if lm is not None else lm_status}
        if lm is not None and lm.engine is not None:
            params["lmcache_chunk_tokens"] = lm.server.chunk
            params["lmcache_redis"] = lm.redis
        return figures(samples, params)
    raise AssertionError("unreachable")  # pragma: no cover (ExitStack swallows nothing)


def register_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--backend", default=None, metavar="NAME",
                   help="QUIC backend of every process of the bench that speaks QUIC: the relay, the engines' "
                        "connectors, the direct row's holder and loader (aioquic, qh3, native where built, "
                        "aiopquic where installed; default $KVSP_QUIC_BACKEND or aioquic)")
    q.add_argument("--prefix-tokens", type=int, default=1024, metavar="N",
                   help=f"tokens of the shared prefix, a multiple of {BLOCK_TOKENS} (default 1024)")
    q.add_argument("--repeat", type=int, default=3, help="timed rounds, each with a fresh prefix; the best is kept")
    q.add_argument("--geometry", choices=GEOMETRIES, default="tiny",
                   help="tiny (default): the tests' tiny Llama, 4 layers, 2 KV heads x 32, fp32; llama8b: 2 of "
                        "Llama-3-8B's layers in bf16 (hidden 4096, 8 KV heads x 128, intermediate 14336), "
                        "Llama-3-8B's KV octets per FLOP")
    q.add_argument("--hidden", type=int, default=None,
                   help=f"--geometry tiny only: hidden size of the tiny Llama, a multiple of 32 (default "
                        f"{DEFAULT_HIDDEN}: the tests' model); heads = hidden / 32, the KV per token stays "
                        f"2 heads x 32")
    q.add_argument("--model-dir", metavar="DIR", default=None,
                   help="a local Hugging Face model directory instead of the tiny Llama (fp32)")
    q.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, metavar="B",
                   help=f"KVSP block size in tokens (the connector's block_tokens), a multiple of vLLM's "
                        f"{BLOCK_TOKENS} (default {DEFAULT_BLOCK_TOKENS}: one FETCH per {DEFAULT_BLOCK_TOKENS} tokens, "
                        f"LMCache's chunk); the prefix must be a multiple of it")
    q.add_argument("--no-lmcache", action="store_true",
                   help="leave LMCache's row out even where lmcache is installed")
    q.add_argument("--disagg", action="store_true",
                   help="prefill→decode instead: the decoder's time to first token with layer streaming, with a "
                        "FETCH after the prefill (NIXL-style pull) and recomputing (docs/vllm.md \"Prefill→decode\")")
    q.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="--disagg: prompt tokens (default 1041: 32 blocks and a tail)")
    q.add_argument("--no-cpu-split", action="store_true",
                   help="--disagg: run both engines on all CPUs (default: the prefill engine on one half, the decode "
                        "engine on the other, as on two hosts)")
    q.add_argument("--chunk-tokens", type=int, default=None, metavar="C",
                   help="--disagg: the prefill engine's tokens per forward pass (vLLM's max_num_batched_tokens, "
                        "default 256)")


def _progress(message: str) -> None:
    print(f"[bench vllm] {message}", file=sys.stderr, flush=True)


def _cmd_disagg(args: argparse.Namespace) -> int:
    from .disagg import DEFAULT_CHUNK_TOKENS, DEFAULT_PROMPT_TOKENS, run_disagg

    n = args.prompt_tokens if args.prompt_tokens is not None else DEFAULT_PROMPT_TOKENS
    chunk = args.chunk_tokens if args.chunk_tokens is not None else DEFAULT_CHUNK_TOKENS
    if n < 2 * BLOCK_TOKENS or n > 2000:
        raise UsageError(f"--prompt-tokens must be in [{2 * BLOCK_TOKENS}, 2000] (the engines' max_model_len is 2048)")
    if chunk < BLOCK_TOKENS:
        raise UsageError(f"--chunk-tokens must be at least {BLOCK_TOKENS}")
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    backend = check_backend(args.backend)
    require_vllm()
    return _emit_run(lambda: run_disagg(prompt_tokens=n, chunk_tokens=chunk, repeat=args.repeat,
                                        progress=_progress, split=not args.no_cpu_split, backend=backend))


def _emit_run(measure: Callable[[], list[Figure]]) -> int:
    """Run a bench, print its figures; Ctrl-C: everything stopped, exit 130."""
    started = time.perf_counter()
    try:
        figs = measure()
    except KeyboardInterrupt:
        _progress("interrupted: everything stopped, exit 130")
        return 130
    emit(figs)
    _progress(f"done in {time.perf_counter() - started:.0f} s; everything stopped")
    return 0


def cmd(args: argparse.Namespace) -> int:
    if args.disagg:
        return _cmd_disagg(args)
    if args.prompt_tokens is not None or args.chunk_tokens is not None or args.no_cpu_split:
        raise UsageError("--prompt-tokens, --chunk-tokens and --no-cpu-split need --disagg")
    n, b = args.prefix_tokens, args.block_tokens
    if b < BLOCK_TOKENS or b % BLOCK_TOKENS:
        raise UsageError(f"--block-tokens must be a positive multiple of vLLM's block size {BLOCK_TOKENS}")
    if n < b or n % b:
        raise UsageError(f"--prefix-tokens must be a positive multiple of --block-tokens ({b})")
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    if args.geometry != "tiny" and args.model_dir is not None:
        raise UsageError(f"--geometry {args.geometry} and --model-dir: one model or the other")
    if args.hidden is not None:
        if args.geometry != "tiny" or args.model_dir is not None:
            where = "--model-dir" if args.model_dir is not None else f"--geometry {args.geometry} (hidden 4096)"
            raise UsageError(f"--hidden applies to --geometry tiny only, not to {where}")
        if args.hidden < 32 or args.hidden % 32:
            raise UsageError("--hidden must be a positive multiple of 32")
    backend = check_backend(args.backend)
    require_vllm()
    return _emit_run(lambda: run(prefix_tokens=n, repeat=args.repeat, hidden=args.hidden or DEFAULT_HIDDEN,
                                 geometry=args.geometry, model_dir=args.model_dir, lmcache=not args.no_lmcache,
                                 block_tokens=b, backend=backend, progress=_progress))
