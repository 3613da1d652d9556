"""Active/standby Placement Controllers over one Redis (``control/pc/leader.py``), with real
``kvsp pc`` processes and a real ``redis-server`` on a free loopback port.

- Two PCs over one Redis: only the one holding the leader lock answers; the other answers
  503 ``kvsp-not-leader``. SIGKILL the active one: the standby takes over with its state
  (instances and their highest epochs), and a restarted PC is a standby. SIGSTOP the active
  one past its lease: once resumed, its writes are refused by the store (fencing).
- With the reference model (tests/test_pc_failover_model.py): SIGKILL the active PC
  mid-generation, and SIGKILL it together with the session's instance.

Nothing waits by sleeping; the one poll (for the standby to take the lock) is bounded and
polls another process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from redis_support import RedisServer, redis_server  # noqa: F401
from test_migration_support import PRINCIPALS_TOML, TOKEN, guarded

LEASE_MS = 1_000  # a standby takes over within about 4/3 of this
STOP_S = 10.0  # a PC exits within about a second of SIGTERM (nothing it serves holds it); then SIGKILL
POLL_S = 0.05


@dataclass
class PcProcess:
    url: str
    proc: asyncio.subprocess.Process
    log: Path

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        """SIGTERM, and SIGKILL if it has not exited within ``STOP_S``: never leaves it running."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_S)
            except asyncio.TimeoutError:
                self.kill()
                await self.proc.wait()  # a SIGKILLed process always exits


async def start_pc(tmp: Path, name: str, store: str, *, instance_token: str = TOKEN, extra: str = "") -> PcProcess:
    """``python -m kvsp_moq pc`` over ``store`` (``extra``: more ``[pc]`` lines); it has tried
    the lock once when it prints its URL. Killed if it does not print it."""
    config = tmp / f"{name}.toml"
    config.write_text(PRINCIPALS_TOML + f'[pc]\ninstance_token = "{instance_token}"\nstore = "{store}"\n'
                      f"leader_lease_ms = {LEASE_MS}\nstore_timeout_ms = 500\n" + extra)
    log = tmp / f"{name}.log"
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsp_moq", "pc", "--listen", "127.0.0.1:0", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pc = PcProcess("", proc, log)
    try:
        assert proc.stdout is not None
        line = (await guarded(proc.stdout.readline())).decode()
        prefix = "kvsp pc: listening on "
        assert line.startswith(prefix), (line, log.read_text()[-3000:])
    except BaseException:
        await pc.stop()
        raise
    pc.url = line[len(prefix):].strip()
    return pc


class PcProcesses:
    """The PC processes a test starts over one store; all stopped at the end (:func:`pc_processes`)."""

    def __init__(self, tmp: Path, store: str, **settings: Any) -> None:
        self.tmp, self.store, self.settings = tmp, store, settings
        self.started: list[PcProcess] = []

    async def start(self, name: str) -> PcProcess:
        pc = await start_pc(self.tmp, name, self.store, **self.settings)
        self.started.append(pc)
        return pc


@asynccontextmanager
async def pc_processes(tmp: Path, store: str, **settings: Any) -> AsyncIterator[PcProcesses]:
    """Start PCs with ``.start(name)``; every one is stopped (SIGKILL past ``STOP_S``) when the
    block ends, however it ends (a failed assertion, a guard's timeout)."""
    pcs = PcProcesses(tmp, store, **settings)
    try:
        yield pcs
    finally:
        await asyncio.gather(*(pc.stop() for pc in pcs.started))


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
    async with pc_processes(tmp_path, redis_server.url) as pcs, aiohttp.ClientSession() as http:
        first = await pcs.start("pc1")
        second = await pcs.start("pc2")
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
        assert views == [{"instance": ix, "epoch": 5, "state": "active", "reported": "active",
                          "running": 0, "queued": 0, "kv_utilization": 0.1}]
        status, body = await put_status(http, second, status_record(ix, 4))  # §6.3: the highest epoch survived
        assert status == 409 and body["type"].endswith("kvsp-stale-epoch")

        restarted = await pcs.start("pc1-again")
        status, _ = await get(http, f"{restarted.url}instances")
        assert status == 503  # the lock is held: a standby now
        await second.stop()  # a clean stop gives the lock up: the standby takes it at its next try
        assert (await until_active(http, restarted))["instances"][0]["epoch"] == 5


async def test_a_paused_leader_is_deposed_and_its_writes_are_fenced(tmp_path: Path, redis_server: RedisServer) -> None:
    """SIGSTOP the active PC past its lease: the standby takes over; the old one, resumed,
    still believes it leads until its next renewal, but the store refuses its write (the
    scripts check the leader token) and it steps down."""
    async with pc_processes(tmp_path, redis_server.url) as pcs, aiohttp.ClientSession() as http:
        first = await pcs.start("pc1")
        second = await pcs.start("pc2")
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
