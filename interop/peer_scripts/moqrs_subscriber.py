"""Run inside the moq-rs venv: a moq-rs client that subscribes to one track and reports every
frame as a JSON line.

Usage: python moqrs_subscriber.py URL BROADCAST TRACK

Events (stdout, one JSON object a line): ``connected``; ``announced`` (the broadcast appeared,
i.e. our server answered moq-rs's SUBSCRIBE_NAMESPACE with a matching NAMESPACE, or sent
PUBLISH_NAMESPACE); ``subscribed`` (SUBSCRIBE_OK received); ``object`` {group, object, len,
sha256}; ``end`` (the track ended: PUBLISH_DONE and every group read); ``error`` {error}.

moq-rs's client offers moq-lite first, then its IETF versions newest first; the server's ALPN
choice decides the version (moq-rs has no API to pin one).

The subscription asks for every group from 0 and tolerates old groups
(``Subscription(max_age_us=..., group_start=0)``): with moq-rs's defaults (max age 0) a
consumer drops a group as soon as a newer one arrives, and reading the dropped group raises
``MoqError.Protocol`` — an API policy of moq-rs, not a wire error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

import moq


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(url: str, broadcast: str, track: str) -> None:
    try:
        async with moq.Client(url, tls_verify=False, reconnect=False,
                              websocket_enabled=False) as client:
            emit(event="connected")
            consumer = await client.announced_broadcast(broadcast).available()
            emit(event="announced", broadcast=broadcast)
            sub = moq.Subscription(max_age_us=60_000_000, group_start=0)
            tc = await consumer.subscribe_track(track, sub)
            emit(event="subscribed", track=track)
            async for group in tc.groups_as_arrived():
                index = 0
                async for frame in group:
                    data = bytes(frame.payload)
                    emit(event="object", group=group.sequence, object=index, len=len(data),
                         sha256=hashlib.sha256(data).hexdigest())
                    index += 1
            emit(event="end")
    except Exception as exc:  # noqa: BLE001 - reported to the harness
        emit(event="error", error=repr(exc))


asyncio.run(main(*sys.argv[1:4]))
