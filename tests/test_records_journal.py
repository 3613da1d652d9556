"""A restarted holder withdraws the Replica Records its last run left for replicas it lost
(kvsp-draft §6.1 "A holder MUST withdraw a record with DELETE before or immediately after
evicting the replica"; ``[holder] records_journal``, ``[instance] records_journal``,
client/journal.py).

- The journal file itself: what a reopened file lists, refreshes that add nothing, a torn or
  foreign line skipped, the file's size bounded by the live entries.
- A real IS and holder (in-process): a restart over an empty memory tier withdraws the records
  before the holder serves; a replica still held (a disk tier's, recovered) keeps its record.
- A real ``kvsp holder`` process, SIGKILLed and restarted on its memory tier: the IS no longer
  lists the replicas it lost once the new process says it listens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from kvsp_moq.control.client.journal import COMPACT_SLACK, RecordJournal
from kvsp_moq.control.common.clock import ManualClock
from kvsp_moq.control.common.config import ControlConfig, IndexConfig
from kvsp_moq.control.holder.serve import HOLDER_SERVICE, serve_holder
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.kvsp.records import ReplicaRecord
from kvsp_moq.storage import RecordKey
from test_holder_support import AUTH, SCOPE_A, TOKENS, block_path, container, holder_config, rkey

START_S = 30.0


# -- the file ----------------------------------------------------------------------------------

def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_a_reopened_journal_lists_what_was_published_and_not_withdrawn(tmp_path: Path) -> None:
    path = tmp_path / "j" / "records.jsonl"  # its folder is made
    j = RecordJournal(path)
    assert j.previous == [] and len(j) == 0
    j.put(rkey(0), "http://h/", None, b"\x01" * 16)
    j.put(rkey(0), "http://h/", None, b"\x01" * 16)  # a refresh: nothing written
    j.put(rkey(1), "http://h/", None, b"\x02" * 16)
    j.put(rkey(1), "moqt://relay/moq", "ns-1", b"\x02" * 16)  # the same block's moqt:// record
    j.delete(rkey(1), "http://h/", None)
    j.delete(rkey(7), "http://h/", None)  # never listed: nothing written
    assert len(_lines(path)) == 4
    again = RecordJournal(path)
    assert sorted(((e.key.path, e.holder, e.moqt_namespace, e.replica_id) for e in again.previous), key=str) == sorted([
        (rkey(0).path, "http://h/", None, b"\x01" * 16), (rkey(1).path, "moqt://relay/moq", "ns-1", b"\x02" * 16)],
        key=str)
    assert len(_lines(path)) == 2  # rewritten with the live entries alone


def test_torn_and_foreign_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    good = {"put": [rkey(3).path, "http://h/", None, "ab" * 16]}
    path.write_text("\n".join([
        json.dumps(good),
        json.dumps({"put": [rkey(4).path, "http://h/", None]}),  # too short
        json.dumps({"put": ["zz/yy/xx", "http://h/", None, "ab" * 16]}),  # not a key
        json.dumps({"put": [rkey(5).path, 7, None, "ab" * 16]}),  # holder not a string
        json.dumps({"del": [rkey(3).path]}),  # too short
        json.dumps([1, 2, 3]),
        "x" * 10_000,
        '{"put": ["' + rkey(6).path,  # torn by a crash
    ]))
    j = RecordJournal(path)
    assert [(e.key, e.replica_id) for e in j.previous] == [(rkey(3), bytes.fromhex("ab" * 16))]
    assert j.skipped_lines == 7


def test_the_file_stays_proportional_to_what_is_published(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    j = RecordJournal(path)
    for i in range(3 * COMPACT_SLACK):  # each block published, then withdrawn
        j.put(RecordKey(bytes(32), bytes(16), i.to_bytes(32, "big")), "http://h/", None, bytes(16))
        j.delete(RecordKey(bytes(32), bytes(16), i.to_bytes(32, "big")), "http://h/", None)
        assert len(_lines(path)) <= 2 * len(j) + COMPACT_SLACK + 1
    j.put(rkey(1), "http://h/", None, bytes(16))
    assert [e.key for e in RecordJournal(path).previous] == [rkey(1)]


# -- a real IS and holder ----------------------------------------------------------------------

async def _index_replicas(session: aiohttp.ClientSession, index: RunningServer, i: int) -> list[ReplicaRecord]:
    async with session.get(f"{index.url}replicas/{rkey(i).path}",
                           headers={"Authorization": f"Bearer {TOKENS['holder-svc']}"}) as resp:
        if resp.status == 404:
            return []
        assert resp.status == 200, await resp.text()
        return [ReplicaRecord.from_json(r) for r in (await resp.json(content_type=None))["replicas"]]


async def _put(session: aiohttp.ClientSession, holder_url: str, i: int) -> None:
    async with session.put(holder_url + block_path(i), data=container(i),
                           headers={"Authorization": f"Bearer {TOKENS['client-a']}",
                                    "Content-Type": "application/kvsp-block", "If-None-Match": "*"}) as resp:
        assert resp.status == 201, await resp.text()


@asynccontextmanager
async def _index() -> AsyncIterator[tuple[RunningServer, aiohttp.ClientSession]]:
    clock = ManualClock(5_000_000)
    async with await serve_index(ControlConfig(auth=AUTH, index=IndexConfig(purge_interval_ms=0)), "127.0.0.1", 0,
                                 clock=clock) as index:
        async with aiohttp.ClientSession() as session:
            yield index, session


async def test_a_restart_over_an_empty_store_withdraws_before_serving(tmp_path: Path) -> None:
    journal = str(tmp_path / "records.jsonl")
    async with _index() as (index, session):
        def config() -> ControlConfig:  # the same holder URL each run: the records' identity
            return holder_config(index_url=index.url, index_token=TOKENS["holder-svc"], url="http://holder.test/",
                                 records_journal=journal)

        async with await serve_holder(config(), "127.0.0.1", 0) as first:
            for i in range(3):
                await _put(session, first.url, i)
            assert [len(await _index_replicas(session, index, i)) for i in range(3)] == [1, 1, 1]
        # the first run ended (its memory tier gone) without withdrawing: as if killed
        assert [len(await _index_replicas(session, index, i)) for i in range(3)] == [1, 1, 1]
        async with await serve_holder(config(), "127.0.0.1", 0) as second:
            assert [await _index_replicas(session, index, i) for i in range(3)] == [[], [], []]
            await _put(session, second.url, 4)
        assert [e.key for e in RecordJournal(journal).previous] == [rkey(4)]


async def test_a_replica_still_held_keeps_its_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = str(tmp_path / "records.jsonl")
    async with _index() as (index, session):
        def config() -> ControlConfig:
            return holder_config(index_url=index.url, index_token=TOKENS["holder-svc"], url="http://holder.test/",
                                 records_journal=journal)

        async with await serve_holder(config(), "127.0.0.1", 0) as first:
            for i in range(2):
                await _put(session, first.url, i)
            kept = first.app[HOLDER_SERVICE].store
        kept.remove(rkey(1))  # what a disk tier would not have recovered
        async with await serve_holder(config(), "127.0.0.1", 0, store=kept):
            assert [r.holder for r in await _index_replicas(session, index, 0)] == ["http://holder.test/"]
            assert await _index_replicas(session, index, 1) == []
        assert "withdrew 1 Replica Record(s)" in caplog.text  # by the second run (the first's listener left with it)


# -- a real holder process ---------------------------------------------------------------------

def _holder_toml(path: Path, index_url: str) -> Path:
    path.write_text(f"""
[holder]
index_url = "{index_url}"
index_token = "{TOKENS['holder-svc']}"
records_journal = "records.jsonl"
tiers = [{{kind = "host", capacity = 1048576}}]

[[principals]]
name = "client-a"
token = "{TOKENS['client-a']}"
scopes = ["{SCOPE_A.hex()}"]
""")
    return path


async def _start(config: Path, log: Path, listen: str) -> tuple[asyncio.subprocess.Process, str]:
    with open(log, "ab") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsp_moq", "holder", "--listen", listen, "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), START_S)).decode()
    prefix = "kvsp holder: listening on "
    assert line.startswith(prefix), (line, log.read_text()[-4000:])
    return proc, line[len(prefix):].strip()


async def test_a_sigkilled_holder_process_withdraws_what_it_lost_when_it_comes_back(tmp_path: Path) -> None:
    async with _index() as (index, session):
        config = _holder_toml(tmp_path / "holder.toml", index.url)
        log = tmp_path / "holder.log"
        proc, url = await _start(config, log, "127.0.0.1:0")
        try:
            for i in range(3):
                await _put(session, url, i)
            assert [[r.holder for r in await _index_replicas(session, index, i)] for i in range(3)] == [[url]] * 3
            proc.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(proc.wait(), START_S) == -signal.SIGKILL
            port = url.rsplit(":", 1)[1].strip("/")
            proc, again = await _start(config, log, f"127.0.0.1:{port}")
            assert again == url
            assert [await _index_replicas(session, index, i) for i in range(3)] == [[], [], []]
            assert "withdrew 3 Replica Record(s) left at the index by the last run" in log.read_text()
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), START_S)

