"""A hostile client against our publisher (kvsp_moq.pubsub.serve, run as a child process
by tests/hostile_moqt_peer.py ``victim`` so that its memory is measured from
/proc/PID/status): 120 SUBSCRIBE_NAMESPACE on a prefix of a 20,000-namespace catalog
(18 MB of NAMESPACE messages each) from a client with 64 KiB stream windows that then stops
reading (SIGSTOP). The catalog server writes its answers in pages of NAMESPACE_PAGE behind
``wait_writable`` (pubsub/catalog_server.py), so the victim's peak RSS grows by less than
64 MiB (documented bound; before the paging it queued 120 x 18 MB = 2.2 GB) and a
well-behaved client is served meanwhile, the whole catalog included."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from hostile_support import HERE, MiB, PeakRss, client_config, hostile_peer, rss, within
from kvsp_moq.pubsub import ReceiveLimits, connect

NAMESPACES = 20_000
#: Concurrent requests of one session: the victim's QUIC grants 128 bidirectional streams.
FLOOD = 120
BOUND = 64 * MiB


async def test_subscribe_namespace_flood_from_a_reader_that_stalls(tmp_path: Path) -> None:
    async with hostile_peer(tmp_path, "victim", str(NAMESPACES)) as victim:
        peak = PeakRss(victim.proc.pid)
        env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
        flood = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "hostile_moqt_peer.py"), "flood", victim.url,
            str(FLOOD), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env)
        assert flood.stdout is not None and flood.stdin is not None
        stopped = False
        try:
            assert await within(flood.stdout.readline(), 120) == b"ready\n"
            os.kill(flood.pid, signal.SIGSTOP)  # it reads nothing more: windows fill up
            stopped = True
            limits = ReceiveLimits(max_namespace_updates=NAMESPACES + 1)
            good = await within(connect(victim.url, client_config(), receive_limits=limits))
            try:
                f = await within(good.fetch(("v",), "t", start=(0, 0)))
                assert [bytes(o.payload) for o in await within(f.collect())] == [b"v" * 1000]
                await within(good.subscribe_namespace(("cat",)))
                seen = set()
                for _ in range(NAMESPACES):
                    kind, suffix = await within(good.namespace_updates.get())
                    assert kind == "namespace"
                    seen.add(suffix)
                assert len(seen) == NAMESPACES  # every namespace, once
            finally:
                await within(good.close())
            assert peak.growth < BOUND, str(peak)
            print(f"victim: {peak}")
        finally:
            if stopped:
                os.kill(flood.pid, signal.SIGCONT)
            flood.stdin.close()
            try:
                await within(flood.wait(), 20)
            except TimeoutError:
                flood.kill()
                await flood.wait()


async def test_request_and_stream_flood(tmp_path: Path) -> None:
    """5000 TRACK_STATUS / FETCH requests (100 at a time) and 5000 unidirectional streams
    naming a Track Alias nobody gave (a SUBGROUP_HEADER, one object of 1 KiB, FIN) from one client: the victim serves every request, keeps no state for the
    junk streams beyond the bound, and its peak RSS grows by less than 64 MiB; what it still
    holds afterwards is under 32 MiB (nothing per stream or request is kept)."""
    count = 5000
    async with hostile_peer(tmp_path, "victim", "10") as victim:
        pid = victim.proc.pid
        peak = PeakRss(pid)
        env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
        client = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "hostile_moqt_peer.py"), "requests", victim.url,
            str(count), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env)
        assert client.stdout is not None and client.stdin is not None
        try:
            line = await within(client.stdout.readline(), 300)
            assert line == b"done 0\n", line  # every request answered
            good = await within(connect(victim.url, client_config()))
            try:
                f = await within(good.fetch(("v",), "t", start=(0, 0)))
                assert [bytes(o.payload) for o in await within(f.collect())] == [b"v" * 1000]
            finally:
                await within(good.close())
            assert peak.growth < BOUND, str(peak)
            held = rss(pid) - peak.start
            assert held < 32 * MiB, f"victim holds {held / MiB:.1f} MiB after the flood"
            print(f"victim: {peak}, holds {held / MiB:.1f} MiB after")
        finally:
            client.stdin.close()
            try:
                await within(client.wait(), 20)
            except TimeoutError:
                client.kill()
                await client.wait()
