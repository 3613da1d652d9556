"""The userspace WAN shaper of ``kvsp bench wan`` (``--shaper tun``), in its own process.

``python -m kvsp_moq.cli.bench.wan.shaper --ns-a NS --addr-a IP --ns-b NS --addr-b IP
[--delay-ms D --loss L --limit N --seed S --mtu M --rate-mbit R]`` (root) creates two TUN devices
(``.tun``), moves one into each network namespace with a point-to-point address
towards the other, and forwards the IP packets between the two descriptors, each direction
through its own :class:`~.netem.DelayLine`: what ``tc qdisc add dev X root netem
delay Dms loss L% limit N [rate Rmbit]`` on both ends of a veth pair would do, for kernels without
``sch_netem``. IP-level, so TCP (the HTTP baseline) and QUIC cross the same shaped path.

It prints one JSON line (``{"ready": ...}``) once the path is up, forwards until its stdin
closes (or SIGTERM / SIGINT), then reads what is still waiting at the devices and no more,
lets the packets queued leave at their due time (at most D), prints one JSON line of counters per direction (``a_to_b``,
``b_to_a``: :class:`~.netem.Counters` plus ``write_errors`` and ``tun_tx_dropped``,
the packets the kernel dropped because the shaper did not read them in time) and exits,
which removes the devices (they live as long as the process's descriptors).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import time
from typing import Any

from .netem import DelayLine
from .tun import TunError, open_tun, place, tx_dropped

__all__ = ["Direction", "main", "shape"]

_BATCH = 128  # packets read per wake-up and direction, at most: the other direction's turn
_TXQUEUELEN = 10_000  # the kernel's queue towards the shaper (a burst is held, not dropped)


class Direction:
    """Forward one direction, ``src`` to ``dst`` descriptor, through ``line``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src: int, dst: int, line: DelayLine,
                 read_size: int) -> None:
        self.loop, self.src, self.dst, self.line, self.read_size = loop, src, dst, line, read_size
        self.write_errors = 0
        self.drained: asyncio.Future[None] = loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._reading = False

    def start(self) -> None:
        self.loop.add_reader(self.src, self._readable)
        self._reading = True

    def stop(self) -> None:
        """Read no more, once the packets already waiting at the device are read (they were
        sent before the stop: they cross the path too); :attr:`drained` is done once the
        queued packets have left."""
        if self._reading:
            self.loop.remove_reader(self.src)
            self._reading = False
            self._read(_TXQUEUELEN)  # at most the device's queue: bounded under any load
        self._arm()

    def _readable(self) -> None:
        self._read(_BATCH)

    def _read(self, most: int) -> None:
        packets: list[bytes] = []
        for _ in range(most):
            try:
                packets.append(os.read(self.src, self.read_size))
            except BlockingIOError:
                break
            except OSError:  # the device is gone (its namespace was deleted): nothing more
                if self._reading:
                    self.loop.remove_reader(self.src)
                    self._reading = False
                break
        # Stamped after the reads, so no packet of the batch arrived after its stamp: the
        # delay applied is never shorter than the one configured.
        now = time.monotonic()
        for packet in packets:
            self.line.offer(packet, now)
        self._deliver()

    def _deliver(self) -> None:
        for packet in self.line.pop_due(time.monotonic()):
            try:
                os.write(self.dst, packet)
            except OSError:
                self.write_errors += 1
        self._arm()

    def _due(self) -> None:
        self._timer = None
        self._deliver()

    def _arm(self) -> None:
        due = self.line.next_due()
        if due is None:
            if not self._reading and not self.drained.done():
                self.drained.set_result(None)
            return
        if self._timer is None:  # a pending timer is for an earlier head: FIFO, fixed delay
            # The loop's timers may fire early by up to a millisecond (uvloop's clock):
            # _deliver compares with time.monotonic() and re-arms until the head is due.
            self._timer = self.loop.call_later(max(0.0, due - time.monotonic()), self._due)


async def shape(fd_a: int, fd_b: int, delay_s: float, loss_pct: float, limit: int, seed: int,
                read_size: int, rate: float = 0.0) -> tuple[Direction, Direction]:
    """Forward between ``fd_a`` and ``fd_b`` until stdin closes or SIGTERM / SIGINT; return
    both directions (a to b, b to a) once drained. ``rate``: bytes per second, each way."""
    loop = asyncio.get_running_loop()
    a_to_b = Direction(loop, fd_a, fd_b, DelayLine(delay_s, loss_pct, limit, 2 * seed, rate),
                       read_size)
    b_to_a = Direction(loop, fd_b, fd_a, DelayLine(delay_s, loss_pct, limit, 2 * seed + 1, rate),
                       read_size)
    stop = loop.create_future()

    def stopping() -> None:
        if not stop.done():
            stop.set_result(None)

    def stdin_readable() -> None:
        try:
            more = os.read(0, 1 << 12)
        except OSError:
            more = b""
        if not more:
            loop.remove_reader(0)
            stopping()

    loop.add_reader(0, stdin_readable)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping)
    for d in (a_to_b, b_to_a):
        d.start()
    await stop
    for d in (a_to_b, b_to_a):
        d.stop()
    await asyncio.gather(a_to_b.drained, b_to_a.drained)
    return a_to_b, b_to_a


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _report(d: Direction, dev: str, netns: str) -> dict[str, Any]:
    return {**d.line.counters.as_dict(), "write_errors": d.write_errors,
            "tun_tx_dropped": tx_dropped(dev, netns)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.cli.bench.wan.shaper")
    p.add_argument("--ns-a", required=True, help="network namespace of end a")
    p.add_argument("--addr-a", required=True, help="IPv4 address of end a")
    p.add_argument("--ns-b", required=True, help="network namespace of end b")
    p.add_argument("--addr-b", required=True, help="IPv4 address of end b")
    p.add_argument("--delay-ms", type=float, default=20.0, help="netem delay, each direction")
    p.add_argument("--loss", type=float, default=0.5, help="netem loss, percent, each direction")
    p.add_argument("--limit", type=int, default=1000,
                   help="netem limit: packets queued per direction, tail drop beyond")
    p.add_argument("--seed", type=int, default=1, help="seed of the loss draws")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--rate-mbit", type=float, default=0.0,
                   help="netem rate: the link's rate each direction, Mbit/s (IP packets; "
                        "default 0: unlimited)")
    args = p.parse_args(argv)
    rate = args.rate_mbit * 1e6 / 8
    try:  # the devices and the delay lines check their arguments before anything runs
        DelayLine(args.delay_ms / 1e3, args.loss, args.limit, 0, rate)
    except ValueError as exc:
        p.error(str(exc))
    tag = os.getpid() % 100_000
    devs = (f"kvtun{tag}a", f"kvtun{tag}b")
    fds: list[int] = []
    try:
        try:
            fds += [open_tun(dev) for dev in devs]
            place(devs[0], args.ns_a, args.addr_a, args.addr_b, args.mtu, _TXQUEUELEN)
            place(devs[1], args.ns_b, args.addr_b, args.addr_a, args.mtu, _TXQUEUELEN)
        except TunError as exc:
            print(f"kvsp bench wan (shaper): {exc}", file=sys.stderr)
            return 1
        gc.collect()
        gc.freeze()  # the setup's objects: out of the collector's way while packets flow
        print(json.dumps({"ready": True, "devices": {"a": devs[0], "b": devs[1]},
                          "delay_ms": args.delay_ms, "loss_pct": args.loss,
                          "limit": args.limit, "seed": args.seed,
                          "rate_mbit": args.rate_mbit}), flush=True)
        loop = _loop()
        try:
            a_to_b, b_to_a = loop.run_until_complete(
                shape(fds[0], fds[1], args.delay_ms / 1e3, args.loss, args.limit, args.seed,
                      args.mtu + 64, rate))
        finally:
            loop.close()
        # Read while the devices exist: closing the descriptors below removes them.
        print(json.dumps({"a_to_b": _report(a_to_b, devs[0], args.ns_a),
                          "b_to_a": _report(b_to_a, devs[1], args.ns_b)}), flush=True)
        return 0
    finally:
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    raise SystemExit(main())
