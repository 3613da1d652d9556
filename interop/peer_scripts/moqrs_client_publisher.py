"""Run inside the moq-rs venv: a moq-rs *client* that connects to a relay and publishes one
track of deterministic objects (moq-rs announces the broadcast with PUBLISH_NAMESPACE).

Usage: python moqrs_client_publisher.py URL --broadcast PATH --track T
       [--groups G --objects O --size S]

Protocol on stdout/stdin (one line each):

* ``{"event": "connected"}`` once the session is up and the broadcast announced (moq-rs
  sends PUBLISH_NAMESPACE on its own schedule; the harness watches the relay for it);
* ``{"event": "used"}`` when a subscription reached the track (the relay's SUBSCRIBE);
* reads ``publish`` on stdin, then writes groups ``0..G-1`` of ``O`` frames each
  (``payload(g, o, S)``), finishes the track and prints ``{"event": "published", ...}``;
* exits when stdin reaches EOF.

A moq-rs subscription starts at the latest group (moq-lite semantics), so the harness sends
``publish`` only after the subscriber at the far side of the relay got SUBSCRIBE_OK (which the
relay sends only once moq-rs answered its upstream SUBSCRIBE).
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


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--broadcast", required=True)
    ap.add_argument("--track", required=True)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--size", type=int, default=1000)
    args = ap.parse_args()
    loop = asyncio.get_running_loop()
    try:
        async with moq.Client(args.url, tls_verify=False, reconnect=False,
                              websocket_enabled=False) as client:
            broadcast = client.create_broadcast(args.broadcast)
            track = broadcast.publish_track(args.track)
            broadcast.announce()
            emit(event="connected")

            async def report_use() -> None:
                await track.used()
                emit(event="used")

            watcher = asyncio.ensure_future(report_use())
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
                emit(event="published", groups=args.groups, objects=args.objects,
                     size=args.size)
            watcher.cancel()
    except Exception as exc:  # noqa: BLE001 - reported to the harness
        emit(event="error", error=repr(exc))


asyncio.run(main())
