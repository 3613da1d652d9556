"""Object datagrams through the relay (draft-22 §"Datagrams", §"Object Datagram").

An OBJECT_DATAGRAM of an upstream subscription (or of a PUBLISHed track) is one whole object
with Forwarding Preference Datagram. The relay:

* caches it like any object (§"Caching Relays": every field, so a FETCH of it carries the
  datagram flag instead of a Subgroup ID, §"Fetch Header"), unless it does not match the
  layer digest its track declares (:mod:`relay.fetch.digests`);
* sends it to every subscriber whose Forward State is 1 and whose LOCATION_FILTER window
  admits it (past the window: PUBLISH_DONE SUBSCRIPTION_ENDED, as for stream objects),
  re-encoded with that subscriber's Track Alias; every other field — Group and Object ID,
  publisher priority (or the DEFAULT_PRIORITY flag), END_OF_GROUP, Object Status and the
  Object Properties' raw wire bytes — is kept (§"Relay Object Handling": "A relay MUST NOT
  modify Object fields when forwarding");
* drops it for a session whose maximum datagram payload it exceeds ("When the total size is
  larger than the maximum datagram size for the session, the Object will be dropped without
  any explicit notification"; counted in ``datagrams_dropped``).

Priorities: a datagram is handed to QUIC at once, not queued in the session's scheduler
(:mod:`relay.session.sender`): the draft asks implementations to "minimize datagram queueing", and
QUIC sends DATAGRAM frames ahead of stream data, so subscriber and publisher priorities
cannot rank a datagram against the session's streams. Targets are served in subscription
priority order (subscriber priority, then arrival).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from kvsp_moq.moqt.data import encode_datagram
from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.objects import ObjectDatagram
from kvsp_moq.transport import TransportError

from ..fetch.cache import CachedObject
from ..fetch.digests import admit

if TYPE_CHECKING:  # pragma: no cover
    from .fanout import Fanout

__all__ = ["forward_datagram"]


def forward_datagram(fanout: Fanout, dg: ObjectDatagram) -> None:
    """Cache ``dg`` and send it to the fan-out's subscribers (see the module docstring)."""
    # A read-only view of received bytes is immutable: kept as it is (no copy).
    payload = dg.payload
    if not isinstance(payload, bytes) and not payload.readonly:
        payload = bytes(payload)
    n = len(payload)
    stats = fanout.stats
    stats.objects_in += 1
    stats.bytes_in += n
    loc = (dg.group_id, dg.object_id)
    if fanout.largest is None or loc > fanout.largest:
        fanout.largest = loc
    prio = fanout.default_priority if dg.publisher_priority is None else dg.publisher_priority
    props = fanout.track_properties or None
    # Cached only if it matches its layer digest, when its track declares one (relay.fetch.digests).
    check = fanout.digests.check(dg.group_id, dg.object_id, dg.status, (payload,)) \
        if fanout.digests is not None else None
    if admit(check, stats, fanout.track, loc):
        fanout.cache.put(fanout.track, CachedObject(
            dg.group_id, dg.object_id, None, prio, dg.status, bytes(dg.raw_properties),
            (payload if isinstance(payload, memoryview) else memoryview(payload),), n,
            fanout.cache.expiry_for(fanout.track, time.monotonic(), props)), props,
            replace=check is not None)
    out = dataclasses.replace(dg, payload=payload)
    targets = sorted((s for s in fanout.subscribers if not s.ended and s.forward),
                     key=lambda s: s.priority)
    for sub in targets:
        if sub.window.passed(*loc):
            sub.end(PublishDoneCode.SUBSCRIPTION_ENDED, "range delivered")
            continue
        if not sub.window.admits(*loc):
            continue
        peer = sub.peer
        if not peer.is_open:
            continue
        data = encode_datagram(dataclasses.replace(out, track_alias=sub.alias), peer.version)
        if len(data) > peer.connection.max_datagram_payload:
            stats.datagrams_dropped += 1
            continue
        try:
            peer.connection.send_datagram(data)
        except (TransportError, ValueError):
            stats.datagrams_dropped += 1
            continue
        stats.objects_out += 1
        stats.bytes_out += n
        w = sub.window
        if w.end_object is not None and loc == (w.end_group, w.end_object):
            sub.end(PublishDoneCode.SUBSCRIPTION_ENDED, "range delivered")
