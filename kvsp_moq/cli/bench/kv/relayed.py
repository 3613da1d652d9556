"""The relay rows of ``kvsp bench kv`` (issue 16): the benchmark block through a relay, each
role in its own process as deployed — the relay (``relay.Relay``), a holder attached to it as
a publisher (``MoqtHolder.attach_relay``: PUBLISH_NAMESPACE, the relay's FETCHes answered
from its store), the loader in the bench process — on the transport backend and datagram size
of a direct row, so the two compare in the same run:

* ``relay_cold``: a block the relay has not seen (a cache miss: ONE upstream FETCH, cut
  through, relay/fetch/inflight.py); best of ``repeat``, each run a different block (same bytes,
  another block key), so every run is a miss;
* ``relay_warm``: the first block again, from the relay's cache; best of ``repeat``.

``python -m kvsp_moq.cli.bench.kv.relayed relay --backend B --datagram-size D --cache-mib M``
prints the relay's URL; ``python -m kvsp_moq.cli.bench.kv.relayed holder --relay URL --blocks K
[--layers N --layer-mib M --backend B --datagram-size D]`` stores K blocks, attaches and prints
one JSON line (``{"records": [...], "tokens": T}``); both serve until their stdin closes and
``gc.freeze()`` their heap first (docs/perf/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from ....bridge import MoqtHolder, MoqtPool
from ....kvsp.records import ReplicaRecord
from ....storage import BlockStore, HostTier, RecordKey
from ....transport import TransportConfig, new_event_loop
from ....transport.tls import make_self_signed
from .holder import KEY, freeze_heap, geometry, make_block
from .loader import Timing, timed_load

__all__ = ["main", "measure_relay", "publish_through_relay", "serve_until_stdin_closes", "stop_process"]

_MODULE = "kvsp_moq.cli.bench.kv.relayed"


def _spawn(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m relayed ARGS``; its first stdout line (it serves until its stdin
    closes)."""
    proc = subprocess.Popen([sys.executable, "-m", _MODULE, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip():
        stop_process(proc)
        raise RuntimeError(f"{_MODULE} {args[0]} did not start (exit {proc.returncode})")
    return proc, line.strip()


def stop_process(proc: subprocess.Popen[str]) -> None:
    """End a process that serves until its stdin closes (killed after 30 s)."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def measure_relay(layers: int, layer_bytes: int, datagram_size: int, backend: str,
                        repeat: int) -> dict[str, Timing]:
    """``relay_cold`` and ``relay_warm`` (see the module docstring)."""
    common = ["--backend", backend, "--datagram-size", str(datagram_size)]
    cache_mib = max(64, 2 * (repeat * layers * layer_bytes >> 20))
    relay, url = _spawn(["relay", *common, "--cache-mib", str(cache_mib)])
    holder: subprocess.Popen[str] | None = None
    pool = MoqtPool(TransportConfig(backend=backend, insecure=True,
                                    max_datagram_size=datagram_size), connect_timeout=30.0)
    try:
        holder, line = _spawn(["holder", "--relay", url, "--blocks", str(repeat), "--layers",
                               str(layers), "--layer-mib", str(layer_bytes >> 20), *common])
        info = json.loads(line)
        records = [ReplicaRecord.from_json(r) for r in info["records"]]
        geo, tokens = geometry(), int(info["tokens"])
        await pool.get(url)  # we time the block, not the handshake
        cold = [await timed_load(r, geo, tokens, pool) for r in records]
        warm = [await timed_load(records[0], geo, tokens, pool) for _ in range(repeat)]
    finally:
        await pool.close()
        for p in (holder, relay):
            if p is not None:
                stop_process(p)
    best = min(cold, key=lambda t: t[1]), min(warm, key=lambda t: t[1])
    return {"relay_cold": best[0], "relay_warm": best[1]}


# -- the two processes -------------------------------------------------------------------------
def _serve(until_stdin_closes: Callable[[asyncio.Future[None]], Awaitable[None]]) -> int:
    """Run ``until_stdin_closes(stop)`` on a uvloop loop; ``stop`` resolves when our stdin
    closes (the bench process ended us, or died)."""
    loop = new_event_loop(use_uvloop=True)
    stop: asyncio.Future[None] = loop.create_future()
    fd = sys.stdin.fileno()

    def readable() -> None:
        if not os.read(fd, 1 << 16):
            loop.remove_reader(fd)
            if not stop.done():
                stop.set_result(None)

    loop.add_reader(fd, readable)
    try:
        loop.run_until_complete(until_stdin_closes(stop))
    finally:
        loop.close()
    return 0


#: The same for another module's role processes (``kv.prefetch``'s holder).
serve_until_stdin_closes = _serve


def _server_config(args: argparse.Namespace) -> TransportConfig:
    cert = make_self_signed()
    return TransportConfig(backend=args.backend, certificate_pem=cert.cert_pem,
                           private_key_pem=cert.key_pem, max_datagram_size=args.datagram_size)


async def _relay(args: argparse.Namespace, stop: asyncio.Future[None]) -> None:
    from relay import Relay, RelayConfig  # only in this process

    logging.getLogger("relay").setLevel(logging.ERROR)  # not the "open relay" warning

    client = TransportConfig(backend=args.backend, insecure=True,
                             max_datagram_size=args.datagram_size)
    relay = await Relay(RelayConfig(server_transport=_server_config(args),
                                    upstream_transport=client,
                                    cache_bytes=args.cache_mib << 20)).start()
    try:
        freeze_heap()
        print(relay.url, flush=True)
        await stop
    finally:
        await relay.close()


async def _holder(args: argparse.Namespace, stop: asyncio.Future[None]) -> None:
    layer_bytes = args.layer_mib << 20
    geo, tokens, arrays = make_block(args.layers, layer_bytes)
    store = BlockStore([HostTier(4 * args.blocks * args.layers * layer_bytes)])
    keys = [replace(KEY, block_key=bytes([i + 1]) * 32) for i in range(args.blocks)]
    for key in keys:
        store.put_layers(key, arrays, token_count=tokens, geometry=geo)
    del arrays
    await publish_through_relay(store, keys, args, stop, tokens=tokens)


async def publish_through_relay(store: BlockStore, keys: list[RecordKey], args: argparse.Namespace,
                                stop: asyncio.Future[None], **line: Any) -> None:
    """A holder role: publish ``keys`` of ``store`` through ``args.relay`` (a MoqtHolder
    attached as a publisher), print one JSON line ``{"records": [...], **line}`` and serve
    until ``stop``."""
    holder = MoqtHolder(store)
    try:
        for key in keys:
            holder.publish(key)
        await holder.attach_relay(args.relay, TransportConfig(
            backend=args.backend, insecure=True, max_datagram_size=args.datagram_size))
        await holder.wait_announced()
        records = [holder.replica_record(k, holder=args.relay).to_json() for k in keys]
        freeze_heap()
        print(json.dumps({"records": records, **line}, separators=(",", ":")), flush=True)
        await stop
    finally:
        await holder.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    p.add_argument("role", choices=("relay", "holder"))
    p.add_argument("--backend", default="aioquic")
    p.add_argument("--datagram-size", type=int, default=16384)
    p.add_argument("--cache-mib", type=int, default=256, help="relay: its cache budget")
    p.add_argument("--relay", help="holder: the relay's moqt:// URL")
    p.add_argument("--blocks", type=int, default=1, help="holder: blocks (distinct keys)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer-mib", type=int, default=1)
    args = p.parse_args(argv)
    if args.role == "holder" and not args.relay:
        p.error("holder: --relay URL")
    return _serve(lambda stop: (_relay if args.role == "relay" else _holder)(args, stop))


if __name__ == "__main__":
    raise SystemExit(main())
