"""Active/standby PCs during generation (``control/pc/leader.py``): real ``kvsp pc`` processes
over a real ``redis-server``, real ``kvsp instance`` processes running the reference model, the
IS, holder and front end in this process (tests/test_migration_support.py).

- SIGKILL the active PC mid-generation (greedy, and seeded top-p whose tokens wait for the
  PC's acknowledgement, §6.8): the instance's checkpoints and its ``done`` fail over to the
  standby once it holds the lock, and the client's stream at the front end has every index
  exactly once, equal to an uninterrupted run of the model.
- SIGKILL the active PC and the instance serving a session at once: the new PC finds the
  instance failed (its record, given a fresh TTL at the takeover, expires) and migrates the
  session from the stored checkpoint; every index once.

Nothing waits by sleeping: every wait is on a process line, an HTTP answer, a stream or an event.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from redis_support import RedisServer, redis_server  # noqa: F401
from test_migration_support import Cluster, cluster, guarded, sampler_json
from test_pc_failover import PcProcess, get, pc_processes

torch = pytest.importorskip("torch")

from kvsp_moq.kvsp.compat import compat_id as derive_compat_id  # noqa: E402
from kvsp_moq.model import ByteTokenizer, ReferenceModel, Sampler, build_descriptor, ensure_model_files, generate  # noqa: E402
from test_migration_support import B, PROMPT, SCOPE_ID  # noqa: E402


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], bytes]:
    torch.set_num_threads(1)
    files = ensure_model_files(directory=tmp_path_factory.mktemp("model"))
    descriptor = build_descriptor(files, block_tokens=B)
    return files.directory, descriptor, derive_compat_id(descriptor)


def kill_when(c: Cluster, sid: uuid.UUID, pc: PcProcess, index: int) -> asyncio.Event:
    """SIGKILL ``pc`` the moment the front end takes a token of ``sid`` with an index >= ``index``."""
    killed = asyncio.Event()

    def observe(session: uuid.UUID, batch: Any, answer: Any) -> None:
        if session == sid and not killed.is_set() and batch.tokens and max(t.index for t in batch.tokens) >= index:
            pc.kill()
            killed.set()

    c.fe_service.observers.append(observe)
    return killed


@pytest.mark.parametrize("method", ["greedy", "top-p"])
async def test_sigkill_the_active_pc_mid_generation_every_index_once(
        tmp_path: Path, model_files: Any, redis_server: RedisServer, method: str) -> None:
    model_dir, descriptor, compat = model_files
    ids = ByteTokenizer().encode(PROMPT)
    n, seed, kill_at = 40, 11, 7
    async with pc_processes(tmp_path, redis_server.url) as pcs:
        active = await pcs.start("pc1")
        standby = await pcs.start("pc2")
        async with cluster(tmp_path, model_dir, descriptor, compat, pc_urls=(active.url, standby.url)) as c:
            instance = await c.start_instance("a", checkpoint_every=8)
            deterministic = method == "greedy"
            started = await c.open_session({
                "compat_id": compat.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": [], "prompt_tail": ids,
                "tokens": len(ids), "sampler": sampler_json(method, seed=seed, p=0.9, deterministic=deterministic),
                "max_tokens": n})
            sid = uuid.UUID(started["session"])
            assert started["instance"] == instance and started["epoch"] == 1
            # top-p: the first batch is released on the acknowledgement of the checkpoint at 8
            killed = kill_when(c, sid, active, kill_at)
            reader = asyncio.ensure_future(c.stream(started["tokens_url"]))
            await guarded(killed.wait())
            assert await guarded(active.proc.wait()) == -signal.SIGKILL
            lines = await guarded(reader)  # ends only if the standby took the checkpoints and the end

            model = ReferenceModel.load(directory=model_dir)
            sampler = Sampler.greedy() if deterministic else Sampler.top_p(0.9, seed=seed)
            reference = [t.token_id for t in generate(model, ids, sampler, n)]
            assert lines[-1] == {"end": n}
            assert [line["index"] for line in lines[:-1]] == list(range(n))  # every index once, in order
            assert [line["token"] for line in lines[:-1]] == reference
            tally = c.fe_service.tally(sid)
            assert tally is not None and tally.accepted == {1: n} and tally.duplicates == 0  # no migration needed
            status, _ = await get(c.http, f"{standby.url}sessions/{sid}")
            assert status == 404, c.logs()  # the standby, now active, received the session's done and forgot it


async def test_the_standby_takes_over_the_duties_and_migrates_a_session_whose_instance_died_too(
        tmp_path: Path, model_files: Any, redis_server: RedisServer) -> None:
    """SIGKILL the active PC and, at the same moment, the instance serving the session. The
    standby takes over; the dead instance's record (a fresh TTL from the takeover) expires;
    the live instance's next report makes the new PC migrate the session there (§6.3/§6.8),
    from the checkpoint the old PC stored, at a new epoch."""
    model_dir, descriptor, compat = model_files
    ids = ByteTokenizer().encode(PROMPT)
    n, kill_at = 40, 12
    async with pc_processes(tmp_path, redis_server.url) as pcs:
        active = await pcs.start("pc1")
        standby = await pcs.start("pc2")
        async with cluster(tmp_path, model_dir, descriptor, compat, pc_urls=(active.url, standby.url)) as c:
            a = await c.start_instance("a", status_ttl_ms=3000, checkpoint_every=8)
            b = await c.start_instance("b", status_ttl_ms=3000, checkpoint_every=8)
            started = await c.open_session({
                "compat_id": compat.hex(), "scope_id": SCOPE_ID.hex(), "prompt_blocks": [], "prompt_tail": ids,
                "tokens": len(ids), "sampler": sampler_json("greedy"), "max_tokens": n})
            sid = uuid.UUID(started["session"])
            first = started["instance"]
            killed = asyncio.Event()

            def observe(session: uuid.UUID, batch: Any, answer: Any) -> None:
                if session == sid and not killed.is_set() and batch.tokens and max(t.index for t in batch.tokens) >= kill_at:
                    active.kill()
                    c.kill(first)
                    killed.set()

            c.fe_service.observers.append(observe)
            reader = asyncio.ensure_future(c.stream(started["tokens_url"]))
            await guarded(killed.wait())
            assert await c.wait_dead(first) == -signal.SIGKILL
            lines = await guarded(reader)  # ends only if the new PC migrated the session

            model = ReferenceModel.load(directory=model_dir)
            reference = [t.token_id for t in generate(model, ids, Sampler.greedy(), n)]
            assert lines[-1] == {"end": n}
            assert [line["index"] for line in lines[:-1]] == list(range(n))
            assert [line["token"] for line in lines[:-1]] == reference
            tally = c.fe_service.tally(sid)
            assert tally is not None and set(tally.accepted) == {1, 2}  # epoch 2: the new PC resumed it
            assert sum(tally.accepted.values()) == n
            other = b if first == a else a
            status, views = await get(c.http, f"{standby.url}instances")
            assert status == 200
            assert {v["instance"]: v["state"] for v in views["instances"]} == {first: "failed", other: "active"}
