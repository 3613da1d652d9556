"""A SUBSCRIBE of a coded track, transcoded at the relay's edge as the raw objects arrive
(docs/relay.md "Transcoding", docs/binding.md §13).

A consumer asks for codec C of a replica still being computed (prefill→decode) by
SUBSCRIBing to the track named C under the replica's namespace. When the relay's
:class:`~relay.transcode.transcoder.Transcoder` makes that track from another one of the namespace
(its *source*, ``raw``), the SUBSCRIBE is served by a :class:`CodedSubscription`:

1. it is the coded track's upstream subscription in the relay's table (later SUBSCRIBEs of
   the track join it: one per replica and codec), fed not by a SUBSCRIBE upstream but by a
   :class:`~relay.subscribe.fanout.Tap` on the source track's subscription, opened as any SUBSCRIBE
   of it would be (one upstream SUBSCRIBE of ``raw``, shared with the raw subscribers, kept
   open while either has subscribers);
2. SUBSCRIBE_OK waits for the source's (draft-22 §"Subscriber Interactions": "The relay MUST
   have an Established upstream subscription before sending SUBSCRIBE_OK"); the coded
   track's Track Properties are the source's without LAYER_DIGESTS (the coded digests are
   not known before the layers are coded: each object carries its own, item 4), or those the
   cache holds for the coded track when they declare LAYER_DIGESTS (a FETCH coded it whole);
3. each source object, once whole (as the relay cached it: an object over the cache budget
   or not matching its declared layer digest fails the subscription, nothing is coded from
   it), is checked against its LAYER_DIGEST Object Property when it has one and coded on a
   worker thread (``asyncio.to_thread``, as relay/transcode/edge.py does for FETCH) — a layer
   codes independently of the others (docs/container.md "Codecs": each section has its own
   scales) — one object at a time, in the order the source delivered them;
4. the coded object goes to the coded track's subscribers through its own fan-out, with the
   LAYER_DIGEST Object Property the relay computed (SHA-256 of the coded payload), on one
   subgroup stream per source subgroup stream, and is cached under the coded track; once
   every layer the source declares (FIRST_LAYER, LAYER_COUNT) is coded, the coded track's
   cached Track Properties get LAYER_DIGESTS over the coded objects and the range is recorded
   complete, so a later FETCH of the coded track is answered from the cache;
5. the source's end (PUBLISH_DONE, its session lost) is passed on after the objects before
   it, with its status; a failure to code (the transcoder refuses, a source digest mismatch,
   an object not kept) ends the coded subscriptions with PUBLISH_DONE INTERNAL_ERROR, and
   source objects waiting to be coded beyond ``budget`` octets with TOO_FAR_BEHIND (memory
   is bounded: the coder never falls further behind than that).

Objects the source delivered before the coded subscription began are not coded here: a
consumer FETCHes them (the coded track's FETCH, relay/transcode/edge.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.messages import Subscribe
from kvsp_moq.moqt.objects import ObjectBegin, ObjectEnd, ObjectPayload, ObjectStatus, SubgroupHeader
from kvsp_moq.wire.kvp import KeyValuePair, encode_kvps

from ..fetch.cache import CachedObject, TrackName
from ..fetch.digests import BLOCK_GROUP, FIRST_LAYER, LAYER_COUNT, LAYER_DIGESTS, LayerDigests
from ..ops.names import format_namespace
from ..session.peer import PeerSession
from .edge import LAYER_DIGEST
from .transcoder import Properties, Transcoder
from ..subscribe.upstream import UpstreamManager, UpstreamSubscription

__all__ = ["CodedSubscription", "LiveTranscoding"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Object:
    usid: int
    header: SubgroupHeader
    begin: ObjectBegin
    obj: CachedObject | None


@dataclass(slots=True)
class _Closed:
    usid: int
    code: int | None


@dataclass(slots=True)
class _Ended:
    status: int
    reason: str


class _Failed(Exception):
    """A source object that cannot be coded (the reason ends the coded subscriptions)."""


class LiveTranscoding:
    """SUBSCRIBEs of the tracks the transcoder makes (see the module docstring)."""

    def __init__(self, transcoder: Transcoder, upstreams: UpstreamManager,
                 spawn: Callable[[Awaitable[None]], None], budget: int) -> None:
        self.transcoder, self.upstreams, self.spawn, self.budget = transcoder, upstreams, spawn, budget

    def source_of(self, track: TrackName) -> TrackName | None:
        """The track ``track`` is made from here, or None (then it is subscribed as any)."""
        ns, name = track
        source = self.transcoder.source_track(ns, name)
        return None if source is None else (ns, source)

    def subscribe(self, track: TrackName, source: TrackName, route: PeerSession, down: PeerSession,
                  rid: int, msg: Subscribe) -> None:
        """``down``'s SUBSCRIBE ``rid`` of the coded ``track``: join its coded subscription, or
        open one tapping ``source`` (subscribed on ``route`` if nobody subscribes to it yet)."""
        up = self.upstreams.get(track)
        if up is None:
            coded = CodedSubscription(self, track, route, source)
            self.upstreams.tracks[track] = coded
            coded.join(down, rid, msg)
            coded.start()
        else:
            up.join(down, rid, msg)


class CodedSubscription(UpstreamSubscription):
    """The coded track's subscription, fed by a tap on its source track's."""

    def __init__(self, service: LiveTranscoding, track: TrackName, route: PeerSession,
                 source: TrackName) -> None:
        super().__init__(service.upstreams, track, route)
        self.service = service
        self.source = source
        self.source_up: UpstreamSubscription | None = None
        self.source_properties: Properties = ()
        #: Source objects and stream ends not yet passed on, and the octets they hold.
        self.queue: deque[_Object | _Closed | _Ended] = deque()
        self.queued_bytes = 0
        self.working = False
        #: Our fan-out's streams (one per source subgroup stream).
        self.streams: set[int] = set()
        #: Coded layer digests by Object ID (group 0), for LAYER_DIGESTS once all are coded.
        self.coded: dict[int, bytes] = {}
        self.layers: range | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.timer.arm()
        self._log("transcode_subscribe")
        self.source_up = self.manager.tap(self.source, self.peer, self)
        if self.ended:  # told at once (Established) and nobody was left to accept: let go
            self.source_up.untap(self)

    def on_empty(self) -> None:
        """The last coded subscriber left: stop coding, release the source."""
        if not self.ended and not self.pending and self.established:
            self.retire()

    def move_to(self, new: PeerSession) -> None:
        """Nothing to move: the source's subscription moves itself (relay/subscribe/switchover.py)."""

    def retire(self) -> None:
        first = not self.ended
        super().retire()
        if first:
            self.queue.clear()
            self.queued_bytes = 0
            if self.source_up is not None:
                self.source_up.untap(self)

    def _fail(self, status: int, reason: str) -> None:
        ns, name = self.track
        logger.info("relay: transcoding %s %s ended: %s", format_namespace(ns),
                    name.decode("utf-8", "backslashreplace"), reason)
        self.end_all(status, reason)

    # -- the source (relay.subscribe.upstream.SourceTap) -----------------------------------------------
    def source_established(self, properties: Properties, largest: tuple[int, int] | None) -> None:
        if self.ended:
            return
        self.timer.cancel()
        self.established = True
        self.source_properties = tuple(properties)
        values: dict[int, int | bytes] = {}
        for t, v in properties:
            values.setdefault(t, v)
        first, count = values.get(FIRST_LAYER), values.get(LAYER_COUNT)
        if isinstance(first, int) and isinstance(count, int) and count > 0:
            self.layers = range(first, first + count)
        cached = self.manager.cache.track_properties(self.track)
        if cached is not None and LayerDigests.of(cached) is not None:
            self.track_properties = cached  # coded whole before (a FETCH): its digests stand
        else:
            self.track_properties = tuple((t, v) for t, v in properties if t != LAYER_DIGESTS)
        self.manager.cache.set_track_properties(self.track, self.track_properties)
        self.fanout.set_track_properties(self.track_properties)
        self.fanout.largest = largest  # a coded object has its source object's Location
        pending, self.pending = self.pending, []
        for down, rid, msg in pending:
            self._accept(down, rid, msg)
        if not self.fanout.subscribers:
            self.on_empty()

    def source_refused(self, code: int, reason: str) -> None:
        if not self.ended:
            self.retire()
            self._reject_pending(code, reason)

    def source_object(self, usid: int, header: SubgroupHeader, begin: ObjectBegin,
                      obj: CachedObject | None) -> None:
        size = obj.payload_length if obj is not None else 0
        self._put(_Object(usid, header, begin, obj), size)

    def source_stream_closed(self, usid: int, code: int | None) -> None:
        self._put(_Closed(usid, code))

    def source_ended(self, status: int, reason: str) -> None:
        self.source_up = None  # it is over: nothing to untap
        self._put(_Ended(status, reason))

    def _put(self, item: _Object | _Closed | _Ended, size: int = 0) -> None:
        if self.ended:
            return
        if self.queued_bytes + size > self.service.budget:
            self.service.upstreams.stats.too_far_behind += 1
            self._fail(PublishDoneCode.TOO_FAR_BEHIND,
                       f"more than {self.service.budget} octets of source objects wait to be coded")
            return
        self.queue.append(item)
        self.queued_bytes += size
        if not self.working:
            self.working = True
            self.service.spawn(self._work())

    # -- coding, one object at a time, in order ----------------------------------------------
    async def _work(self) -> None:
        try:
            while self.queue and not self.ended:
                item = self.queue.popleft()
                if isinstance(item, _Object):
                    self.queued_bytes -= item.obj.payload_length if item.obj is not None else 0
                    await self._code(item)
                elif isinstance(item, _Closed):
                    if item.usid in self.streams:
                        self.streams.discard(item.usid)
                        self.fanout.on_stream_closed(item.usid, item.code)
                else:
                    self.end_all(item.status, item.reason)
        except _Failed as exc:
            self._fail(PublishDoneCode.INTERNAL_ERROR, str(exc))
        finally:
            self.working = False

    async def _code(self, item: _Object) -> None:
        b, obj = item.begin, item.obj
        loc = (b.group_id, b.object_id)
        if b.status is not ObjectStatus.NORMAL:
            self._send(item, b, b"")  # a status object: no payload to code
            return
        if obj is None:
            raise _Failed(f"source object {loc} was not kept (cache budget, or its layer digest)")
        declared = next((p.value for p in b.properties if p.type == LAYER_DIGEST), None)
        ns, name = self.track
        payload = obj.payload()

        def run() -> tuple[bytes, bytes]:
            if isinstance(declared, bytes) and hashlib.sha256(payload).digest() != declared:
                raise _Failed(f"source object {loc} does not match its LAYER_DIGEST")
            coded = self.service.transcoder.transcode(ns, name, self.source_properties, [payload])
            if len(coded) != 1:
                raise ValueError(f"{len(coded)} coded payloads for one object")
            return coded[0], hashlib.sha256(coded[0]).digest()

        try:
            coded, digest = await asyncio.to_thread(run)
        except _Failed:
            self.manager.stats.digest_mismatches += 1
            raise
        except Exception as exc:  # the transcoder's refusal, or its bug: the subscription ends
            raise _Failed(f"cannot transcode source object {loc}: {exc}") from None
        if self.ended:
            return
        self.manager.stats.transcoded_objects += 1
        self.manager.stats.transcoded_bytes += len(coded)
        props = encode_kvps([(LAYER_DIGEST, digest)])
        self._send(item, ObjectBegin(b.group_id, b.subgroup_id, b.object_id, b.publisher_priority,
                                     b.status, len(coded), (KeyValuePair(LAYER_DIGEST, digest),), props),
                   coded)
        if b.group_id == BLOCK_GROUP:
            self.coded[b.object_id] = digest
            self._maybe_complete()

    def _send(self, item: _Object, begin: ObjectBegin, payload: bytes) -> None:
        """Through our fan-out: to every coded subscriber, and into the cache."""
        if item.usid not in self.streams:
            self.streams.add(item.usid)
            self.fanout.on_data(item.usid, dataclasses.replace(
                item.header, has_properties=item.header.has_properties or bool(begin.raw_properties)))
        self.fanout.on_data(item.usid, begin)
        if payload:
            self.fanout.on_data(item.usid, ObjectPayload(memoryview(payload)))
        self.fanout.on_data(item.usid, ObjectEnd(begin.group_id, begin.object_id))

    def _maybe_complete(self) -> None:
        """Every declared layer coded: LAYER_DIGESTS over the coded objects, range complete."""
        layers = self.layers
        if layers is None or len(self.coded) < len(layers) or any(i not in self.coded for i in layers):
            return
        self.manager.stats.transcodes += 1
        props = tuple(sorted((*self.track_properties,
                              (LAYER_DIGESTS, b"".join(self.coded[i] for i in layers))), key=lambda p: p[0]))
        self.track_properties = props
        self.fanout.set_track_properties(props)
        cache = self.manager.cache
        cache.set_track_properties(self.track, props)
        keys = [(BLOCK_GROUP, i) for i in layers]
        cache.record_range(self.track, keys[0], keys[-1], keys, False)
        ns, name = self.track
        logger.info("relay: transcoded %s %s live from %s: %d objects", format_namespace(ns),
                    name.decode("utf-8", "backslashreplace"),
                    self.source[1].decode("utf-8", "backslashreplace"), len(keys))

