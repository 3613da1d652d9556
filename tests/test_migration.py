"""Session migration on the reference model (kvsp-draft §6.8), end to end with real processes.

An IS, an HTTP holder, a PC and a front end on 127.0.0.1 (in this process, so the test sees
each delivery and checkpoint as it happens), and two ``kvsp instance`` processes running the
tiny reference model with model-backed sessions (``control/instance/model_sessions.py``). The instance
serving a session is killed with SIGKILL mid-generation; the PC learns it (the test reports
it as a supervisor would, or the instance's status expires), raises the session epoch and
resumes the latest checkpoint on the other instance, which loads the published blocks,
recomputes the rest, restores the sampler and continues. The client's stream must equal an
uninterrupted run computed here with the model directly, every index exactly once.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvsp_moq.control.common.session_records import DeliveryAnswer, OutputTokens  # noqa: E402
from kvsp_moq.kvsp.blockkeys import BlockKeyChain  # noqa: E402
from kvsp_moq.kvsp.compat import compat_id as derive_compat_id  # noqa: E402
from kvsp_moq.model import (  # noqa: E402
    ByteTokenizer, KVCache, ReferenceModel, Sampler, build_descriptor, ensure_model_files, generate)
from test_migration_support import B, PROMPT, SCOPE_ID, SCOPE_KEY, Cluster, cluster, guarded, sampler_json  # noqa: E402

KV_OCTETS_PER_TOKEN = 4 * 2 * 2 * 32 * 4  # layers x (K, V) x kv_heads x head_dim x fp32


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], bytes]:
    torch.set_num_threads(1)
    files = ensure_model_files(directory=tmp_path_factory.mktemp("model"))
    descriptor = build_descriptor(files, block_tokens=B)
    return files.directory, descriptor, derive_compat_id(descriptor)


def kill_when(c: Cluster, sid: uuid.UUID, index: int) -> asyncio.Event:
    """Kill the instance serving ``sid`` the moment the front end takes a token of epoch 1
    with an index >= ``index`` (the instance is then waiting for this very answer); the event
    is set once it is killed."""
    killed = asyncio.Event()

    def observe(session: uuid.UUID, batch: OutputTokens, answer: DeliveryAnswer | None) -> None:
        if session != sid or killed.is_set() or batch.epoch != 1 or not batch.tokens:
            return
        if max(t.index for t in batch.tokens) >= index:
            url = c.pc_service.sessions.entry(sid).instance
            assert url is not None
            c.kill(url)
            killed.set()

    c.fe_service.observers.append(observe)
    return killed


def expect_stream(lines: list[dict[str, Any]], reference: list[int]) -> None:
    assert lines[-1] == {"end": len(reference)}
    assert [line["index"] for line in lines[:-1]] == list(range(len(reference)))  # each index once, in order
    assert [line["token"] for line in lines[:-1]] == reference


async def test_greedy_session_survives_sigkill_reported_by_a_supervisor(tmp_path: Path, model_files: Any) -> None:
    model_dir, descriptor, compat = model_files
    ids = ByteTokenizer().encode(PROMPT)  # 55 tokens: 3 prompt blocks and a tail of 7
    n, kill_at = 48, 30
    async with cluster(tmp_path, model_dir, descriptor, compat) as c:
        a = await c.start_instance("a")
        b = await c.start_instance("b")
        # An earlier request computed the prompt's blocks (published to a's store, the IS and
        # the holder): the session reuses them by Block Key (§6.8 step 1, prompt_blocks).
        warm = await c.call("POST", f"{a}generate", {"scope_id": SCOPE_ID.hex(), "prompt_ids": ids, "max_tokens": 1})
        assert warm.status == 200, warm.body
        keys = BlockKeyChain(SCOPE_KEY, compat, B).extend(ids)
        usable = (len(ids) - 1) // B
        started = await c.open_session({
            "compat_id": compat.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": [k.hex() for k in keys[:usable]],
            "prompt_tail": ids[usable * B:], "tokens": len(ids), "sampler": sampler_json("greedy"), "max_tokens": n})
        sid = uuid.UUID(started["session"])
        killed = kill_when(c, sid, kill_at)
        reader = asyncio.ensure_future(c.stream(started["tokens_url"]))
        first = started["instance"]
        assert first in (a, b)
        await guarded(killed.wait())
        assert await c.wait_dead(first) == -signal.SIGKILL
        # the test is the supervisor: it saw the process die and tells the PC (§6.8 failure)
        moved = await c.call("POST", f"{c.pc.url}failures", {"instance": first})
        assert moved.status == 200, moved.body
        other = b if first == a else a
        assert moved.json["sessions"] == [{"session": str(sid), "instance": other, "epoch": 2, "output_offset": 25}]
        lines = await guarded(reader)

        # The reference: the same computation, uninterrupted, with the model here: the prompt
        # blocks as an earlier one-shot prefill computed them, the tail prefilled, then decoding.
        model = ReferenceModel.load(directory=model_dir)
        full = model.prefill(ids)
        prefix = KVCache.from_blocks(model.config, [[full.cache.tokens(i * B, (i + 1) * B)[l] for l in range(4)]
                                                    for i in range(usable)])
        reference = [t.token_id for t in generate(model, ids, Sampler.greedy(), n, cache=prefix)]
        expect_stream(lines, reference)

        tally = c.fe_service.tally(sid)
        assert tally is not None
        # epoch 1 delivered 0..30 (the kill came during the answer to 30); epoch 2 re-sent the
        # checkpoint's 25 tokens, regenerated 25..30 (dropped by index) and delivered the rest
        assert tally.accepted == {1: kill_at + 1, 2: n - kill_at - 1}
        assert tally.duplicates == kill_at + 1 and tally.stale_batches == 0
        # §6.8 step 1 at the new instance: the context 55 + 25 = 80 tokens has 5 complete blocks;
        # the 4 before the last token were loaded (3 prompt blocks and the first generated one,
        # published by the dead instance), none recomputed; 16 generated tokens were decoded again
        stats = (await c.call("GET", f"{other}engine")).json["counters"]
        loaded = stats["request_blocks"]
        assert sum(loaded[s]["blocks"] for s in ("local", "moqt", "http")) == 4
        # the prompt blocks are local at the new instance: it ran the earlier request itself, or
        # the PC sent it a prefetch directive for them with the resume (§6.5, request_ref = the
        # session id), loaded from the holder (the dead instance's copy is gone) before it ran;
        # the generated block, unknown to the PC, was loaded by the session from the holder
        assert loaded["local"]["blocks"] == usable and loaded["http"]["blocks"] == 1
        assert loaded["http"]["octets"] == B * KV_OCTETS_PER_TOKEN
        prefetched = stats["prefetch_blocks"]["http"]["blocks"]
        assert prefetched == (0 if other == a else usable)
        assert (await c.call("GET", f"{c.pc.url}sessions/{sid}")).status == 404  # done: the PC forgot it



async def test_top_p_session_releases_nothing_unacknowledged_and_survives_status_expiry(tmp_path: Path, model_files: Any) -> None:
    model_dir, descriptor, compat = model_files
    ids = ByteTokenizer().encode(PROMPT)
    n, seed = 40, 11
    async with cluster(tmp_path, model_dir, descriptor, compat) as c:
        # a short status TTL: the PC finds the dead instance's record expired (§6.3) when the
        # live one reports next, and migrates its sessions then; no supervisor involved
        a = await c.start_instance("a", status_ttl_ms=3000, checkpoint_every=8)
        b = await c.start_instance("b", status_ttl_ms=3000, checkpoint_every=8)
        started = await c.open_session({
            "compat_id": compat.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": [], "prompt_tail": ids,
            "tokens": len(ids), "sampler": sampler_json("top-p", seed=seed, p=0.9, deterministic=False), "max_tokens": n})
        sid = uuid.UUID(started["session"])
        first = started["instance"]
        # §6.8 MUST NOT: every token the front end takes is covered by the checkpoint the PC
        # keeps at that instant (PC and front end share this process: the check is exact)
        checked: list[tuple[int, int, int]] = []  # (epoch, highest index, acknowledged offset)

        def covered(session: uuid.UUID, batch: OutputTokens, answer: DeliveryAnswer | None) -> None:
            if session == sid and batch.tokens:
                acknowledged = c.pc_service.sessions.entry(sid).checkpoint.output_offset
                checked.append((batch.epoch, max(t.index for t in batch.tokens), acknowledged))

        c.fe_service.observers.append(covered)
        killed = kill_when(c, sid, 16)  # during the release of the batch that the checkpoint at 17 covers
        reader = asyncio.ensure_future(c.stream(started["tokens_url"]))
        await guarded(killed.wait())
        assert await c.wait_dead(first) == -signal.SIGKILL
        lines = await guarded(reader)  # ends only if the PC noticed the expiry and resumed elsewhere

        model = ReferenceModel.load(directory=model_dir)
        reference = [t.token_id for t in generate(model, ids, Sampler.top_p(0.9, seed=seed), n)]
        expect_stream(lines, reference)  # a seeded top-p resumed at its step draws the same sample

        assert checked and all(index < acknowledged for _, index, acknowledged in checked), checked
        assert any(index - prior > 1 for (_, prior, _), (_, index, _) in zip(checked, checked[1:]))  # batched
        tally = c.fe_service.tally(sid)
        assert tally is not None
        # epoch 1 released exactly what checkpoints 8, 9 and 17 covered; nothing beyond
        assert tally.accepted == {1: 17, 2: n - 17} and tally.duplicates == 17
        other = b if first == a else a
        stats = (await c.call("GET", f"{other}engine")).json["counters"]
        # context 55 + 17 = 72 tokens: 4 complete blocks before the last token, all published
        # by the dead instance and loaded from the holder; 8 tokens decoded again
        assert stats["request_blocks"]["http"] == {"blocks": 4, "octets": 4 * B * KV_OCTETS_PER_TOKEN}


def test_the_session_engine_key_of_the_instance_section(tmp_path: Path) -> None:
    from kvsp_moq.control.common.config import load_config
    from kvsp_moq.control.common.errors import ConfigError

    (tmp_path / "ok.toml").write_text('[instance]\nsession_engine = "none"\n')
    assert load_config(tmp_path / "ok.toml").instance.session_engine == "none"
    assert load_config(tmp_path / "ok.toml").instance.engine is None
    (tmp_path / "bad.toml").write_text('[instance]\nsession_engine = "gpu"\n')
    with pytest.raises(ConfigError, match="instance.session_engine"):
        load_config(tmp_path / "bad.toml")
