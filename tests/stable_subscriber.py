"""A subscriber in a process of its own, for tests/test_subscribe_stable.py (holds no tests),
so that the test can stall it (SIGSTOP: it acknowledges nothing) and resume it (SIGCONT).

``python tests/stable_subscriber.py URL NAMESPACE TRACK WINDOW MODE``: connects to URL on the
native backend with a stream window of WINDOW octets (the connection's twice that), SUBSCRIBEs
to TRACK of NAMESPACE (its fields in hex, comma-separated) and prints ``subscribed``; then one
JSON line per object, ``{"object": ID, "sha256": HEX}``, and ``done`` once the subscription
ended. It keeps its connection until its stdin closes (a held buffer the publisher releases
meanwhile was released by the stream's end, not by the connection's).

MODE ``all``: every object is taken. ``stop``: the begin of object 1 is answered with a
:class:`~kvsp_moq.pubsub.Refuse` (STOP_SENDING: the publisher's QUIC resets that stream, the
rest of the group is not sent). ``cancel``: the subscription is cancelled (unsubscribe:
RESET_STREAM / STOP_SENDING of the request stream) at the begin of object 1.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from kvsp_moq.moqt.data import ObjectBegin
from kvsp_moq.pubsub import DISCARD, Refuse, Subscription, connect
from kvsp_moq.transport import TransportConfig

GUARD = 60.0


async def main(url: str, namespace: str, track: str, window: int, mode: str) -> None:
    config = TransportConfig(insecure=True, backend="native", max_stream_data=window,
                             max_data=2 * window)
    session = await connect(url, config)
    loop = asyncio.get_running_loop()
    subscription: list[Subscription] = []

    def begin(info: ObjectBegin) -> object:
        if info.object_id < 1 or mode == "all":
            return None  # a bytearray of the library's
        if mode == "stop":
            return Refuse()
        loop.create_task(subscription[0].cancel())  # unsubscribe mid-object
        return DISCARD

    fields = [bytes.fromhex(f) for f in namespace.split(",")]
    sub = await session.subscribe(fields, track, on_object_begin=begin)  # type: ignore[arg-type]
    subscription.append(sub)
    print("subscribed", flush=True)
    async for obj in sub:
        if not obj.discarded:
            print(json.dumps({"object": obj.object_id,
                              "sha256": hashlib.sha256(obj.payload).hexdigest()}), flush=True)
    print("done", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    await asyncio.wait_for(session.close(), GUARD)


if __name__ == "__main__":
    url, namespace, track, window, mode = sys.argv[1:6]
    asyncio.run(main(url, namespace, track, int(window), mode))
