"""Run inside the caprid-relay venv: caprid-relay's publisher SDK (the moq-relay ingest model).

Usage: python caprid_publisher.py URL NAMESPACE TRACK [--groups G --objects O --size S]

caprid's publisher never sends PUBLISH or PUBLISH_NAMESPACE: it waits for the server's
SUBSCRIBE_NAMESPACE, answers with NAMESPACE for its namespace, and writes a track once the
server SUBSCRIBEs to it. Groups are opened in order (caprid numbers them from 0); each carries
``O`` objects ``payload(g, o, S)``. Closing the track sends PUBLISH_DONE.

Events: ``connected``; ``group`` {group}; ``written``; ``end``; ``error``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from payload import payload  # noqa: E402

from aioquic.quic.configuration import QuicConfiguration  # noqa: E402
from caprid_relay import connect_relay_publisher  # noqa: E402
from caprid_relay.quic import connect_quic  # noqa: E402


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def insecure_transport(url: str, protocols: object):  # noqa: ANN201
    return connect_quic(url, protocols, configuration=QuicConfiguration(verify_mode=ssl.CERT_NONE))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("namespace")
    ap.add_argument("track")
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--objects", type=int, default=4)
    ap.add_argument("--size", type=int, default=1000)
    args = ap.parse_args()
    try:
        pub = await connect_relay_publisher(args.url, namespace=args.namespace.split("/"),
                                            create_transport=insecure_transport)
        emit(event="connected")
        writer = pub.register_track(args.track)
        for g in range(args.groups):
            group = await writer.open_group()
            emit(event="group", group=getattr(group, "group_id", None))
            for o in range(args.objects):
                await group.write(payload(g, o, args.size))
            await group.close()
        writer.close()
        emit(event="written")
        await pub.close()
        emit(event="end")
    except Exception as exc:  # noqa: BLE001
        emit(event="error", error=repr(exc))


asyncio.run(main())
