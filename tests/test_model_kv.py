"""kvsp_moq.model KV paths: reused KV loaded through the container layout and layer sinks
gives the output of a recomputation (kvsp-draft §4.3), the layer-wise prefill computes layer l
only once layer l of the prefix is provided, generation and session resumption (§6.8)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvsp_moq.kvsp.container import decode_container
from kvsp_moq.model import (
    EOS_ID,
    KVCache,
    LayerKV,
    ModelConfig,
    ModelError,
    ReferenceModel,
    Sampler,
    block_sections,
    encode_block,
    ensure_model_files,
    generate,
    join_layer_kv,
    kv_from_container,
    layer_payload,
    model_geometry,
)
from kvsp_moq.sinks import LayerFailed, TorchSink

B = 16  # block_tokens of these tests
PROMPT = "KVSP stores the KV cache of shared prefixes; MOQT carries the blocks. Question:"
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # The test machine's cores are shared: one intra-op thread avoids oversubscription.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model_files(ModelConfig(), tmp_path_factory.mktemp("model")).directory


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ReferenceModel:
    return ReferenceModel.load(model_dir)


def tokens_of(stream: Iterator[object]) -> list[int]:
    return [t.token_id for t in stream]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# The receiving path: container -> binding-v1 payloads -> TorchSink buffers


def make_sink(model: ReferenceModel, container: bytes, device: str | None = None) -> tuple[TorchSink, dict[int, bytes]]:
    """An empty sink for a block, and the block's layer payloads (K || V) to deliver."""
    geometry = model_geometry(model.config)
    parsed = decode_container(container, geometry=geometry)
    payloads = {view.index: bytes(parsed.layer_payload(view.index)) for view in parsed.layers()}
    sink = TorchSink(geometry, parsed.header.token_count, (0, model.config.layers - 1),
                     parsed.layer_digests(), device=device)
    return sink, payloads


def deliver(sink: TorchSink, layer: int, payload: bytes, chunk: int = 1000) -> None:
    dest = sink.begin_layer(layer, len(payload))
    assert dest.nbytes == len(payload)
    for start in range(0, len(payload), chunk):
        sink.feed(layer, payload[start : start + chunk])
    assert sink.end_layer(layer)


def loaded_blocks(model: ReferenceModel, cache: KVCache, blocks: int, device: str | None = None) -> list[TorchSink]:
    """Blocks 0..blocks-1 of ``cache`` encoded as containers, received into torch sinks."""
    sinks = []
    for i in range(blocks):
        sink, payloads = make_sink(model, encode_block(cache, i * B, (i + 1) * B), device)
        for layer, payload in payloads.items():
            deliver(sink, layer, payload)
        assert sink.complete
        sinks.append(sink)
    return sinks


def sink_layers(sinks: Sequence[TorchSink], layers: int) -> list[list[LayerKV]]:
    return [[sink.layer(l) for l in range(layers)] for sink in sinks]


# ---------------------------------------------------------------------------------------------
# Forward pass


def test_prefill_then_decode_matches_one_prefill(model: ReferenceModel) -> None:
    ids = model.tokenizer.encode(PROMPT)
    whole = model.prefill(ids)
    assert whole.logits.shape == (len(ids), model.config.vocab_size)
    assert whole.cache.length == len(ids)
    for k, v in whole.new_kv:
        assert k.shape == v.shape == (len(ids), 2, 32) and k.dtype == torch.float32
    part = model.prefill(ids[:10])
    rows = [model.decode(t, part.cache) for t in ids[10:]]
    assert torch.allclose(torch.stack(rows), whole.logits[10:], atol=1e-4, rtol=1e-4)
    for l in range(model.config.layers):
        assert torch.allclose(part.cache.layer(l)[0], whole.cache.layer(l)[0], atol=1e-5)


def test_greedy_output_is_not_one_repeated_token(model: ReferenceModel) -> None:
    for prompt in (PROMPT, "Hello", "a", ""):
        out = tokens_of(generate(model, model.tokenizer.encode(prompt), Sampler.greedy(), 64, stop_ids=()))
        assert len(out) == 64
        assert len(set(out)) >= 8, (prompt, out)
        assert max(out.count(t) for t in set(out)) < 32


def test_cpu_is_deterministic(model_dir: Path, model: ReferenceModel) -> None:
    again = ReferenceModel.load(model_dir)
    ids = model.tokenizer.encode(PROMPT)
    assert torch.equal(model.prefill(ids).logits, again.prefill(ids).logits)


# ---------------------------------------------------------------------------------------------
# Reused KV (the real path) gives the same greedy output as recomputation


def test_reused_kv_gives_the_same_greedy_output(model: ReferenceModel) -> None:
    ids = model.tokenizer.encode(PROMPT)
    assert len(ids) > 3 * B
    scratch = model.new_cache()
    expected = tokens_of(generate(model, ids, Sampler.greedy(), 48, cache=scratch, stop_ids=()))

    # Producer: blocks 0..2 of the first run's cache; consumer: sinks -> prefix cache.
    sinks = loaded_blocks(model, scratch, 3)
    prefix = KVCache.from_blocks(model.config, sink_layers(sinks, model.config.layers))
    assert prefix.length == 3 * B
    for (k, v), (k0, v0) in zip((prefix.layer(l) for l in range(4)), scratch.tokens(0, 3 * B)):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # bit-identical attention inputs

    reused = tokens_of(generate(model, ids, Sampler.greedy(), 48, cache=prefix, stop_ids=()))
    assert reused == expected
    # the tail's logits: reused prefix vs recomputed from scratch
    recomputed = model.prefill(ids).logits[3 * B :]
    again = model.prefill(ids[3 * B :], KVCache.from_blocks(model.config, sink_layers(sinks, 4))).logits
    assert torch.allclose(again, recomputed, atol=1e-4, rtol=1e-4)
    assert torch.equal(again.argmax(-1), recomputed.argmax(-1))


def test_reused_kv_from_a_whole_container(model: ReferenceModel) -> None:
    """The HTTP path: a whole container (§6.7) decoded with kvsp-layout-1 into tensors."""
    ids = model.tokenizer.encode(PROMPT)
    full = model.prefill(ids).cache
    blocks = [kv_from_container(model.config, encode_block(full, i * B, (i + 1) * B)) for i in range(2)]
    prefix = KVCache.from_blocks(model.config, blocks)
    expected = tokens_of(generate(model, ids, Sampler.greedy(), 24))
    assert tokens_of(generate(model, ids, Sampler.greedy(), 24, cache=prefix)) == expected


def test_prefix_covering_the_whole_prompt(model: ReferenceModel) -> None:
    ids = model.tokenizer.encode(PROMPT)[: 2 * B]
    expected = tokens_of(generate(model, ids, Sampler.greedy(), 16, stop_ids=()))
    prefix = KVCache.from_blocks(model.config, sink_layers(loaded_blocks(model, model.prefill(ids).cache, 2), 4))
    assert tokens_of(generate(model, ids, Sampler.greedy(), 16, cache=prefix, stop_ids=())) == expected


def test_block_helpers(model: ReferenceModel) -> None:
    cache = model.prefill(model.tokenizer.encode(PROMPT)).cache
    container = decode_container(encode_block(cache, B, 2 * B), geometry=model_geometry(model.config))
    assert (container.header.first_layer, container.header.layer_count) == (0, 4)
    assert container.header.token_count == B
    for l in range(4):  # binding v1: SHA-256(K || V) is the layer digest (§4.3)
        assert hashlib.sha256(layer_payload(cache, l, B, 2 * B)).digest() == container.layer_digests()[l]
    part = decode_container(encode_block(cache, 0, B, 2, 3))
    assert (part.header.first_layer, part.header.last_layer) == (2, 3)
    (k, v), = block_sections(cache, 0, B, 1, 1)
    assert k.shape == (B, 2, 32) and k.dtype.str == "<f4" and k.flags.c_contiguous
    with pytest.raises(ModelError):
        block_sections(cache, 5, 5)
    with pytest.raises(ModelError):
        encode_block(cache, 0, B, 0, 4)
    with pytest.raises(ModelError):
        cache.tokens(0, 10_000)


# ---------------------------------------------------------------------------------------------
# Layer-wise prefill


def test_layerwise_prefill_is_identical_and_ordered(model: ReferenceModel) -> None:
    ids = model.tokenizer.encode(PROMPT)
    sinks = loaded_blocks(model, model.prefill(ids).cache, 2)
    tail = ids[2 * B :]
    reference = model.prefill(tail, KVCache.from_blocks(model.config, sink_layers(sinks, 4)))

    lp = model.layerwise(tail, prefix_tokens=2 * B)
    with pytest.raises(ModelError, match="ascending order"):
        lp.step(1, *join_layer_kv([s.layer(1) for s in sinks]))
    with pytest.raises(ModelError, match="not computed yet"):
        lp.finish()
    for l in range(model.config.layers):
        assert lp.computed_layers == tuple(range(l))
        new_k, new_v = lp.step(l, *join_layer_kv([s.layer(l) for s in sinks]))
        assert torch.equal(new_k, reference.new_kv[l][0]) and torch.equal(new_v, reference.new_kv[l][1])
        assert lp.computed_layers == tuple(range(l + 1))
    result = lp.finish()
    assert torch.equal(result.logits, reference.logits)  # same code path: bit-identical
    assert result.cache.length == len(ids)
    with pytest.raises(ModelError, match="already"):
        lp.step(4, None, None)


def test_layerwise_rejects_bad_prefix_layers(model: ReferenceModel) -> None:
    lp = model.layerwise([1, 2, 3], prefix_tokens=4)
    good = torch.zeros(4, 2, 32)
    with pytest.raises(ModelError, match="holds 3 tokens"):
        lp.step(0, good[:3], good[:3])
    with pytest.raises(ModelError, match="float16"):
        lp.step(0, good.half(), good.half())
    with pytest.raises(ModelError, match="shape"):
        lp.step(0, torch.zeros(4, 4, 16), torch.zeros(4, 4, 16))
    with pytest.raises(ModelError, match="got none"):
        lp.step(0, None, None)
    with pytest.raises(ModelError, match="prefix_tokens"):
        model.layerwise([1], prefix_tokens=-1)
    with pytest.raises(ModelError, match="vocab|\\[0, 258\\)"):
        model.layerwise([1, 999], prefix_tokens=0)
    zero = model.layerwise([1, 2, 3], prefix_tokens=0)
    for l in range(4):
        zero.step(l, None, None)
    assert torch.equal(zero.finish().logits, model.prefill([1, 2, 3]).logits)


async def test_layerwise_prefill_over_sinks_computes_each_layer_after_it_arrives(
    model: ReferenceModel,
) -> None:
    ids = model.tokenizer.encode(PROMPT)
    source = model.prefill(ids).cache
    containers = [encode_block(source, i * B, (i + 1) * B) for i in range(2)]
    received = [make_sink(model, c) for c in containers]
    sinks = [s for s, _ in received]
    tail = ids[2 * B :]
    reference = model.prefill(tail, KVCache.from_blocks(model.config, sink_layers(
        loaded_blocks(model, source, 2), 4)))

    lp = model.layerwise(tail, prefix_tokens=2 * B)
    waiting = [asyncio.Event() for _ in range(model.config.layers)]
    log: list[tuple[str, int]] = []

    async def wait_layer(l: int) -> LayerKV:
        waiting[l].set()
        return join_layer_kv([await s.wait_for_layer(l) for s in sinks])

    async def feeder() -> None:
        for l in range(model.config.layers):
            await waiting[l].wait()  # the prefill asks for layer l ...
            assert lp.computed_layers == tuple(range(l))  # ... and has not computed it
            for sink, payloads in received:
                deliver(sink, l, payloads[l])
            log.append(("provided", l))

    run = asyncio.ensure_future(lp.run(wait_layer))
    await feeder()
    result = await run
    assert log == [("provided", l) for l in range(4)]
    assert torch.equal(result.logits, reference.logits)

    # a layer that fails to load fails the prefill (the caller then recomputes)
    sink, payloads = make_sink(model, containers[0])
    lp = model.layerwise(ids[B:], prefix_tokens=B)
    deliver(sink, 0, payloads[0])
    sink.abort(1, "stream reset")
    with pytest.raises(LayerFailed):
        await lp.run(sink.wait_for_layer)
    assert lp.computed_layers == (0,)


# ---------------------------------------------------------------------------------------------
# Generation and session resumption (§6.8)


def test_top_p_resumed_at_step_s_reproduces_the_continuation(model: ReferenceModel) -> None:
    ids = model.tokenizer.encode(PROMPT)
    sampler = Sampler.top_p(0.9, temperature=0.9, seed=7)
    first = model.new_cache()
    out = list(generate(model, ids, sampler, 40, cache=first, stop_ids=()))
    assert [t.index for t in out] == list(range(40))
    generated = [t.token_id for t in out]
    assert len(set(generated)) > 8
    for s in (0, 9, 25):
        # the checkpoint: sampler state at step s; the blocks published by the failed instance
        checkpoint = sampler.state.at_step(s).to_json()
        context = ids + generated[:s]
        blocks = len(context) // B
        prefix = KVCache.from_blocks(model.config, sink_layers(loaded_blocks(model, first, blocks), 4))
        resumed = Sampler.restore(checkpoint["method"], checkpoint["params"], checkpoint["seed"],
                                  checkpoint["step"])
        rest = list(generate(model, context, resumed, 40 - s, cache=prefix, stop_ids=()))
        assert [t.index for t in rest] == list(range(s, 40))
        assert [t.token_id for t in rest] == generated[s:]


def test_generate_inputs_and_stop(model: ReferenceModel) -> None:
    ids = model.tokenizer.encode("abc")
    assert list(generate(model, ids, Sampler.greedy(), 0)) == []
    with pytest.raises(ModelError):
        generate(model, [], Sampler.greedy(), 4)
    with pytest.raises(ModelError):
        generate(model, [1, 300], Sampler.greedy(), 4)
    with pytest.raises(ModelError):
        generate(model, ids, Sampler.greedy(), -1)
    long_cache = model.prefill(model.tokenizer.encode("abcdef")).cache
    with pytest.raises(ModelError, match="more than"):
        list(generate(model, ids, Sampler.greedy(), 2, cache=long_cache))
    other = KVCache(ModelConfig(layers=2), model.device)
    with pytest.raises(ModelError, match="another model config"):
        list(generate(model, ids, Sampler.greedy(), 2, cache=other))
    # EOS ends the stream after it is yielded
    first = next(iter(generate(model, ids, Sampler.greedy(), 1)))
    stopped = list(generate(model, ids, Sampler.greedy(), 10, stop_ids={first.token_id}))
    assert [t.token_id for t in stopped] == [first.token_id]
    assert EOS_ID == 257


def test_cache_grows_and_truncates(model: ReferenceModel) -> None:
    cache = KVCache(model.config, capacity=2)
    ids = model.tokenizer.encode(PROMPT)[:20]
    out = model.prefill(ids[:3], cache)
    for t in ids[3:]:
        model.decode(t, cache)
    assert cache.length == 20
    assert torch.allclose(cache.layer(3)[0], model.prefill(ids).cache.layer(3)[0], atol=1e-5)
    cache.truncate(5)
    assert cache.length == 5 and out.cache is cache
    with pytest.raises(ModelError):
        cache.truncate(6)
    with pytest.raises(ModelError, match="all 4 layers"):
        KVCache.from_layers(model.config, [])


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_reused_kv_and_layerwise(model_dir: Path, model: ReferenceModel) -> None:
    gpu = ReferenceModel.load(model_dir, device="cuda")
    ids = gpu.tokenizer.encode(PROMPT)
    cpu_logits = model.prefill(ids).logits
    gpu_run = gpu.prefill(ids)
    assert gpu_run.logits.device.type == "cuda"
    assert torch.allclose(gpu_run.logits.cpu(), cpu_logits, atol=1e-3, rtol=1e-3)
    expected = tokens_of(generate(gpu, ids, Sampler.greedy(), 24, stop_ids=()))
    # blocks received through the CUDA sink path (pinned staging, side stream, events)
    sinks = loaded_blocks(gpu, gpu_run.cache, 2, device="cuda")
    prefix = KVCache.from_blocks(gpu.config, sink_layers(sinks, 4), device="cuda")
    for l in range(4):
        assert torch.equal(prefix.layer(l)[0], gpu_run.cache.tokens(0, 2 * B)[l][0])
    assert tokens_of(generate(gpu, ids, Sampler.greedy(), 24, cache=prefix, stop_ids=())) == expected
    lp = gpu.layerwise(ids[2 * B :], prefix_tokens=2 * B)
    for l in range(4):
        lp.step(l, *join_layer_kv([s.layer(l) for s in sinks]))
    again = gpu.prefill(ids[2 * B :], KVCache.from_blocks(gpu.config, sink_layers(sinks, 4), device="cuda"))
    assert torch.equal(lp.finish().logits, again.logits)


def test_device_errors(model_dir: Path) -> None:
    with pytest.raises(ModelError, match="not supported"):
        ReferenceModel.load(model_dir, device="meta")
    if not CUDA:
        with pytest.raises(ModelError, match="CUDA is not available"):
            ReferenceModel.load(model_dir, device="cuda")
