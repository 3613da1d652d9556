"""Active/standby Placement Controllers over one Redis (``control/pc/leader.py``), with real
``kvsp pc`` processes, a real ``redis-server`` on a free loopback port and, for the generation
tests, a real ``kvsp instance`` process running the reference model.

- Two PCs over one Redis: only the one holding the leader lock answers; the other answers
  503 ``kvsp-not-leader``. SIGKILL the active one: the standby takes over with its state
  (instances and their highest epochs), and a restarted PC is a standby. SIGSTOP the active
  one past its lease: once resumed, its writes are refused by the store (fencing).
- SIGKILL the active PC and the instance serving a session at once: the new PC finds the
  instance failed (its record, given a fresh TTL at the takeover, expires) and migrates the
  session from the stored checkpoint; every index once.
- SIGKILL the active PC mid-generation (greedy, and seeded top-p whose tokens wait for the
  PC's acknowledgement, §6.8): the instance's checkpoints and its ``done`` fail over to the
  standby once it holds the lock, and the client's stream at the front end has every index
  exactly once, equal to an uninterrupted run of the model.

Nothing waits by sleeping; the one poll (for the standby to take the lock) is bounded and
polls another process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from redis_support import RedisServer, redis_server  # noqa: F401
from test_migration_support import PRINCIPALS_TOML, TOKEN, Cluster, cluster, guarded, sampler_json

LEASE_MS = 1_000  # a standby takes over within about 4/3 of this
POLL_S = 0.05


@dataclass
class PcProcess:
    url: str
    proc: asyncio.subprocess.Process
    log: Path

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        await guarded(self.proc.wait())


async def start_pc(tmp: Path, name: str, store: str) -> PcProcess:
    """``python -m kvsp_moq pc`` over ``store``; it has tried the lock once when it prints its URL."""
    config = tmp / f"{name}.toml"
    config.write_text(PRINCIPALS_TOML + f'[pc]\ninstance_token = "{TOKEN}"\nstore = "{store}"\n'
                      f"leader_lease_ms = {LEASE_MS}\nstore_timeout_ms = 500\n")
    log = tmp / f"{name}.log"
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsp_moq", "pc", "--listen", "127.0.0.1:0", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = (await guarded(proc.stdout.readline())).decode()
    prefix = "kvsp pc: listening on "
    assert line.startswith(prefix), (line, log.read_text()[-3000:])
    return PcProcess(line[len(prefix):].strip(), proc, log)


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        return resp.status, await resp.json(content_type=None)


async def until_active(http: aiohttp.ClientSession, pc: PcProcess) -> Any:
    """Poll (the condition is in another process), bounded by ``guarded``."""
    async def poll() -> Any:
        while True:
            status, body = await get(http, f"{pc.url}instances")
            if status == 200:
                return body
            assert status == 503 and body["type"].endswith("kvsp-not-leader"), body
            await asyncio.sleep(POLL_S)
    return await guarded(poll())


def status_record(instance: str, epoch: int) -> dict[str, Any]:
    return {"instance": instance, "epoch": epoch, "state": "active", "running": 0, "queued": 0, "batch_size": 8,
            "kv_utilization": 0.1, "prefill_tokens_per_s": 10000.0, "decode_tokens_per_s": 100.0, "links": [],
            "ttl_ms": 60_000}


async def put_status(http: aiohttp.ClientSession, pc: PcProcess, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.put(f"{pc.url}instance-status", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_two_pcs_one_active_and_the_standby_takes_over_with_the_state(tmp_path: Path, redis_server: RedisServer) -> None:
    first = await start_pc(tmp_path, "pc1", redis_server.url)
    second = await start_pc(tmp_path, "pc2", redis_server.url)
    restarted: PcProcess | None = None
    try:
        async with aiohttp.ClientSession() as http:
            assert (await get(http, f"{first.url}instances"))[0] == 200  # it found the lock free
            status, body = await get(http, f"{second.url}instances")
            assert status == 503 and body["type"].endswith("kvsp-not-leader")
            ix = "http://127.0.0.1:9/ix/"
            assert (await put_status(http, first, status_record(ix, 5)))[0] == 200
            status, body = await put_status(http, second, status_record(ix, 6))  # a standby changes nothing
            assert status == 503 and body["type"].endswith("kvsp-not-leader")

            first.kill()
            assert await guarded(first.proc.wait()) == -signal.SIGKILL
            views = (await until_active(http, second))["instances"]
            assert views == [{"instance": ix, "epoch": 5, "state": "active", "reported": "active"}]
            status, body = await put_status(http, second, status_record(ix, 4))  # §6.3: the highest epoch survived
            assert status == 409 and body["type"].endswith("kvsp-stale-epoch")

            restarted = await start_pc(tmp_path, "pc1-again", redis_server.url)
            status, _ = await get(http, f"{restarted.url}instances")
            assert status == 503  # the lock is held: a standby now
            await second.stop()  # a clean stop gives the lock up: the standby takes it at its next try
            assert (await until_active(http, restarted))["instances"][0]["epoch"] == 5
    finally:
        for pc in (first, second, restarted):
            if pc is not None:
                await pc.stop()


async def test_a_paused_leader_is_deposed_and_its_writes_are_fenced(tmp_path: Path, redis_server: RedisServer) -> None:
    """SIGSTOP the active PC past its lease: the standby takes over; the old one, resumed,
    still believes it leads until its next renewal, but the store refuses its write (the
    scripts check the leader token) and it steps down."""
    first = await start_pc(tmp_path, "pc1", redis_server.url)
    second = await start_pc(tmp_path, "pc2", redis_server.url)
    try:
        async with aiohttp.ClientSession() as http:
            ix = "http://127.0.0.1:9/ix/"
            assert (await put_status(http, first, status_record(ix, 5)))[0] == 200
            first.proc.send_signal(signal.SIGSTOP)
            try:
                await until_active(http, second)
                assert (await put_status(http, second, status_record(ix, 7)))[0] == 200
            finally:
                first.proc.send_signal(signal.SIGCONT)
            status, body = await put_status(http, first, status_record(ix, 6))
            assert status == 503 and body["type"].endswith("kvsp-not-leader"), body
            status, body = await get(http, f"{first.url}instances")
            assert status == 503 and body["type"].endswith("kvsp-not-leader")
            assert (await get(http, f"{second.url}instances"))[1]["instances"][0]["epoch"] == 7  # nothing of 6 landed
    finally:
        for pc in (first, second):
            await pc.stop()


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
    active = await start_pc(tmp_path, "pc1", redis_server.url)
    standby = await start_pc(tmp_path, "pc2", redis_server.url)
    try:
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
    finally:
        for pc in (active, standby):
            await pc.stop()


async def test_the_standby_takes_over_the_duties_and_migrates_a_session_whose_instance_died_too(
        tmp_path: Path, model_files: Any, redis_server: RedisServer) -> None:
    """SIGKILL the active PC and, at the same moment, the instance serving the session. The
    standby takes over; the dead instance's record (a fresh TTL from the takeover) expires;
    the live instance's next report makes the new PC migrate the session there (§6.3/§6.8),
    from the checkpoint the old PC stored, at a new epoch."""
    model_dir, descriptor, compat = model_files
    ids = ByteTokenizer().encode(PROMPT)
    n, kill_at = 40, 12
    active = await start_pc(tmp_path, "pc1", redis_server.url)
    standby = await start_pc(tmp_path, "pc2", redis_server.url)
    try:
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
    finally:
        for pc in (active, standby):
            await pc.stop()
