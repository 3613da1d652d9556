"""Shared helpers of tests/test_faults_*.py (holds no tests): the data path of issue 19 with
real peers on 127.0.0.1 — an Index Service and an HTTP holder served in this process, a MOQT
relay as its own ``python -m relay`` process (SIGKILLed by some tests), faulty holders as
``tests/fault_moqt_peer.py`` processes, and inference instances (``serve_instance`` with the
reference model) whose recorded state the tests read. Nothing waits by sleeping: every wait
is on a process line, an answer or an event, under a guard that fails loudly.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvsp_moq.control.client.http import HttpIndexClient
from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.clock import MonotonicClock, Timer
from kvsp_moq.control.common.config import ControlConfig, HolderConfig, IndexConfig, InstanceConfig, TierConfig
from kvsp_moq.control.common.engine_config import EngineConfig
from kvsp_moq.control.common.tls import TlsConfig
from kvsp_moq.control.engine.engine import InferenceEngine
from kvsp_moq.control.engine.records import GenerateRequest
from kvsp_moq.control.holder.serve import serve_holder
from kvsp_moq.control.http.server import RunningServer
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.control.instance.serve import INSTANCE_SERVICE, serve_instance, serve_model_instance
from kvsp_moq.kvsp import scope
from kvsp_moq.kvsp.blockkeys import BlockKeyChain
from kvsp_moq.kvsp.records import LookupRequest, LookupResponse
from kvsp_moq.model import ByteTokenizer, build_descriptor, ensure_model_files
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from bridge_support import CERT, ca_file

ROOT = Path(__file__).resolve().parents[1]
GUARD = 60.0  # a safety net against hangs, never a way to wait for something
B = 16  # small blocks: several per prompt
MiB = 1 << 20
PROMPT = "System: answer briefly, cite sources, never invent facts. " * 2 + "User: what is KVSP?"
TOKEN = secrets.token_urlsafe(24)
SCOPE_KEY = secrets.token_bytes(32)
SCOPE_ID = scope.scope_id(SCOPE_KEY)
#: The bounds the tests configure: a source silent IDLE_S is left; a whole request may take
#: REQUEST_S; a fault must be got over within IDLE_S + SLACK_S (the 2-core CI machine is busy).
IDLE_S = 0.5
REQUEST_S = 30.0
SLACK_S = 8.0


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


def everyone() -> Principal:
    return Principal("all", scopes=Grant(everything=True), holders=Grant(everything=True), instances=Grant(everything=True))


def request(prompt: str = PROMPT, max_tokens: int = 12) -> GenerateRequest:
    return GenerateRequest(scope_id=SCOPE_ID, prompt=prompt, max_tokens=max_tokens)


def sources(result: Any) -> list[str]:
    return [b.source for b in result.blocks]


def engine_of(server: RunningServer) -> InferenceEngine:
    engine = server.app[INSTANCE_SERVICE].inference
    assert engine is not None
    return engine


def store_of(server: RunningServer) -> BlockStore:
    return server.app[INSTANCE_SERVICE].store


@dataclass
class Child:
    """A child process of the test; its stdout read line by line."""

    proc: asyncio.subprocess.Process
    url: str = ""

    async def line(self, prefix: str) -> str:
        """The next stdout line starting with ``prefix`` (the process must not exit first)."""
        assert self.proc.stdout is not None
        while True:
            raw = await within(self.proc.stdout.readline())
            if not raw:
                raise AssertionError(f"the child exited ({await self.proc.wait()}) before printing {prefix!r}")
            text = raw.decode().strip()
            if text.startswith(prefix):
                return text

    def kill(self) -> None:
        """SIGKILL: it ends at once, mid-whatever, with no goodbye (no QUIC close)."""
        if self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.kill()
        await within(self.proc.wait())


@dataclass
class Cluster:
    """The roles of one test (module notes)."""

    stack: AsyncExitStack
    tmp: Path
    model_dir: Path
    auth: Authorizer
    index: RunningServer
    holder: RunningServer
    index_client: HttpIndexClient
    clock: Timer
    relays: list[Child] = field(default_factory=list)

    def cert_files(self) -> tuple[str, str]:
        cert, key = self.tmp / "peer.crt", self.tmp / "peer.key"
        if not cert.exists():
            CERT.write(cert, key)
        return str(cert), str(key)

    async def child(self, *args: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=str(ROOT), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1",
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        child = Child(proc)
        self.stack.push_async_callback(child.stop)
        return child

    async def relay(self) -> Child:
        """``python -m relay`` on 127.0.0.1, serving the test CA's certificate."""
        cert, key = self.cert_files()
        relay = await self.child("-m", "relay", "--listen", "127.0.0.1:0", "--cert", cert, "--key", key,
                                 "--cache-mib", "64", "--log-level", "ERROR")
        relay.url = (await relay.line("relay listening on ")).split()[-1]
        self.relays.append(relay)
        return relay

    async def faulty_holder(self, mode: str, blocks: list[dict[str, Any]]) -> Child:
        """``tests/fault_moqt_peer.py MODE`` serving ``blocks`` (:func:`peer_blocks`)."""
        cert, key = self.cert_files()
        path = self.tmp / f"blocks-{len(self.relays)}-{secrets.token_hex(4)}.json"
        path.write_text(json.dumps({"blocks": blocks}))
        peer = await self.child(str(ROOT / "tests" / "fault_moqt_peer.py"), mode, cert, key, str(path))
        peer.url = await peer.line("moqt://")
        return peer

    async def instance(self, *, relay: Child | None = None, holder: bool = True, store: BlockStore | None = None,
                       index_url: str | None = None, pc_url: str | None = None,
                       engine: dict[str, Any] | None = None, instance: dict[str, Any] | None = None,
                       sessions: bool = False, **kw: Any) -> RunningServer:
        """An instance running the reference model (``[instance.engine]``), in this process;
        with ``sessions`` also the §6.8 sessions a PC starts (``serve_model_instance``; it
        reports to the PC before this returns)."""
        ec = EngineConfig(model_dir=str(self.model_dir), block_tokens=B, torch_threads=1,
                          relay_url=relay.url if relay is not None else None,
                          holder_url=self.holder.url if holder else None, scope_keys={SCOPE_ID: SCOPE_KEY},
                          moqt_timeout_s=REQUEST_S, moqt_idle_timeout_s=IDLE_S, **(engine or {}))
        ic = InstanceConfig(index_url=index_url or self.index.url, pc_url=pc_url, token=TOKEN,
                            tiers=(TierConfig("host", 64 * MiB),), engine=ec, **(instance or {}))
        serve = serve_model_instance if sessions else serve_instance
        return await self.stack.enter_async_context(await serve(
            ControlConfig(auth=self.auth, instance=ic, tls=TlsConfig(ca_file=ca_file())), report=sessions,
            store=store, clock=self.clock, **kw))

    def keys(self, prompt: str = PROMPT) -> list[RecordKey]:
        """The Block Keys of the complete blocks of ``prompt`` (§4.2)."""
        descriptor = build_descriptor(ensure_model_files(directory=self.model_dir), block_tokens=B)
        from kvsp_moq.kvsp.compat import compat_id

        compat = compat_id(descriptor)
        ids = ByteTokenizer().encode(prompt)
        return [RecordKey(compat, SCOPE_ID, k) for k in BlockKeyChain(SCOPE_KEY, compat, B).extend(ids)]

    async def lookup(self, keys: list[RecordKey]) -> LookupResponse:
        return await self.index_client.lookup(LookupRequest(
            scope_id=SCOPE_ID, compat_id=keys[0].compat_id, block_keys=tuple(k.block_key for k in keys)))


def peer_blocks(store: BlockStore, keys: list[RecordKey]) -> list[dict[str, Any]]:
    """The replicas of ``keys`` in ``store`` as :mod:`fault_moqt_peer` serves them (the same
    namespaces, hence the same replicas, and their true digests)."""
    out = []
    for key in keys:
        info = store.get(key)
        assert info is not None and info.complete
        out.append({
            "namespace": [bytes(f).hex() for f in info.block_name().namespace_fields()],
            "tokens": info.token_count,
            "layers": [bytes(store.layer_payload(key, layer, touch=False)).hex()
                       for layer in range(info.first_layer, info.last_layer + 1)],
            "digests": [d.hex() for d in info.layer_digests if d is not None],
        })
    return out


async def cluster_of(tmp: Path, model_dir: Path, clock: Timer | None = None) -> AsyncIterator[Cluster]:
    """The IS and the HTTP holder (in this process); relays, peers and instances on demand."""
    descriptor = build_descriptor(ensure_model_files(directory=model_dir), block_tokens=B)
    auth = Authorizer.from_tokens({TOKEN: everyone()})
    timer: Timer = clock if clock is not None else MonotonicClock()
    async with AsyncExitStack() as stack:
        index = await stack.enter_async_context(await serve_index(
            ControlConfig(auth=auth, index=IndexConfig(descriptors=(descriptor,))), clock=timer))
        hc = HolderConfig(index_url=index.url, index_token=TOKEN, tiers=(TierConfig("host", 64 * MiB),))
        holder = await stack.enter_async_context(await serve_holder(ControlConfig(auth=auth, holder=hc), clock=timer))
        client = HttpIndexClient(index.url, TOKEN)
        stack.push_async_callback(client.close)
        yield Cluster(stack, tmp, model_dir, auth, index, holder, client, timer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    torch.set_num_threads(1)
    return ensure_model_files(directory=tmp_path_factory.mktemp("model")).directory


class FaultyStore(BlockStore):
    """An instance's own store (a real :class:`BlockStore`, host tier) that runs ``fault(key,
    layer)`` when a layer of a chosen block is read — what its MoqtHolder does for a FETCH
    (bridge/track.py) — before it is read: SIGKILL the relay, evict the block, ..."""

    def __init__(self) -> None:
        super().__init__([HostTier(64 * MiB)])
        self.fault: Callable[[RecordKey, int], None] | None = None

    def layer_payload(self, key: RecordKey, layer: int, *, touch: bool = True) -> Any:
        if self.fault is not None:
            self.fault(key, layer)
        return super().layer_payload(key, layer, touch=touch)


class Gate:
    """A TCP proxy on 127.0.0.1 in front of ``target`` (None: nothing behind it) that turns
    into a black hole — connections accepted, nothing answered, nothing closed — when
    :meth:`close_gate` is called or once a request carrying ``trigger`` passes: an IS or a PC
    that stops answering (a partition, a hung process). ``url`` is the proxy's base URL."""

    def __init__(self, target: str | None = None, *, trigger: bytes | None = None) -> None:
        from urllib.parse import urlsplit

        self.target = urlsplit(target) if target is not None else None
        self.trigger = trigger
        self.closed = asyncio.Event()
        self.held = 0  # requests swallowed since the gate closed
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> Gate:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/"
        return self

    def close_gate(self) -> None:
        self.closed.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while not self.closed.is_set() and self.target is not None:
                data = await reader.read(65536)
                if not data:
                    return
                if self.trigger is not None and self.trigger in data:
                    self.close_gate()
                    break
                if upstream is None:
                    upstream = await asyncio.open_connection(self.target.hostname, self.target.port)
                    self._spawn(self._pipe(upstream[0], writer))
                upstream[1].write(data)
                await upstream[1].drain()
            self.held += 1
            await asyncio.Event().wait()  # the black hole: read nothing more, answer nothing
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if upstream is not None:
                upstream[1].close()
            writer.close()
            self._tasks.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while not self.closed.is_set():
                data = await src.read(65536)
                if not data or self.closed.is_set():
                    return
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
