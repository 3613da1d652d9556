"""A slow subscriber is ended with PUBLISH_DONE TOO_FAR_BEHIND while the others get
everything; and ``python -m relay`` as a subprocess (answers, GOAWAY + exit 0 on SIGTERM).

The slow subscriber runs on its own event loop in a thread and blocks that loop inside its
first ``on_object_begin``: it stops reading and acknowledging, exactly like a stalled
process, so the relay's QUIC send buffer for it fills and its relay queue grows. (An
in-process aioquic peer on the shared loop cannot be slow: aioquic grows receive windows
and ACKs by itself.)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from pathlib import Path

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.pubsub import MoqtError, connect

from test_relay import NS, Net, client_config, net, payload, within  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


class SlowSubscriber(threading.Thread):
    """A subscriber of ``track`` on its own loop in a thread; its first ``on_object_begin``
    blocks that loop until :attr:`release` (no reads, no ACKs). ``result``: (PUBLISH_DONE
    status, Stream Count, objects received)."""

    def __init__(self, url: str, main_loop: asyncio.AbstractEventLoop,
                 track: str = "big") -> None:
        super().__init__(daemon=True)
        self.url = url
        self.track = track
        self.main = main_loop
        self.release = threading.Event()
        self.subscribed: asyncio.Future[None] = main_loop.create_future()
        self.blocked: asyncio.Future[None] = main_loop.create_future()
        self.result: asyncio.Future[tuple[int | None, int, int]] = main_loop.create_future()

    def _tell(self, fut: asyncio.Future, value: object) -> None:
        self.main.call_soon_threadsafe(lambda: fut.done() or fut.set_result(value))

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        # Small receive windows: a transport that receives on a thread of its own (native)
        # takes in at most these while the loop is stalled; the relay must hold the rest.
        s = await connect(self.url, client_config(max_stream_data=64 << 10, max_data=128 << 10))
        first = [True]

        def on_begin(info):
            if first[0]:
                first[0] = False
                self._tell(self.blocked, None)
                self.release.wait(60)  # the whole loop stops: no reads, no ACKs
            return None

        sub = await s.subscribe(NS, self.track, on_object_begin=on_begin)
        self._tell(self.subscribed, None)
        n = 0
        try:
            async for _obj in sub:
                n += 1
        except MoqtError:
            pass
        done = sub.publish_done
        self._tell(self.result, (done.status_code if done else None,
                                 done.stream_count if done else -1, n))
        await s.close()


async def test_slow_subscriber_too_far_behind(net: Net) -> None:
    relay = await net.relay(high_water=64 << 10, subscriber_queue_bytes=256 << 10)
    ended: asyncio.Future = asyncio.get_running_loop().create_future()
    relay.observers.append(
        lambda kind, sub: kind == "too_far_behind" and not ended.done() and ended.set_result(sub))
    pub, catalog = await net.publisher(relay)
    track = catalog.create(NS, "big", keep=False)
    fast = [await within((await net.client(relay)).subscribe(NS, "big")) for _ in range(2)]
    slow = SlowSubscriber(relay.url, asyncio.get_running_loop())
    slow.start()
    try:
        await within(slow.subscribed)
        assert track.subscriber_count == 1
        await within(track.write_object(0, 0, b"first"))
        await within(slow.blocked)
        for sub in fast:
            assert bytes((await within(sub.__anext__())).payload) == b"first"
        chunk = 64 << 10
        # 2 MiB more while the slow one is stalled; paced by the fast subscribers (each
        # object is read by both before the next is written), so only the stalled one
        # builds a queue.
        for o in range(1, 33):
            await within(track.write_object(0, o, payload(0, o, chunk)))
            for sub in fast:
                obj = await within(sub.__anext__())
                assert obj.object_id == o and bytes(obj.payload) == payload(0, o, chunk)
        await within(track.finish())
        for sub in fast:
            assert await within(sub.collect()) == []
            assert sub.publish_done.status_code == PublishDoneCode.TRACK_ENDED
        cut = await within(ended)
        assert cut.end_status == PublishDoneCode.TOO_FAR_BEHIND
        assert relay.stats.too_far_behind == 1
    finally:
        slow.release.set()
    status, count, n = await within(slow.result)
    assert status == PublishDoneCode.TOO_FAR_BEHIND and count == 1 and n < 33
    slow.join(10)


async def test_python_m_relay_subprocess_goaway_exit_0(net: Net) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--drain-timeout", "20",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await within(proc.stdout.readline())).decode().strip()
        assert line.startswith("relay listening on moqt://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[1]
        pub_catalog = __import__("kvsp_moq.pubsub", fromlist=["Catalog"]).Catalog()
        pub = await within(connect(url, client_config(), catalog=pub_catalog))
        await within(pub.publish_namespace(NS))
        track = pub_catalog.create(NS, "sp")
        sub_s = await within(connect(url, client_config()))
        with pytest.raises(MoqtError) as e:
            await within(sub_s.subscribe(("unknown",), "x"))
        assert e.value.code == RequestErrorCode.DOES_NOT_EXIST
        sub = await within(sub_s.subscribe(NS, "sp"))
        await within(track.write_object(0, 0, b"via subprocess"))
        obj = await within(sub.__anext__())
        assert bytes(obj.payload) == b"via subprocess"
        proc.send_signal(signal.SIGTERM)
        assert await within(sub_s.goaway_received) == ""
        assert await within(pub.goaway_received) == ""
        await within(track.finish())
        await within(pub.drain())
        await within(sub_s.close())
        await within(pub.close())
        assert await within(proc.wait()) == 0
        out = (await within(proc.stdout.read())).decode()
        assert "relay stopped" in out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
