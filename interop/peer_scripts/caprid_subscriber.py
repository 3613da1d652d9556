"""Run inside the caprid-relay venv (aioquic < 1.4): caprid-relay's subscriber SDK over native
QUIC, reporting every object as a JSON line.

Usage: python caprid_subscriber.py URL NAMESPACE TRACK      (URL: https://127.0.0.1:PORT/moq)

caprid offers ALPN ``moqt-22`` then ``moqt-20``; the namespace is split on ``/`` here (caprid
itself sends namespace fields verbatim). It sends SETUP option SOLICIT (0x40B5A) and PATH /
AUTHORITY on native QUIC. ``publisher_done`` is not the end of a caprid subscription, so the
script stops once PUBLISH_DONE arrived and as many subgroup streams as its Stream Count ended.

Events: ``connected`` {protocol}; ``subscribed``; ``object`` {group, subgroup, object, status,
len, sha256}; ``subgroup_end``; ``publisher_done`` {status, stream_count}; ``end``; ``error``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
import sys

from aioquic.quic.configuration import QuicConfiguration
from caprid_relay import connect_relay_subscriber
from caprid_relay.quic import connect_quic


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def insecure_transport(url: str, protocols: object):  # noqa: ANN201 - caprid's factory type
    return connect_quic(url, protocols, configuration=QuicConfiguration(verify_mode=ssl.CERT_NONE))


async def main(url: str, namespace: str, track: str) -> None:
    try:
        sub = await connect_relay_subscriber(url, create_transport=insecure_transport)
    except Exception as exc:  # noqa: BLE001 - reported to the harness
        emit(event="error", error=repr(exc))
        return
    emit(event="connected", protocol=str(sub._lifetime.protocol))
    ends, done = 0, None
    try:
        async with sub.subscribe_events(namespace.split("/"), track) as events:
            async for e in events:
                if e.type == "object":
                    o = e.value
                    emit(event="object", group=o.group_id, subgroup=o.subgroup_id,
                         object=o.object_id, status=o.status, len=len(o.payload),
                         sha256=hashlib.sha256(o.payload).hexdigest())
                elif e.type == "subgroup_end":
                    ends += 1
                    emit(event="subgroup_end")
                elif e.type == "publisher_done":
                    done = e.value
                    emit(event="publisher_done", status=done.status_code,
                         stream_count=done.stream_count)
                else:
                    emit(event=e.type)
                if done is not None and ends >= done.stream_count:
                    break
        emit(event="end")
    except Exception as exc:  # noqa: BLE001
        emit(event="error", error=repr(exc))
    finally:
        sub.close()


asyncio.run(main(*sys.argv[1:4]))
