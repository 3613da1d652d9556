"""A faulty binding-v1 holder for tests/test_faults_*.py (holds no tests), run as a child process:

    python tests/fault_moqt_peer.py MODE CERT KEY BLOCKS_JSON

A real QUIC + MOQT server (our transport and sans-IO session; it writes the object bytes
itself, as a holder's fetch stream would: docs/binding.md §5) that serves the blocks of
BLOCKS_JSON — ``{"blocks": [{"namespace": [hex field, ...], "tokens": n, "layers": [hex K||V,
...], "digests": [hex, ...]}]}`` — to FETCH and TRACK_STATUS, with the Track Properties and
LAYER_DIGEST object properties of binding v1 (honest), and one fault:

* ``stall:K`` — FETCH_OK, layers up to K-1 whole, then the first half of layer K's payload, then
  nothing more: no FIN, no reset, the connection kept alive. Prints ``stalled <request id>``
  once those octets are acknowledged by the peer (so it has received them).
* ``flip:L`` — every layer, but with one bit of layer L's payload flipped (a corrupted byte on
  the path; the digests it announces are the true ones), then FIN. Prints ``flipped <request id>``.

An unknown namespace is REQUEST_ERROR DOES_NOT_EXIST. It prints its ``moqt://`` URL on one
line, then serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any

from kvsp_moq.bridge.binding import LAYER_DIGEST, track_properties
from kvsp_moq.moqt.data import FetchStreamEncoder
from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.messages import Fetch, FetchWithType, TrackStatus
from kvsp_moq.moqt.session import Role, SessionConfig, SessionMachine
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.moqt.version import Version
from kvsp_moq.pubsub.driver import ConnectionStreamIds, EventTable, SessionDriver
from kvsp_moq.pubsub.fetch_server import fetch_range
from kvsp_moq.transport import Connection, TransportConfig, TransportError
from kvsp_moq.transport import serve as transport_serve


@dataclass(frozen=True)
class Block:
    tokens: int
    layers: list[bytes]
    digests: list[bytes]

    def properties(self) -> tuple[tuple[int, int | bytes], ...]:
        return track_properties(token_count=self.tokens, first_layer=0, layer_count=len(self.layers),
                                layer_digests=self.digests, max_cache_duration_ms=None)


def read_blocks(path: str) -> dict[tuple[bytes, ...], Block]:
    with open(path, encoding="ascii") as fp:
        doc = json.load(fp)
    return {tuple(bytes.fromhex(f) for f in b["namespace"]):
            Block(b["tokens"], [bytes.fromhex(p) for p in b["layers"]], [bytes.fromhex(d) for d in b["digests"]])
            for b in doc["blocks"]}


class FaultyHolder(SessionDriver):
    """Serves :data:`BLOCKS` with the fault :data:`MODE` (see the module notes)."""

    def __init__(self) -> None:
        self.moqt: SessionMachine | None = None
        self._pumping = False
        self.events = EventTable()
        self.events.on(ev.RequestReceived, self.on_request)
        self.tasks: set[asyncio.Task[None]] = set()

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

    def on_request(self, e: ev.RequestReceived) -> None:
        moqt = self.moqt
        assert moqt is not None
        msg, rid = e.message, e.request_id
        if isinstance(msg, Fetch | FetchWithType):
            namespace, _, start, end = fetch_range(msg)
            block = BLOCKS.get(tuple(bytes(f) for f in namespace))
            if block is None:
                moqt.reject(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")
                return
            last = len(block.layers) - 1 if end is None or end[1] is None else min(end[1], len(block.layers) - 1)
            moqt.accept_fetch(rid, (0, last), end_of_track=True, track_properties=block.properties())
            sid = moqt.open_fetch_stream(rid)
            task = asyncio.ensure_future(self.fetch(rid, sid, block, start[1], last))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif isinstance(msg, TrackStatus):
            block = BLOCKS.get(tuple(bytes(f) for f in msg.track_namespace))
            if block is None:
                moqt.reject(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")
            else:
                moqt.request_ok(rid, track_properties=block.properties(), end=True)
        else:
            moqt.reject(rid, RequestErrorCode.NOT_SUPPORTED, "a faulty holder serves FETCH only")

    async def fetch(self, rid: int, sid: int, block: Block, first: int, last: int) -> None:
        self.pump()
        kind, _, arg = MODE.partition(":")
        at = int(arg)
        enc = FetchStreamEncoder(rid, self.version)
        try:
            for layer in range(first, last + 1):
                payload = block.layers[layer]
                header = enc.object_header(0, layer, len(payload), subgroup_id=0, publisher_priority=128,
                                           properties=((LAYER_DIGEST, block.digests[layer]),))
                if kind == "stall" and layer == at:
                    await self.connection.write(sid, header + payload[: len(payload) // 2])
                    await self.connection.wait_writable(sid, 0)  # all of it acknowledged
                    print(f"stalled {rid}", flush=True)
                    await asyncio.Event().wait()  # no FIN, no reset: silence
                if kind == "flip" and layer == at:
                    corrupted = bytearray(payload)
                    corrupted[len(corrupted) // 3] ^= 0x10
                    payload = bytes(corrupted)
                    print(f"flipped {rid}", flush=True)
                await self.connection.write(sid, header + payload)
            self.connection.send(sid, b"", end_stream=True)
            assert self.moqt is not None
            self.moqt.data_stream_done(sid)
            self.moqt.finish_request(rid)
            self.pump()
        except TransportError:
            pass  # the reader gave up on the stream


MODE = sys.argv[1] if len(sys.argv) > 1 else ""
BLOCKS: dict[tuple[bytes, ...], Block] = {}


async def main() -> None:
    global BLOCKS
    cert, key, blocks = sys.argv[2:5]
    BLOCKS = read_blocks(blocks)
    config = TransportConfig(certificate_file=cert, private_key_file=key)
    server: Any = await transport_serve("127.0.0.1", 0, FaultyHolder, config)
    print(f"moqt://127.0.0.1:{server.port}/moq", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
