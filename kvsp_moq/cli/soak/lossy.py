"""The lossy link of ``kvsp soak``: a UDP forwarder in front of relay B.

``python -m kvsp_moq.cli.soak.lossy --listen HOST:PORT --to HOST:PORT [--loss L] [--delay-ms D]
[--seed S]`` receives datagrams on ``--listen``; for each client address it opens one socket
towards ``--to`` (so replies find their way back) and forwards both directions, each through its
own :class:`~kvsp_moq.cli.bench.wan.netem.DelayLine` of ``kvsp bench wan``'s shaper (Bernoulli
loss L %, fixed delay D, a bounded queue): real packets dropped on a real path, at the UDP level
instead of the IP level (no TUN device or network namespace, so it runs unprivileged; QUIC sees
the same thing either way: datagrams that never arrive).

It prints ``lossy link udp://HOST:PORT -> HOST:PORT`` once bound, and on SIGTERM/SIGINT one JSON
line of counters per direction. At most :data:`MAX_FLOWS` client addresses are kept (the oldest
is forgotten first): a peer's new ports cannot grow it without bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import OrderedDict
from typing import Any, cast

from ..bench.wan.netem import DelayLine

__all__ = ["MAX_FLOWS", "main"]

MAX_FLOWS = 64
_QUEUE_LIMIT = 10_000  # packets per direction and flow (netem's limit)


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


class _Line:
    """One direction of one flow: packets offered, sent when due."""

    def __init__(self, loop: asyncio.AbstractEventLoop, line: DelayLine, send: Any) -> None:
        self.loop, self.line, self.send = loop, line, send
        self._timer: asyncio.TimerHandle | None = None

    def offer(self, data: bytes) -> None:
        self.line.offer(data, time.monotonic())
        self._flush()

    def _flush(self) -> None:
        self._timer = None
        for packet in self.line.pop_due(time.monotonic()):
            self.send(packet)
        due = self.line.next_due()
        if due is not None and self._timer is None:
            self._timer = self.loop.call_at(self.loop.time() + max(0.0, due - time.monotonic()), self._flush)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _Upstream(asyncio.DatagramProtocol):
    def __init__(self, back: Any) -> None:
        self.back = back

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.back(data)


class Link(asyncio.DatagramProtocol):
    def __init__(self, target: tuple[str, int], loss: float, delay_s: float, seed: int) -> None:
        self.target, self.loss, self.delay_s, self.seed = target, loss, delay_s, seed
        self.flows: OrderedDict[tuple[str, int], tuple[asyncio.DatagramTransport, _Line, _Line]] = OrderedDict()
        self.totals = {"a_to_b": DelayLine(0, 0, 1, 0).counters, "b_to_a": DelayLine(0, 0, 1, 0).counters}
        self.transport: asyncio.DatagramTransport | None = None
        self._opening: dict[tuple[str, int], list[bytes]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        flow = self.flows.get(addr)
        if flow is not None:
            self.flows.move_to_end(addr)
            flow[1].offer(data)
        elif addr in self._opening:
            if len(self._opening[addr]) < 64:
                self._opening[addr].append(data)
        else:
            self._opening[addr] = [data]
            asyncio.get_running_loop().create_task(self._open(addr))

    async def _open(self, addr: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        assert self.transport is not None
        down = self.transport
        n = len(self.flows) + 1
        back = _Line(loop, DelayLine(self.delay_s, self.loss, _QUEUE_LIMIT, self.seed * 1000 + 2 * n + 1),
                     lambda p: down.sendto(p, addr))
        up_transport, _ = await loop.create_datagram_endpoint(lambda: _Upstream(back.offer), remote_addr=self.target)
        forth = _Line(loop, DelayLine(self.delay_s, self.loss, _QUEUE_LIMIT, self.seed * 1000 + 2 * n),
                      up_transport.sendto)
        self.flows[addr] = (up_transport, forth, back)
        while len(self.flows) > MAX_FLOWS:
            _, (old, f, b) = self.flows.popitem(last=False)
            self._count(f, b)
            f.close()
            b.close()
            old.close()
        for packet in self._opening.pop(addr, []):
            forth.offer(packet)

    def _count(self, forth: _Line, back: _Line) -> None:
        for name, line in (("a_to_b", forth), ("b_to_a", back)):
            total, c = self.totals[name], line.line.counters
            for key in ("packets_in", "bytes_in", "forwarded", "bytes_forwarded", "dropped_loss", "dropped_limit"):
                setattr(total, key, getattr(total, key) + getattr(c, key))

    def report(self) -> dict[str, Any]:
        for _, forth, back in self.flows.values():
            self._count(forth, back)
        return {name: {k: v for k, v in c.as_dict().items() if not k.startswith("late_")} for name, c in self.totals.items()}


async def _run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    link = Link(args.to, args.loss, args.delay_ms / 1e3, args.seed)
    transport, _ = await loop.create_datagram_endpoint(lambda: link, local_addr=args.listen)
    host, port = transport.get_extra_info("sockname")[:2]
    print(f"lossy link udp://{host}:{port} -> {args.to[0]}:{args.to[1]} (loss {args.loss:g} %, delay {args.delay_ms:g} ms)",
          flush=True)
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    transport.close()
    print(json.dumps({"lossy_link": link.report()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.cli.soak.lossy", description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_addr, required=True)
    p.add_argument("--to", type=_addr, required=True)
    p.add_argument("--loss", type=float, default=0.5, help="percent of datagrams dropped, each way (default 0.5)")
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay (default 1 ms)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 <= args.loss <= 100 or args.delay_ms < 0:
        p.error("--loss must be in [0, 100] and --delay-ms >= 0")
    asyncio.run(_run(args))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
