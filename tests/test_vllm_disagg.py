"""Prefill→decode in real vLLM engines (issue 29; docs/vllm.md "Prefill→decode", binding §6.1).

One loopback cluster (tests/vllm_support.py: a real IS and holder, the relay as a child
process) and three engine processes started once for the module (vLLM's CPU build, a tiny
Llama in fp32, block size 32): a prefill engine (``kv_producer``, prefilling in chunks of 128
tokens: a prompt takes several forward passes) and two decode engines (``kv_consumer``). The
router (``control.router``) runs on loopback HTTP in front of them. A prompt's
reference output is the prefill engine's alone, the connector off.

Faults come from a real process (tests/stream_producer.py) standing in for a prefill engine:
one whose stored layers are corrupted after their digests were computed, and one SIGKILLed
after it streamed half of each block's layers.

Skipped, with the reason, where vLLM is not installed (the ``vllm`` extra).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]', docs/vllm.md)", allow_module_level=True)

from aiohttp import ClientSession  # noqa: E402

from kvsp_moq.cli.demo.disagg import decoder_line  # noqa: E402
from kvsp_moq.integrations.vllm.engine_process import EngineProcess, EngineSpec  # noqa: E402
from kvsp_moq.control.http.server import serve_app  # noqa: E402
from kvsp_moq.control.router import DisaggRouter  # noqa: E402
from kvsp_moq.control.router.routes import make_app  # noqa: E402
from kvsp_moq.integrations.vllm.router import ProcessEngine  # noqa: E402
from kvsp_moq.integrations.vllm.settings import connector_extra_config, kv_transfer_config  # noqa: E402
from kvsp_moq.integrations.vllm.tiny_model import TinyLlama, write_tiny_llama  # noqa: E402
from kvsp_moq.kvsp.blockkeys import block_keys  # noqa: E402
from kvsp_moq.kvsp.scope import scope_id  # noqa: E402

from test_vllm_connector import start_engines  # noqa: E402
from vllm_support import ROOT, LoopbackCluster  # noqa: E402

B = 32
#: The tests' tiny Llama with 8 layers and more compute per token (the same KV per token): each
#: forward pass of the prefill's takes long enough for the first chunks' layers to stream in.
SHAPE = TinyLlama(layers=8, hidden=512, heads=16, intermediate=1024)
SCOPE_KEY = bytes(range(7, 39))
CHUNK = 128
#: 12 full blocks and a tail: the prefill takes 4 forward passes of 128 tokens and one more.
PROMPT_TOKENS = 12 * B + 9
MAX_TOKENS = 8
DEADLINE_MS = 15_000


def _prompt(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, SHAPE.vocab) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    c = LoopbackCluster()
    yield c
    c.close()


def _spec(cluster: LoopbackCluster, model: str, kv_role: str, chunk: int | None = None) -> EngineSpec:
    extra = connector_extra_config(
        index_url=cluster.index_url, relay_url=cluster.relay_url, holder_url=cluster.holder_url,
        index_token=cluster.token, holder_token=cluster.token, ca_file=str(cluster.tls.ca_file),
        scopes={"t": SCOPE_KEY}, default_scope="t", deadline_ms=DEADLINE_MS, moqt_timeout_ms=5_000,
        max_datagram_size=16384)
    return EngineSpec(model, block_size=B, kv_transfer_config=kv_transfer_config(extra, kv_role=kv_role),
                      max_num_batched_tokens=chunk)


@pytest.fixture(scope="module")
def engines(cluster: LoopbackCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    """[prefill, decode 1, decode 2], started together."""
    logs = tmp_path_factory.mktemp("disagg-logs")
    model = str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), SHAPE))
    started = start_engines(("prefill", _spec(cluster, model, "kv_producer", CHUNK)),
                            ("decode 1", _spec(cluster, model, "kv_consumer")),
                            ("decode 2", _spec(cluster, model, "kv_consumer")), logs=logs)
    yield started
    for e in started:
        e.close()


def reference(engines: list[EngineProcess], prompt: list[int]) -> list[int]:
    """The single engine's greedy output: the prefill engine alone, the connector off, a salt
    of its own (vLLM's own cache misses)."""
    answer = engines[0].generate(prompt, max_tokens=MAX_TOKENS, kv_transfer_params={"kvsp": False},
                                 cache_salt=secrets.token_hex(8))
    return list(answer["token_ids"])


async def _post(router: DisaggRouter, body: dict[str, Any]) -> dict[str, Any]:
    server = await serve_app(make_app(router))
    port = server.port
    try:
        async with ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as reply:
                assert reply.status == 200, await reply.text()
                return dict(await reply.json())
    finally:
        await server.close()


def test_one_prefill_streams_each_layer_once_to_two_decoders_while_it_computes(
        cluster: LoopbackCluster, engines: list[EngineProcess]) -> None:
    prompt = _prompt(1)
    expected = reference(engines, prompt)
    prefill, decoders = ProcessEngine(engines[0]), [ProcessEngine(e) for e in engines[1:]]
    before = cluster.relay_stats()
    answer = asyncio.run(_post(DisaggRouter(prefill, decoders, fan_out=2),
                               {"prompt": prompt, "max_tokens": MAX_TOKENS}))
    after = cluster.relay_stats()
    report = answer["kvsp"]
    pre = report["prefill"]["kvsp"]
    blocks = (PROMPT_TOKENS - 1) // B
    assert answer["choices"][0]["token_ids"] == expected
    assert pre["stream"]["as"] == "producer" and pre["blocks_published"] == PROMPT_TOKENS // B
    ends = pre["forward_end_ns"]
    assert len(ends) >= 2  # chunked: several forward passes (the last one is not reported)
    for d in report["decoders"]:
        line = decoder_line(d, expected, max(ends), report["prefill"]["first_token_ns"])
        assert line["outputs_match"], (line, expected)
        assert line["blocks_streamed"] == blocks and line["blocks_failed"] == 0, d["kvsp"]
        assert line["layers_received"] == blocks * SHAPE.layers
        # (how many layers were in before the prefill finished depends on when this decoder
        # subscribed: the stopped-decoder test below subscribes first and counts them)
        assert line["overlap_ms"] is not None
        assert d["kvsp"]["external_tokens"] == blocks * B
    # fan-out: the relay sent every layer to both decoders, and took each from the prefill
    # engine once for the decoders that subscribed in time (one upstream SUBSCRIBE per track);
    # a decoder that subscribed after a block was complete FETCHes it, and the relay forwards
    # that FETCH to the producer (docs/vllm.md "Gaps"): at most one more upstream SUBSCRIBE
    # per track, and what the objects taken in show.
    def delta(name: str) -> int:
        return int(after.get(f"relay_{name}_total", 0) - before.get(f"relay_{name}_total", 0))
    assert delta("objects_out") >= 2 * blocks * SHAPE.layers
    assert blocks <= delta("upstream_subscribes") <= 2 * blocks
    assert delta("objects_in") >= blocks * SHAPE.layers


def _compat_id(engines: list[EngineProcess]) -> str:
    """The decoders' Compatibility ID, from a request that shares (their descriptor's)."""
    answer = engines[1].generate(_prompt(99)[:40], max_tokens=1)
    return str(answer["kv_transfer_params"]["kvsp"]["compat_id"])


def _producer(cluster: LoopbackCluster, engines: list[EngineProcess], prompt: list[int], stream_id: str,
              fault: str) -> subprocess.Popen[str]:
    compat = bytes.fromhex(_compat_id(engines))
    keys = block_keys(SCOPE_KEY, compat, prompt, B)[: (len(prompt) - 1) // B]
    spec = {"relay_url": cluster.relay_url, "ca_file": str(cluster.tls.ca_file), "compat_id": compat.hex(),
            "scope_id": scope_id(SCOPE_KEY).hex(), "block_keys": [k.hex() for k in keys], "stream_id": stream_id,
            "layers": SHAPE.layers, "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim, "kv_dtype": "fp32",
            "tokens": B, "fault": fault, "flip_layer": 1, "half": SHAPE.layers // 2}
    return subprocess.Popen([sys.executable, "tests/stream_producer.py", json.dumps(spec)], cwd=str(ROOT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()  # ends (empty) if the process exits


def _consume(engine: EngineProcess, prompt: list[int], stream_id: str) -> dict[str, Any]:
    return engine.generate(prompt, max_tokens=MAX_TOKENS, timeout=120,
                           kv_transfer_params={"kvsp_stream": {"id": stream_id, "as": "consumer"}})


def test_a_flipped_bit_in_a_streamed_layer_is_never_placed_and_its_block_is_recomputed(
        cluster: LoopbackCluster, engines: list[EngineProcess]) -> None:
    prompt, stream_id = _prompt(2), secrets.token_hex(16)
    expected = reference(engines, prompt)
    producer = _producer(cluster, engines, prompt, stream_id, "flip")
    try:
        assert _line(producer) == "attached"
        assert _line(producer) == "published"
        answer = _consume(engines[1], prompt, stream_id)
    finally:
        assert producer.stdin is not None
        producer.stdin.close()
        producer.wait(30)
    kvsp = answer["kv_transfer_params"]["kvsp"]
    blocks = (PROMPT_TOKENS - 1) // B
    # layer 1 of every block failed its LAYER_DIGEST: no block was placed, each was recomputed
    # (the producer's KV is random: one placed layer would change the output)
    assert kvsp["blocks_failed"] == blocks and kvsp.get("blocks_streamed", 0) == 0, kvsp
    assert answer["token_ids"] == expected


def test_a_prefill_killed_mid_stream_leaves_the_decoder_right(
        cluster: LoopbackCluster, engines: list[EngineProcess]) -> None:
    prompt, stream_id = _prompt(3), secrets.token_hex(16)
    expected = reference(engines, prompt)
    producer = _producer(cluster, engines, prompt, stream_id, "half")
    answers: list[dict[str, Any]] = []
    try:
        assert _line(producer) == "attached"
        assert _line(producer) == "half"
        subscribes = cluster.relay_stats().get("relay_subscribes_total", 0)
        consumer = threading.Thread(target=lambda: answers.append(_consume(engines[2], prompt, stream_id)))
        consumer.start()
        blocks = (PROMPT_TOKENS - 1) // B
        deadline = time.monotonic() + 60
        # the decoder subscribed to every block (and has their first half): now the producer dies
        while cluster.relay_stats().get("relay_subscribes_total", 0) < subscribes + blocks:
            assert time.monotonic() < deadline, "the decoder did not subscribe within 60 s"
            consumer.join(0.05)
        os.kill(producer.pid, signal.SIGKILL)
        consumer.join(120)
        assert not consumer.is_alive()
    finally:
        if producer.poll() is None:
            producer.kill()
        producer.wait(30)
    kvsp = answers[0]["kv_transfer_params"]["kvsp"]
    assert kvsp["blocks_failed"] == blocks and kvsp.get("blocks_streamed", 0) == 0, kvsp
    assert answers[0]["token_ids"] == expected


def test_a_stopped_decoder_never_stalls_the_prefill_or_the_other_decoder(
        cluster: LoopbackCluster, engines: list[EngineProcess]) -> None:
    prompt, stream_id = _prompt(4), secrets.token_hex(16)
    expected = reference(engines, prompt)
    blocks = (PROMPT_TOKENS - 1) // B
    answers: dict[str, dict[str, Any]] = {}

    def ask(name: str, engine: EngineProcess, part: str, max_tokens: int) -> None:
        answers[name] = engine.generate(prompt, max_tokens=max_tokens, timeout=180,
                                        kv_transfer_params={"kvsp_stream": {"id": stream_id, "as": part}})

    requests = cluster.relay_stats().get("relay_requests_total", 0)
    slow = threading.Thread(target=ask, args=("slow", engines[2], "consumer", MAX_TOKENS))
    fast = threading.Thread(target=ask, args=("fast", engines[1], "consumer", MAX_TOKENS))
    slow.start()
    fast.start()
    deadline = time.monotonic() + 60
    # both decoders subscribed to every block (held by the relay until the producer publishes:
    # requests received, not yet SUBSCRIBEs accepted)
    while cluster.relay_stats().get("relay_requests_total", 0) < requests + 2 * blocks:
        assert time.monotonic() < deadline, "the decoders did not subscribe within 60 s"
        fast.join(0.05)
    group = engines[2].process.pid  # the engine's own process group: vLLM's processes too
    os.killpg(group, signal.SIGSTOP)
    try:
        prefill = threading.Thread(target=ask, args=("prefill", engines[0], "producer", 1))
        prefill.start()
        prefill.join(120)
        fast.join(120)
        # neither waited for the stopped decoder: the relay buffers (boundedly) or ends its stream
        assert not prefill.is_alive() and not fast.is_alive()
    finally:
        os.killpg(group, signal.SIGCONT)
    slow.join(180)
    assert not slow.is_alive()
    fast_kvsp = answers["fast"]["kv_transfer_params"]["kvsp"]
    assert fast_kvsp["blocks_streamed"] == blocks and answers["fast"]["token_ids"] == expected
    pre = answers["prefill"]["kv_transfer_params"]["kvsp"]
    assert pre["blocks_published"] == PROMPT_TOKENS // B
    # subscribed before the producer began: the first chunks' layers came while it computed
    line = decoder_line({"engine": "decode 1", **answers["fast"], "kvsp": fast_kvsp}, expected,
                        max(pre["forward_end_ns"]))
    assert line["layers_received_before_prefill_finished"] > 0, line
    # the stopped decoder, once it runs again, is right whichever way it got its KV
    assert answers["slow"]["token_ids"] == expected
