"""Faults of the control plane an instance's data path depends on (issue 19), with real peers
(tests/faults_support.py): an IS that stops answering, a PC that stops answering in the middle
of a session (real sockets that accept and never answer: :class:`~faults_support.Gate`), and
the ``moqt://`` records an instance publishes (refreshed before their TTL, withdrawn when its
store evicts the block) on an IS driven by a manual clock.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("torch")

from kvsp_moq.bridge.binding import MAX_CACHE_DURATION  # noqa: E402
from kvsp_moq.control.common.clock import ManualClock  # noqa: E402
from kvsp_moq.control.common.config import ControlConfig, FrontEndConfig, PcConfig  # noqa: E402
from kvsp_moq.control.frontend.serve import serve_frontend  # noqa: E402
from kvsp_moq.control.instance.serve import INSTANCE_SERVICE  # noqa: E402
from kvsp_moq.control.pc.serve import serve_pc  # noqa: E402
from kvsp_moq.model import ByteTokenizer, ReferenceModel, Sampler, generate  # noqa: E402
from faults_support import (  # noqa: E402
    PROMPT,
    SCOPE_ID,
    SLACK_S,
    TOKEN,
    Cluster,
    Gate,
    cluster_of,
    engine_of,
    everyone,
    model_dir,
    request,
    sources,
    store_of,
    within,
)

__all__ = ["model_dir"]  # the module-scoped fixture, used by name

INDEX_S = 0.5  # [instance.engine] index_timeout_s of these tests
CHECKPOINT_MS = 300  # [instance] checkpoint_timeout_ms of these tests


@pytest.fixture
async def cluster(tmp_path: Path, model_dir: Path) -> AsyncIterator[Cluster]:
    async for c in cluster_of(tmp_path, model_dir):
        yield c


@pytest.fixture
async def gate() -> AsyncIterator[Gate]:
    """A black hole: accepts connections, never answers."""
    g = await Gate().start()
    try:
        yield g
    finally:
        await g.stop()


def reference_output(model_dir: Path, prompt: str, max_tokens: int) -> list[int]:
    """Greedy output recomputing everything, with the model alone."""
    model = ReferenceModel.load(directory=model_dir)
    return [t.token_id for t in generate(model, ByteTokenizer().encode(prompt), Sampler.greedy(), max_tokens)]


async def test_an_is_that_stops_answering_the_instance_recomputes_within_its_bound(
        cluster: Cluster, gate: Gate, model_dir: Path) -> None:
    # Blocks of the prompt exist (A published them), but B's IS is a black hole.
    a = await cluster.instance()
    cold = await within(engine_of(a).generate(everyone(), request()))
    b = await cluster.instance(index_url=gate.url, engine={"index_timeout_s": INDEX_S})
    eb = engine_of(b)
    # it keeps serving: the first request recomputes what it cannot look up, the next one
    # reuses what the first computed (its own store), each asking the IS in vain first
    for expected in ("recomputed", "local"):
        warm = await within(eb.generate(everyone(), request()))
        assert warm.matched == 0 and sources(warm) == [expected] * len(cold.blocks)
        assert [t.token for t in warm.tokens] == [t.token for t in cold.tokens]
        if expected == "recomputed":
            published = warm.published
        # bound: the lookup is given up after index_timeout_s; each record publication the
        # answer waits for (own store + IS, moqt://: here none, no relay) likewise
        assert warm.ttft_ms / 1000 <= INDEX_S + SLACK_S, warm.ttft_ms
        assert warm.total_ms / 1000 <= INDEX_S * (1 + len(cold.blocks)) + SLACK_S, warm.total_ms
    assert gate.held >= 2 and eb.counters.lookup_failures == 2
    assert published == ("holder", "store")  # the holder (alive) took the blocks
    assert [t.token for t in cold.tokens] == reference_output(model_dir, PROMPT, 12)


async def test_a_pc_that_stops_answering_mid_session_the_session_still_completes(
        cluster: Cluster, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvsp_moq.control.instance.sessions")
    auth = cluster.auth
    pcc = PcConfig(index_url=cluster.index.url, index_token=TOKEN, instance_token=TOKEN)
    pc = await cluster.stack.enter_async_context(await serve_pc(ControlConfig(auth=auth, pc=pcc), clock=cluster.clock))
    fe = await cluster.stack.enter_async_context(await serve_frontend(
        ControlConfig(auth=auth, frontend=FrontEndConfig(pc_url=pc.url, pc_token=TOKEN))))
    # The instance reaches the PC through a gate that turns into a black hole at the first
    # checkpoint: the PC is gone for it from then on, mid-session (the PC itself still places).
    pc_gate = await Gate(pc.url, trigger=b"/checkpoint").start()
    cluster.stack.push_async_callback(pc_gate.stop)
    inst = await cluster.instance(sessions=True, pc_url=pc_gate.url,
                                  instance={"checkpoint_every": 8, "checkpoint_timeout_ms": CHECKPOINT_MS})
    ids = ByteTokenizer().encode(PROMPT)
    n = 40
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        body = {"compat_id": engine_of(inst).compat_id.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": [],
                "prompt_tail": ids, "tokens": len(ids), "max_tokens": n,
                "sampler": {"method": "greedy", "params": {}, "seed": 0, "step": 0, "deterministic": True}}
        async with http.post(f"{fe.url}sessions", data=json.dumps(body),
                             headers={"Content-Type": "application/kvsp+json"}) as resp:
            assert resp.status == 201, await resp.text()
            started = await resp.json(content_type=None)
        assert started["instance"] == inst.app[INSTANCE_SERVICE].url
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        lines: list[dict[str, Any]] = []
        async with http.get(started["tokens_url"]) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                lines.append(json.loads(raw))
        elapsed = loop.time() - t0
    assert pc_gate.closed.is_set()  # the PC stopped answering the instance mid-session
    tokens = [line for line in lines if "token" in line]
    # every index exactly once, the model's greedy output, and the end
    assert [t["index"] for t in tokens] == list(range(n))
    assert [t["token"] for t in tokens] == reference_output(model_dir, PROMPT, n)
    assert "end" in json.dumps(lines[-1])
    # bound: each unanswered checkpoint (every 8 tokens, the last, session_done) costs at most
    # checkpoint_timeout_ms; the session never waited for the PC longer than that
    unanswered = n // 8 + 2
    assert elapsed <= unanswered * CHECKPOINT_MS / 1000 + SLACK_S, elapsed
    assert engine_of(inst).counters.failed_sessions == 0 and engine_of(inst).counters.sessions == 1
    skipped = [r for r in caplog.records if "not acknowledged" in r.getMessage()]
    assert len(skipped) >= n // 8 - 1, [r.getMessage() for r in caplog.records]  # checkpoints skipped, not fatal


async def test_moqt_records_are_refreshed_before_their_ttl_and_withdrawn_on_eviction(
        tmp_path: Path, model_dir: Path) -> None:
    clock = ManualClock(1_000_000)
    async for c in cluster_of(tmp_path, model_dir, clock):
        relay = await c.relay()
        ttl = 3_000
        a = await c.instance(relay=relay, engine={"record_ttl_ms": ttl}, instance={"record_ttl_ms": 600_000})
        ea = engine_of(a)
        cold = await within(ea.generate(everyone(), request()))
        keys = c.keys()[: len(cold.blocks)]
        assert "moqt" in cold.published

        def moqt_holders(answer: Any) -> list[list[str]]:
            return [[r.holder for r in blk.replicas if r.holder.startswith("moqt:")] for blk in answer.blocks]

        assert moqt_holders(await c.lookup(keys)) == [[relay.url]] * len(keys)
        records = ea.publisher.moqt_records
        assert records is not None
        # A third of the TTL later the records are due: refreshed (the background loop does
        # this every refresh_ms / 4; here the test calls it, on the manual clock)
        clock.advance(ttl // 3 + 1)
        assert await within(records.refresh()) == len(keys)
        clock.advance(ttl - ttl // 3)  # past the first TTL: without the refresh they would be gone
        assert moqt_holders(await c.lookup(keys)) == [[relay.url]] * len(keys)
        # ... and the tracks tell relays the refreshed TTL as their MAX_CACHE_DURATION (binding §7):
        # the refresh's TTL less the time since (on the manual clock), not the first record's
        holder = ea.moqt_holder
        assert holder is not None
        for key in keys:
            track = holder.track(key)
            assert track is not None
            assert dict(track.response_properties())[MAX_CACHE_DURATION] == ttl - (ttl - ttl // 3)
        # The store evicts a block: its moqt:// record is withdrawn (with the relay namespace)
        victim = keys[1]
        store_of(a).remove(victim)
        await within(records.flush())
        await within(a.app[INSTANCE_SERVICE].prefetch.publisher.flush())  # type: ignore[union-attr]
        answer = await c.lookup(keys)
        assert moqt_holders(answer)[1] == [] and moqt_holders(answer)[0] == [relay.url]
        assert a.app[INSTANCE_SERVICE].url not in {r.holder for r in answer.blocks[1].replicas}
        # ... and stays withdrawn: the next refreshes do not bring it back
        clock.advance(ttl)
        await within(records.refresh())
        assert moqt_holders(await c.lookup(keys))[1] == []


def test_every_bound_is_a_configuration_key_with_its_default(tmp_path: Path) -> None:
    """The keys of docs/reliability.md: read from the TOML, defaults as documented, a bad value
    is a ConfigError naming the key."""
    from kvsp_moq.control.common.config import InstanceConfig, load_config
    from kvsp_moq.control.common.engine_config import EngineConfig
    from kvsp_moq.control.common.errors import ConfigError

    assert (EngineConfig().moqt_idle_timeout_s, EngineConfig().index_timeout_s, EngineConfig().moqt_timeout_s) == (2.0, 2.0, 10.0)
    assert (InstanceConfig().checkpoint_timeout_ms, InstanceConfig().delivery_deadline_ms) == (10_000, 15_000)
    path = tmp_path / "ii.toml"
    path.write_text('[instance]\nindex_url = "http://127.0.0.1:1/"\ncheckpoint_timeout_ms = 250\n'
                    'delivery_deadline_ms = 4000\n[instance.engine]\nmoqt_idle_timeout_s = 0.75\nindex_timeout_s = 1.5\n')
    ic = load_config(path).instance
    assert ic.engine is not None and (ic.engine.moqt_idle_timeout_s, ic.engine.index_timeout_s) == (0.75, 1.5)
    assert (ic.checkpoint_timeout_ms, ic.delivery_deadline_ms) == (250, 4000)
    for section, line, key in (("[instance.engine]", "moqt_idle_timeout_s = 0", "instance.engine.moqt_idle_timeout_s"),
                               ("[instance.engine]", 'index_timeout_s = "soon"', "instance.engine.index_timeout_s"),
                               ("", "checkpoint_timeout_ms = 0", "instance.checkpoint_timeout_ms"),
                               ("", "delivery_deadline_ms = -1", "instance.delivery_deadline_ms")):
        path.write_text(f'[instance]\nindex_url = "http://127.0.0.1:1/"\n{section}\n{line}\n')
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert err.value.key == key


def test_the_holder_s_relay_sessions_take_their_liveness_and_backoff_from_holder_keys(tmp_path: Path) -> None:
    """``[holder] moqt_keepalive_ms`` ... (docs/http-api.md): defaults as the engine's, read from
    the TOML into the ``Reconnect`` the holder's relay links use, bad values named."""
    from kvsp_moq.control.common.config import HolderConfig, load_config
    from kvsp_moq.control.common.engine_config import EngineConfig
    from kvsp_moq.control.common.errors import ConfigError

    assert HolderConfig().moqt_reconnect == EngineConfig().moqt_reconnect
    path = tmp_path / "h.toml"
    path.write_text("[holder]\nmoqt_keepalive_ms = 250\nmoqt_liveness_timeout_ms = 750\n"
                    "moqt_reconnect_initial_ms = 20\nmoqt_reconnect_max_ms = 400\n")
    r = load_config(path).holder.moqt_reconnect
    assert (r.keepalive, r.liveness_timeout, r.backoff_initial, r.backoff_max) == (0.25, 0.75, 0.02, 0.4)
    for line, key in (("moqt_keepalive_ms = -1", "holder.moqt_keepalive_ms"),
                      ("moqt_liveness_timeout_ms = 0", "holder.moqt_liveness_timeout_ms"),
                      ("moqt_reconnect_initial_ms = 9000", "holder.moqt_reconnect_initial_ms")):
        path.write_text(f"[holder]\n{line}\n")
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert err.value.key == key
