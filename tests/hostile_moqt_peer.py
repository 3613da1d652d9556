"""Hostile MOQT peers for tests/test_hostile_*.py (holds no tests), run as child processes
so that the victim's RSS is its own:

``python tests/hostile_moqt_peer.py publisher CERT KEY`` — a real QUIC + MOQT server (our
transport and sans-IO session, no pubsub layer: it writes object bytes itself) that answers
SUBSCRIBE and FETCH for any track and then sends what the track name asks for:

* ``len:N`` — one object (group 0, object 0) whose header declares N payload octets, then
  ``CHUNK`` octets of payload; the stream is left open (an object that never completes).
* ``lens:N,M,...`` — (SUBSCRIBE) one subgroup stream per length, group i, as ``len:``.
* ``endless`` — objects of 1 KiB, one after another on one stream, until it is stopped.
* ``streams:K:N`` — (SUBSCRIBE) K subgroup streams, each one object declaring N octets with
  1 KiB of it sent, all left open.
* ``layers:L:N`` — (FETCH) objects 0..L-1 of group 0 declaring N octets each, sent whole.
* ``ok`` — (FETCH) one well-formed object of 1000 octets (payload ``b"k" * 1000``), then FIN.

A subscription's crafted streams are followed, once the victim stopped every one of them,
by a well-formed report object (group 1_000_000: JSON ``{stream ID: STOP_SENDING code}``),
FIN and PUBLISH_DONE (``streams:0:0`` is thus a well-behaved subscription). Every
STOP_SENDING is also printed as ``stopped <stream ID> <code>``.

``python tests/hostile_moqt_peer.py victim CERT KEY NAMESPACES`` — the victim side for a
hostile client: an ordinary pubsub server (``kvsp_moq.pubsub.serve``) whose catalog has
NAMESPACES tracks ``("cat", "n<i>", <900 octets>)`` and a track ``("v", "t")`` with one
stored object.

Both print their ``moqt://`` URL on one line, then serve until stdin closes.

``python tests/hostile_moqt_peer.py flood URL N`` — a hostile client: N SUBSCRIBE_NAMESPACE
on ("cat",) with 64 KiB stream windows, ``ready`` once answered (see :func:`flood`);
``... requests URL N``: N requests and N junk data streams (see :func:`requests`).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from kvsp_moq.moqt.data import FetchStreamEncoder, SubgroupStreamEncoder
from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import Fetch, FetchWithType, Subscribe
from kvsp_moq.moqt.objects import SubgroupHeader
from kvsp_moq.moqt.session import Role, SessionConfig, SessionMachine
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.moqt.version import Version
from kvsp_moq.pubsub import Catalog, MoqtError, ReceiveLimits, connect, serve
from kvsp_moq.pubsub.driver import ConnectionStreamIds, EventTable, SessionDriver
from kvsp_moq.transport import Connection, TransportConfig, TransportError
from kvsp_moq.transport import serve as transport_serve

CHUNK = 1 << 20
KiB = b"x" * 1024


class HostilePublisher(SessionDriver):
    """Answers every SUBSCRIBE / FETCH, then writes crafted object bytes."""

    def __init__(self) -> None:
        self.moqt = None
        self._pumping = False
        self.events = EventTable()
        self.events.on(ev.RequestReceived, self._on_request)
        self.events.on(ev.DataStreamStopped, self._on_stopped)
        self.tasks: set[asyncio.Task[None]] = set()
        #: Our data streams the victim stopped: stream ID -> STOP_SENDING code.
        self.stopped: dict[int, int] = {}
        self.stop_seen = asyncio.Event()

    def connection_made(self, conn: Connection, alpn: str) -> None:
        self.connection = conn
        self.version = Version.from_alpn(alpn)
        self.moqt = SessionMachine(Role.SERVER, self.version, SessionConfig(),
                                   streams=ConnectionStreamIds(conn, False))
        self.moqt.start()
        self.pump()

    def _on_closed(self, code: int, reason: str) -> None:
        for task in self.tasks:
            task.cancel()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _on_request(self, e: ev.RequestReceived) -> None:
        moqt = self.moqt
        assert moqt is not None
        msg, rid = e.message, e.request_id
        if isinstance(msg, Subscribe):
            moqt.accept_subscribe(rid, rid)
            self._spawn(self._subscription(rid, bytes(msg.track_name)))
        elif isinstance(msg, Fetch | FetchWithType):
            moqt.accept_fetch(rid, (0, 1 << 20))
            sid = moqt.open_fetch_stream(rid)
            self._spawn(self._fetch(rid, sid, bytes(msg.track_name)))
        else:
            moqt.reject(rid, RequestErrorCode.NOT_SUPPORTED, "hostile")

    async def _payload(self, sid: int, n: int) -> None:
        while n > 0:
            take = min(n, CHUNK)
            await self.connection.write(sid, bytes(take))
            n -= take

    def _on_stopped(self, e: ev.DataStreamStopped) -> None:
        self.stopped[e.stream_id] = e.error_code
        self.stop_seen.set()
        print(f"stopped {e.stream_id} {e.error_code}", flush=True)

    async def _bad_stream(self, rid: int, group: int, body: Callable[[int, Any], Awaitable[None]],
                          sids: list[int]) -> None:
        """Open subgroup stream ``group`` of ``rid`` and run ``body(sid, encoder)`` on it;
        the victim stopping it ends ``body``."""
        moqt = self.moqt
        assert moqt is not None
        header = SubgroupHeader(rid, group, 0, 128)
        sid = moqt.open_subgroup_stream(rid, header)
        self.pump()
        sids.append(sid)
        try:
            await body(sid, SubgroupStreamEncoder(header, self.version))
        except TransportError:
            pass  # stopped by the victim

    async def _subscription(self, rid: int, name: bytes) -> None:
        """Crafted subgroup streams; once the victim stopped every one of them, a last
        well-formed object (group 1_000_000) reports ``{stream: STOP_SENDING code}`` as JSON,
        then FIN and PUBLISH_DONE."""
        moqt = self.moqt
        assert moqt is not None
        kind, _, arg = name.partition(b":")
        sids: list[int] = []
        if kind in (b"len", b"lens"):
            for group, length in enumerate(int(x) for x in arg.split(b",")):
                async def declare(sid: int, enc: Any, length: int = length) -> None:
                    await self.connection.write(sid, enc.object_header(0, length))
                    await self._payload(sid, min(length, CHUNK))
                await self._bad_stream(rid, group, declare, sids)
        elif kind == b"endless":
            async def endless(sid: int, enc: Any) -> None:
                obj = 0
                while True:
                    await self.connection.write(sid, enc.object(obj, KiB))
                    obj += 1
            await self._bad_stream(rid, 0, endless, sids)
        elif kind == b"streams":
            count, length = (int(x) for x in arg.split(b":"))
            for group in range(count):
                async def opened(sid: int, enc: Any) -> None:
                    await self.connection.write(sid, enc.object_header(0, length) + KiB)
                await self._bad_stream(rid, group, opened, sids)
        while not all(sid in self.stopped for sid in sids):
            self.stop_seen.clear()
            await self.stop_seen.wait()
        report = json.dumps({str(sid): self.stopped[sid] for sid in sids}).encode()
        header = SubgroupHeader(rid, 1_000_000, 0, 128)
        sid = moqt.open_subgroup_stream(rid, header)
        self.pump()
        enc = SubgroupStreamEncoder(header, self.version)
        try:
            await self.connection.write(sid, enc.object(0, report), end_stream=True)
        except TransportError:
            pass  # the victim stopped this one too
        moqt.data_stream_done(sid)
        moqt.publish_done(rid, PublishDoneCode.TRACK_ENDED, len(sids) + 1, "")
        self.pump()

    async def _fetch(self, rid: int, sid: int, name: bytes) -> None:
        self.pump()
        enc = FetchStreamEncoder(rid, self.version)
        kind, _, arg = name.partition(b":")
        try:
            if kind == b"len":
                length = int(arg)
                await self.connection.write(sid, enc.object_header(
                    0, 0, length, subgroup_id=0, publisher_priority=128))
                await self._payload(sid, min(length, CHUNK))
                # Everything acknowledged (so the victim has processed it): give up the
                # object with RESET_STREAM INTERNAL_ERROR, which ends the victim's FETCH.
                await self.connection.wait_writable(sid, 0)
                self.connection.reset_stream(sid, 0)
            elif kind == b"endless":
                obj = 0
                while True:
                    await self.connection.write(sid, enc.object(
                        0, obj, KiB, subgroup_id=0, publisher_priority=128))
                    obj += 1
            elif kind == b"layers":
                count, length = (int(x) for x in arg.split(b":"))
                for obj in range(count):
                    await self.connection.write(sid, enc.object_header(
                        0, obj, length, subgroup_id=0, publisher_priority=128))
                    await self._payload(sid, length)
            elif kind == b"ok":
                await self.connection.write(sid, enc.object(
                    0, 0, b"k" * 1000, subgroup_id=0, publisher_priority=128), end_stream=True)
                assert self.moqt is not None
                self.moqt.data_stream_done(sid)
                self.pump()
        except TransportError:
            pass


async def flood(url: str, count: int) -> None:
    """The hostile client: small flow-control windows, ``count`` SUBSCRIBE_NAMESPACE on the
    prefix ("cat",) at once; prints ``ready`` once every REQUEST_OK arrived, then reads
    nothing more than it must (the test SIGSTOPs it)."""
    config = TransportConfig(insecure=True, max_stream_data=64 * 1024, max_data=1 << 20)
    limits = ReceiveLimits(max_namespace_updates=1 << 30)
    session = await connect(url, config, receive_limits=limits)
    await asyncio.gather(*(session.subscribe_namespace(("cat",)) for _ in range(count)))
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)


async def requests(url: str, count: int) -> None:
    """The hostile client's request flood: ``count`` TRACK_STATUS and FETCH requests (as
    many at once as QUIC lets it), ``count`` unidirectional streams each a SUBGROUP_HEADER
    of a Track Alias nobody gave it, one object of 1 KiB and FIN; prints ``done <refused>``."""
    session = await connect(url, TransportConfig(insecure=True))
    refused = 0

    async def one(i: int) -> None:
        nonlocal refused
        try:
            if i % 2:
                await session.track_status(("v",), "t")
            else:
                f = await session.fetch(("v",), "t", start=(0, 0))
                await f.collect()
        except MoqtError:
            refused += 1

    sem = asyncio.Semaphore(100)

    async def bounded(i: int) -> None:
        async with sem:
            await one(i)

    await asyncio.gather(*(bounded(i) for i in range(count)))
    header = SubgroupHeader(1 << 20, 0, 0, 128)
    for _ in range(count):
        enc = SubgroupStreamEncoder(header, session.version)
        sid = session.connection.open_uni()
        await session.connection.write(sid, enc.header() + enc.object(0, KiB),
                                       end_stream=True)
    await session.track_status(("v",), "t")
    print(f"done {refused}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)


async def main() -> None:
    if sys.argv[1] == "flood":
        await flood(sys.argv[2], int(sys.argv[3]))
        return
    if sys.argv[1] == "requests":
        await requests(sys.argv[2], int(sys.argv[3]))
        return
    mode, cert, key = sys.argv[1:4]
    config = TransportConfig(certificate_file=cert, private_key_file=key)
    if mode == "publisher":
        server: Any = await transport_serve("127.0.0.1", 0, HostilePublisher, config)
        port = server.port
    else:
        catalog = Catalog()
        for i in range(int(sys.argv[4])):
            catalog.create(("cat", f"n{i}", "p" * 900), "t")
        track = catalog.create(("v",), "t", keep=True)
        await track.write_object(0, 0, b"v" * 1000)
        server = await serve("127.0.0.1", 0, config, catalog=catalog)
        port = server.port
    print(f"moqt://127.0.0.1:{port}/moq", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
