"""Subscribers in their own processes for ``kvsp bench relay --subscriber-processes``.

In a deployment each subscriber of a rack relay is its own inference instance, so N
subscribers have N processes (and cores) to receive with. In-process subscribers share one
event loop, which on a many-core host makes the bench process, not the relay, the limit.

``python -m kvsp_moq.bench.relay.subscriber URL OBJECT_SIZE COUNT DATAGRAM_SIZE`` connects
to the relay, SUBSCRIBEs to the bench track (the backend from ``$KVSP_QUIC_BACKEND``, like
every endpoint of the bench), prints ``ready`` once SUBSCRIBE_OK has arrived, receives COUNT
objects of OBJECT_SIZE octets into one buffer, and prints one JSON line: ``last`` (the
``time.monotonic()`` at which the last object completed; CLOCK_MONOTONIC is one clock for
every process of the host) and ``sha256`` of what it received, for the parent to check.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from collections.abc import Sequence

from ...pubsub import connect
from ...transport import TransportConfig, new_event_loop

__all__ = ["SubscriberProcesses", "main"]

#: The bench's track (``bench.relay.driver``): namespace and name.
NAMESPACE = ("kvsp-bench", "relay")
TRACK = "block"


async def _receive(url: str, object_size: int, count: int, datagram_size: int) -> dict[str, object]:
    config = TransportConfig(insecure=True, max_datagram_size=datagram_size, use_uvloop=True)
    buf = bytearray(object_size * count)
    view = memoryview(buf)
    session = await connect(url, config)
    try:
        sub = await session.subscribe(NAMESPACE, TRACK, on_object_begin=(
            lambda info: view[info.object_id * object_size:(info.object_id + 1) * object_size]))
        print("ready", flush=True)
        got = 0
        last = 0.0
        async for _obj in sub:
            got += 1
            if got == count:
                last = time.monotonic()
                break
        return {"last": last, "sha256": hashlib.sha256(buf).hexdigest()}
    finally:
        await session.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.bench.relay.subscriber")
    p.add_argument("url")
    p.add_argument("object_size", type=int)
    p.add_argument("count", type=int)
    p.add_argument("datagram_size", type=int)
    args = p.parse_args(argv)
    loop = new_event_loop(use_uvloop=True)
    try:
        out = loop.run_until_complete(
            _receive(args.url, args.object_size, args.count, args.datagram_size))
    finally:
        loop.close()
    print(json.dumps(out), flush=True)
    return 0


class SubscriberProcesses:
    """N subscriber processes on ``url``: ``await start()`` returns once every one has its
    SUBSCRIBE_OK; ``await results()`` their JSON lines; ``close()`` ends any left running."""

    def __init__(self, n: int, url: str, object_size: int, count: int,
                 datagram_size: int) -> None:
        self.args = [url, str(object_size), str(count), str(datagram_size)]
        self.n = n
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, timeout: float = 60.0) -> None:
        for _ in range(self.n):
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvsp_moq.bench.relay.subscriber", *self.args,
                stdout=asyncio.subprocess.PIPE))
        for proc in self.procs:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout)).decode().strip()
            if line != "ready":
                raise RuntimeError(f"a subscriber process did not subscribe (said {line!r})")

    async def results(self, timeout: float = 600.0) -> list[tuple[float, str]]:
        """Each process's (``last``, ``sha256``), once all have ended."""
        out = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            await proc.wait()
            if proc.returncode != 0 or not line.startswith(b"{"):
                raise RuntimeError(f"a subscriber process failed (exit {proc.returncode})")
            got = json.loads(line)
            out.append((float(got["last"]), str(got["sha256"])))
        return out

    async def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
