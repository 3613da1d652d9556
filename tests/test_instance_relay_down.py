"""An instance whose relay is down when it starts (found by ``kvsp soak``: an instance
restarted while its relay was restarting exited 1, "cannot connect: QUIC handshake ... timed
out"). It must start and serve — a generate recomputes, the block goes to its store and its
own record to the IS, no ``moqt://`` record names the absent relay (binding §10) — and attach
to the relay once it is up: the blocks it computed are then FETCHable through the relay and
their ``moqt://`` records are at the IS.

Real roles on 127.0.0.1: an Index Service, an instance running the reference model with
``[instance.engine] relay_url`` on a port where nothing listens yet, then a ``python -m
relay`` process started on that port. Waits are on events, or a bounded poll that fails
loudly."""

from __future__ import annotations

import asyncio
import secrets
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from bridge_support import CERT, ca_file, client_config  # noqa: E402
from kvsp_moq.control.client.http import HttpIndexClient  # noqa: E402
from kvsp_moq.control.common.auth import Authorizer, Grant, Principal  # noqa: E402
from kvsp_moq.control.common.clock import MonotonicClock  # noqa: E402
from kvsp_moq.control.common.config import ControlConfig, IndexConfig, InstanceConfig, TierConfig  # noqa: E402
from kvsp_moq.control.common.engine_config import EngineConfig  # noqa: E402
from kvsp_moq.control.common.tls import TlsConfig  # noqa: E402
from kvsp_moq.control.engine.records import GenerateRequest  # noqa: E402
from kvsp_moq.control.index.serve import serve_index  # noqa: E402
from kvsp_moq.control.instance.serve import INSTANCE_SERVICE, serve_instance  # noqa: E402
from kvsp_moq.kvsp import scope  # noqa: E402
from kvsp_moq.kvsp.blockkeys import BlockKeyChain  # noqa: E402
from kvsp_moq.kvsp.records import LookupRequest, LookupResponse  # noqa: E402
from kvsp_moq.model import ByteTokenizer, build_descriptor, ensure_model_files  # noqa: E402
from kvsp_moq.pubsub import connect  # noqa: E402
from kvsp_moq.storage import RecordKey  # noqa: E402
from relay_restart_support import RelayProcess, within  # noqa: E402

B = 16
MiB = 1 << 20
PROMPT = "System: answer briefly and cite sources. User: what does a relay do?"
TOKEN = secrets.token_urlsafe(24)
SCOPE_KEY = secrets.token_bytes(32)
SCOPE_ID = scope.scope_id(SCOPE_KEY)
EVERYONE = Principal("all", scopes=Grant(everything=True), holders=Grant(everything=True),
                     instances=Grant(everything=True))
#: How long the relay may take to be attached and the records published once it is up
#: (reconnect backoff 0.05 s doubling to 0.3 s; a loaded 2-core machine).
BOUND = 20.0


def free_udp_port() -> int:
    """A UDP port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def relay_kinds(looked: LookupResponse) -> list[list[str]]:
    return [sorted(r.holder.split(":")[0] for r in blk.replicas) for blk in looked.blocks]


async def test_instance_starts_without_its_relay_then_publishes_through_it(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model_dir = ensure_model_files(directory=tmp_path / "model").directory
    descriptor = build_descriptor(ensure_model_files(directory=model_dir), block_tokens=B)
    auth = Authorizer.from_tokens({TOKEN: EVERYONE})
    (tmp_path / "cert.pem").write_bytes(CERT.cert_pem)
    (tmp_path / "key.pem").write_bytes(CERT.key_pem)
    relay = RelayProcess(tmp_path / "relay.log", "--cert", str(tmp_path / "cert.pem"),
                         "--key", str(tmp_path / "key.pem"))
    relay.port = free_udp_port()  # nothing listens there yet

    index = await serve_index(ControlConfig(auth=auth, index=IndexConfig(descriptors=(descriptor,))),
                              clock=MonotonicClock())
    client = HttpIndexClient(index.url, TOKEN)
    try:
        engine_config = EngineConfig(model_dir=str(model_dir), block_tokens=B, torch_threads=1,
                                     relay_url=relay.url, scope_keys={SCOPE_ID: SCOPE_KEY},
                                     moqt_timeout_s=1.0, moqt_reconnect_initial_s=0.05,
                                     moqt_reconnect_max_s=0.3)
        ic = InstanceConfig(index_url=index.url, token=TOKEN, tiers=(TierConfig("host", 64 * MiB),),
                            engine=engine_config)
        # Starts although the relay is unreachable (it used to exit: the attach re-raised).
        async with await within(serve_instance(
                ControlConfig(auth=auth, instance=ic, tls=TlsConfig(ca_file=ca_file())), report=False)) as ii:
            engine = ii.app[INSTANCE_SERVICE].inference
            assert engine is not None and engine.moqt_holder is not None
            assert engine.moqt_holder.relay_session(relay.url) is None

            # Serves: the blocks are recomputed and stored; no moqt:// record names the relay.
            cold = await within(engine.generate(EVERYONE, GenerateRequest(
                scope_id=SCOPE_ID, prompt=PROMPT, max_tokens=4)))
            ids = ByteTokenizer().encode(PROMPT)
            blocks = len(ids) // B
            assert blocks >= 2 and [b.source for b in cold.blocks] == ["recomputed"] * blocks
            assert cold.published == ("store",)
            keys = BlockKeyChain(SCOPE_KEY, engine.compat_id, B).extend(ids)
            lookup = LookupRequest(scope_id=SCOPE_ID, compat_id=engine.compat_id, block_keys=tuple(keys))
            assert relay_kinds(await within(client.lookup(lookup))) == [["http"]] * blocks

            # The relay comes up: the instance attaches with its backoff, announces the blocks
            # it holds and publishes their moqt:// records (a bounded poll of the IS).
            await relay.start()
            try:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + BOUND
                while relay_kinds(looked := await within(client.lookup(lookup))) != [["http", "moqt"]] * blocks:
                    assert loop.time() < deadline, f"no moqt:// records {BOUND} s after the relay came up"
                    await asyncio.sleep(0.05)
                assert engine.moqt_holder.relay_session(relay.url) is not None

                # Each record names the relay, and the block is FETCHable through it: the
                # instance's own bytes, every layer.
                session = await within(connect(relay.url, client_config()))
                try:
                    for blk, key in zip(looked.blocks, keys, strict=True):
                        (record,) = [r for r in blk.replicas if r.holder.startswith("moqt:")]
                        assert record.holder == relay.url
                        fetch = await within(session.fetch(record.block_name().namespace_fields(), "raw"))
                        objs = await within(fetch.collect())
                        held = RecordKey(engine.compat_id, SCOPE_ID, key)
                        assert [o.payload for o in objs] == [
                            bytes(engine.store.layer_payload(held, layer, touch=False))
                            for layer in range(engine.bundle.layers)]
                finally:
                    await within(session.close())
            finally:
                await relay.stop()
    finally:
        await client.close()
        await index.close()
