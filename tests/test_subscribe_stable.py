"""Live SUBSCRIBE delivery from the store without a copy (issue 28, step 3; docs/transport.md
"Sending from the store (no copy)"): a block track's layers, published as they are computed,
go to QUIC as the store's own memory on the native backend — held by the extension until
acknowledged, and waiting in a slow subscriber's backlog as the store's view, never a frozen
copy — and every held buffer is let go once delivered, or once the subscriber stops the stream
or unsubscribes mid-layer; a payload not marked stable is still copied before its buffer may
be reused.

The observable is the layers' buffers themselves: once the replica is removed from the store,
nothing of ours references a layer's numpy buffer but what still has to send it (a copy would
leave it unreferenced, and it would be freed at once). The holder runs here (native backend);
the subscribers are processes of their own on the native backend, with windows 32 times
smaller than the block: one takes everything at once, the other is stalled (SIGSTOP: it
acknowledges nothing) before the first layer is written and resumed (SIGCONT) once the
publication is over. Real QUIC on loopback; every wait is for an event, with a bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from bridge_support import CERT, make_key, make_layers, within
from kvsp_moq.bridge import MoqtHolder
from kvsp_moq.pubsub import TrackPublisher
from kvsp_moq.storage import BlockStore, HostTier
from kvsp_moq.transport import TransportConfig, native

pytestmark = pytest.mark.skipif(not native.available(), reason=native.unavailable_reason() or "")

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
LAYERS = 8  # of 1 MiB: 32 times the subscriber's stream window, all in flight at once
WINDOW = 256 * 1024


class Subscriber:
    """tests/stable_subscriber.py in a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, url: str, namespace: tuple[bytes, ...], mode: str) -> Subscriber:
        env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "stable_subscriber.py"), url,
            ",".join(f.hex() for f in namespace), "raw", str(WINDOW), mode,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        return cls(proc)

    async def line(self) -> str:
        assert self.proc.stdout is not None
        return (await within(self.proc.stdout.readline())).decode().strip()

    async def stall(self) -> None:
        """SIGSTOP, and return once every thread of it is stopped (waitpid WUNTRACED)."""
        self.proc.send_signal(signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        _, status = await within(loop.run_in_executor(None, os.waitpid, self.proc.pid,
                                                      os.WUNTRACED))
        assert os.WIFSTOPPED(status)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await within(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


@pytest.fixture
async def holder():
    """A MoqtHolder on the native backend; 2 MiB of send buffer per stream (two layers)."""
    store = BlockStore([HostTier(64 * MiB)])
    holder = MoqtHolder(store)
    config = TransportConfig(certificate_pem=CERT.cert_pem, private_key_pem=CERT.key_pem,
                             backend="native", send_buffer_high_water=2 * MiB)
    url = await holder.serve("127.0.0.1", 0, config)
    try:
        yield holder, url
    finally:
        await within(holder.close())


@pytest.mark.parametrize("mode", ["all", "stop", "cancel"])
async def test_a_subscribed_block_is_sent_from_the_store_and_let_go(holder, mode: str) -> None:
    """``all``: the stalled subscriber gets every layer bit-exact after the replica left the
    store (its bytes were held, not copied), and each buffer is released once acknowledged.
    ``stop`` / ``cancel``: it stops the stream (STOP_SENDING) or unsubscribes at the begin of
    layer 1 — mid-layer, most of the block unacknowledged — and every buffer is released."""
    moqt, url = holder
    store = moqt.store
    key, layers = make_key(28), make_layers(LAYERS, tokens=256, kv_heads=8, head_dim=128)
    writer = moqt.begin(key, layers.geometry, LAYERS, layers.tokens)
    track = moqt.track(key)
    assert track is not None
    fast = await Subscriber.start(url, track.namespace, "all")
    slow = await Subscriber.start(url, track.namespace, mode)
    try:
        assert await fast.line() == "subscribed" and await slow.line() == "subscribed"
        await slow.stall()
        for layer, (k, v) in enumerate(layers.arrays):
            writer.write_layer(layer, k, v)
        writer.finish()
        expected = [{"object": layer, "sha256": digest.hex()}
                    for layer, digest in enumerate(store.info(key).layer_digests)]
        assert len(expected) == LAYERS and store.layer_payload(key, 0).nbytes == MiB
        assert [json.loads(await fast.line()) for _ in range(LAYERS)] == expected
        # PUBLISH_DONE reached the fast one: the track's sender wrote every layer and ended.
        assert await fast.line() == "done"

        # What the stalled subscriber still has to receive is every layer: in its stream's
        # QUIC send buffer (2 MiB: layer 0 and the start of layer 1, held by the extension)
        # or in its backlog (the rest, as the store's views).
        alive = set(range(LAYERS))
        released = asyncio.Event()
        loop = asyncio.get_running_loop()

        def gone(layer: int) -> Callable[[object], None]:
            def callback(_: object) -> None:
                alive.discard(layer)
                if not alive:
                    loop.call_soon_threadsafe(released.set)
            return callback

        refs = [weakref.ref(store.layer_payload(key, layer, touch=False).obj, gone(layer))
                for layer in range(LAYERS)]
        del writer, layers
        store.remove(key)
        assert sorted(alive) == list(range(LAYERS)), "a layer was copied, not held"

        slow.resume()
        if mode == "all":
            assert [json.loads(await slow.line()) for _ in range(LAYERS)] == expected
        else:
            assert json.loads(await slow.line()) == expected[0]
        assert await slow.line() == "done"
        await within(released.wait())  # the subscriber's connection is still open
        assert all(ref() is None for ref in refs)
    finally:
        await slow.close()
        await fast.close()


async def test_a_payload_not_marked_stable_is_copied_before_its_buffer_is_reused(holder) -> None:
    """The other side of the rule: a payload not marked stable may change once its write
    returns — here one buffer is rewritten for every object — so what the stalled subscriber
    is sent later is the copy made when the object was written (the extension's, or the
    backlog's frozen one), never the buffer's later bytes."""
    moqt, url = holder
    track = TrackPublisher((b"kvsp-test", b"reused buffer"), "raw", keep=False)
    moqt.catalog.add(track)
    fast = await Subscriber.start(url, track.namespace, "all")
    slow = await Subscriber.start(url, track.namespace, "all")
    try:
        assert await fast.line() == "subscribed" and await slow.line() == "subscribed"
        await slow.stall()
        buf, expected = bytearray(MiB), []
        for i in range(LAYERS):
            buf[:] = os.urandom(MiB)
            expected.append({"object": i, "sha256": hashlib.sha256(buf).hexdigest()})
            await within(track.write_object(0, i, memoryview(buf)))
        await within(track.finish())
        assert [json.loads(await fast.line()) for _ in range(LAYERS)] == expected
        assert await fast.line() == "done"
        buf[:] = bytes(MiB)
        slow.resume()
        assert [json.loads(await slow.line()) for _ in range(LAYERS)] == expected
        assert await slow.line() == "done"
    finally:
        await slow.close()
        await fast.close()
