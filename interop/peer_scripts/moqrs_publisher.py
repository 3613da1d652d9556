"""Run inside the moq-rs venv: a moq-rs server that publishes one track of deterministic objects.

Usage: python moqrs_publisher.py --bind 127.0.0.1:0 --cert C --key K --broadcast PATH --track T
       [--groups G --objects O --size S]

Protocol on stdout/stdin (one line each):

* prints ``READY <host:port>`` once listening (the broadcast is already announced);
* reads ``publish`` on stdin, then writes groups ``0..G-1`` of ``O`` frames each
  (``payload(g, o, S)``), finishes the track and prints ``{"event": "published", ...}``;
* exits when stdin reaches EOF.

A moq-rs subscription starts at the *latest* group (moq-lite semantics): groups written before
a subscriber's SUBSCRIBE is answered are not delivered to it, except the newest one. The test
therefore sends ``publish`` only after its SUBSCRIBE_OK arrived.

The broadcast path becomes the IETF Track Namespace split on ``/`` (empty segments dropped):
``kvsp/scope/x`` is announced as PUBLISH_NAMESPACE ``("kvsp", "scope", "x")``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from payload import payload  # noqa: E402

import moq  # noqa: E402


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def serve_sessions(server: moq.Server) -> None:
    """Accept every session and hold it until it closes. moq-rs reports a peer's
    CONNECTION_CLOSE with code 0 as ``MoqError.Protocol`` — not an error here."""
    held: set[asyncio.Task[None]] = set()

    async def hold(request: moq.Request) -> None:
        try:
            session = await request.accept()
            await session.closed()
        except Exception as exc:  # noqa: BLE001 - logged, the session is over either way
            print(f"session ended: {exc!r}", file=sys.stderr, flush=True)

    async for request in server:
        task = asyncio.ensure_future(hold(request))
        held.add(task)
        task.add_done_callback(held.discard)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", default="127.0.0.1:0")
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--broadcast", required=True)
    ap.add_argument("--track", required=True)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--size", type=int, default=1000)
    args = ap.parse_args()
    loop = asyncio.get_running_loop()
    async with moq.Server(args.bind, tls_cert=[args.cert], tls_key=[args.key]) as server:
        broadcast = server.create_broadcast(args.broadcast)
        track = broadcast.publish_track(args.track)
        broadcast.announce()
        serving = asyncio.ensure_future(serve_sessions(server))
        print(f"READY {server.local_addr}", flush=True)
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            if line.strip() != "publish":
                continue
            for g in range(args.groups):
                group = track.create_group(g)
                for o in range(args.objects):
                    group.write_frame(payload(g, o, args.size))
                group.finish()
            track.finish()
            emit(event="published", groups=args.groups, objects=args.objects, size=args.size)
        serving.cancel()


asyncio.run(main())
