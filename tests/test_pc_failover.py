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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from redis_support import RedisServer, redis_server  # noqa: F401
from test_migration_support import PRINCIPALS_TOML, TOKEN, guarded

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
            assert views == [{"instance": ix, "epoch": 5, "state": "active", "reported": "active",
                              "running": 0, "queued": 0, "kv_utilization": 0.1}]
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
