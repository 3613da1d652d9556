"""Run inside the aiomoqt venv (Python >= 3.12): aiomoqt's subscriber (the same client and
``SubscribedTrack`` calls as ``aiomoqt.examples.sub_example``), reporting every object as a
JSON line so the harness can compare payload bytes.

Usage: python aiomoqt_subscriber.py URL NAMESPACE TRACK DRAFT EXPECTED [TIMEOUT]

Events: ``setup`` {draft}; ``subscribed``; ``object`` {group, subgroup, object, status, len,
sha256}; ``end`` {closed: whether the track ended by PUBLISH_DONE before TIMEOUT, objects};
``error``. aiomoqt's track closes on PUBLISH_DONE at once, while objects of the streams that
PUBLISH_DONE counts may still be in flight (aiomoqt keeps receiving them for a grace period):
the script therefore also waits, up to TIMEOUT, until EXPECTED objects arrived.

aiomoqt registers its PUBLISH_DONE handler only after ``subscribe()`` returned; a PUBLISH_DONE
that arrives in the same read as the SUBSCRIBE_OK is missed and the track never closes (seen
against our server when it finished a track right after SUBSCRIBE_OK). The harness therefore
publishes only after the ``subscribed`` event.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from urllib.parse import urlsplit

from aiomoqt.client import MOQTClient
from aiomoqt.track import SubscribedTrack
from aiomoqt.utils import wait_cond_timeout


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(url: str, namespace: str, track_name: str, draft: str, expected: int,
               timeout: float = 20.0) -> None:
    parts = urlsplit(url)
    client = MOQTClient(parts.hostname, parts.port, path=parts.path or "", use_quic=True,
                        verify_tls=False, supported_drafts=[int(draft)])

    count = 0
    got_all = asyncio.Event()

    def on_object(msg: object, *args: object) -> None:
        nonlocal count
        data = bytes(getattr(msg, "payload", b"") or b"")
        group = getattr(msg, "group_id", None)
        if group is None and len(args) > 2:
            group = args[2]
        status = getattr(msg, "status", 0)
        emit(event="object", group=group, subgroup=getattr(msg, "subgroup_id", None),
             object=getattr(msg, "object_id", None), status=int(status or 0), len=len(data),
             sha256=hashlib.sha256(data).hexdigest())
        count += 1
        if count >= expected:
            got_all.set()

    try:
        async with client.connect() as session:
            await session.client_session_init()
            emit(event="setup", draft=int(getattr(session._profile, "draft", 0)))
            track = SubscribedTrack(session, namespace=namespace, trackname=track_name,
                                    on_object=on_object)
            await track.subscribe()
            emit(event="subscribed")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            closed = bool(await wait_cond_timeout(track.wait_closed(), timeout=timeout))
            await wait_cond_timeout(got_all.wait(), timeout=max(0.1, deadline - loop.time()))
            emit(event="end", closed=closed, objects=count)
            session.close()
    except Exception as exc:  # noqa: BLE001 - reported to the harness
        emit(event="error", error=repr(exc))


asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]),
                 *(float(a) for a in sys.argv[6:7])))
