"""Publishing objects: :class:`TrackPublisher` and the :class:`Catalog` sessions serve from.

A track is independent of any one session: every SUBSCRIBE for it, on any session that
shares the catalog, adds an outgoing subscription; :meth:`TrackPublisher.write_object` sends
the object on each (one subgroup stream per group: draft-20 §"Subgroup Header"), and keeps
it in the track's in-memory store when ``keep=True`` so FETCH can serve object ranges.

Large payloads are streamed: :meth:`TrackPublisher.begin_object` sends the object header with
the declared length, then :meth:`ObjectWriter.write` sends chunks as they come, each through
``Connection.write`` (bounded send buffer) — the whole object is never held here. A *stable*
chunk (``stable=True``: bytes that never change, a store's view of a layer; or ``bytes``) is
not copied: it goes to QUIC with ``Connection.send_stable`` and waits in a backlog as the
caller's view, never frozen (docs/transport.md "Sending from the store (no copy)").

A subscriber that stops one subgroup stream (STOP_SENDING, e.g. a receive limit or an
``on_object_begin`` :class:`~.receive.Refuse`) loses only the rest of that stream's
subgroup: the next group goes to it on a new stream. Only the subscription ending
(PUBLISH_DONE, cancellation, the session closing or failing) removes the subscriber.

Subscribers never wait on each other (issue 19): each has a :class:`~.backlog.Backlog`
(bytes go straight to QUIC while its stream's send buffer has room, else wait there, in
order). The writer is paced by the *fastest* subscriber: a write returns once at least one
subscriber of the object has nothing waiting. A subscriber with more than
``subscriber_queue_bytes`` waiting (default 8 MiB) is dropped: its streams are reset with
TOO_FAR_BEHIND (0x5) and it gets PUBLISH_DONE TOO_FAR_BEHIND with its Stream Count
(draft-22 §"Delivery Timeouts", §"Stream Reset Error Codes").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..moqt.data import SubgroupStreamEncoder, encode_datagram
from ..moqt.errors import PublishDoneCode, StreamResetCode
from ..moqt.objects import ObjectDatagram, SubgroupHeader, SubgroupIdMode
from ..transport import StreamClosedError, TransportError
from ..wire.buffer import Buffer
from ..wire.kvp import encode_kvps
from .backlog import DEFAULT_SUBSCRIBER_QUEUE_BYTES, Backlog, Chunk
from .errors import DatagramTooLargeError
from .ports import DataPlane
from .window import Window

__all__ = ["Catalog", "ObjectWriter", "StoredObject", "TrackPublisher", "normalize_namespace"]

Namespace = tuple[bytes, ...]
PropertyList = Sequence[tuple[int, int | bytes]]


def normalize_namespace(ns: Sequence[str | bytes] | str | bytes) -> Namespace:
    if isinstance(ns, str | bytes):
        ns = (ns,)
    return tuple(f.encode() if isinstance(f, str) else bytes(f) for f in ns)


def track_name(name: str | bytes) -> bytes:
    return name.encode() if isinstance(name, str) else bytes(name)


@dataclass(eq=False)
class Outgoing:
    """One subscriber of a track on one session."""

    session: DataPlane
    request_id: int
    track_alias: int
    #: The group of the open subgroup stream; kept with ``stream_id`` None once the
    #: subscriber stopped that stream (the rest of the group is not sent to it).
    group: int | None = None
    stream_id: int | None = None
    encoder: SubgroupStreamEncoder | None = None
    streams_opened: int = 0
    dead: bool = False
    #: The objects this subscription asked for (its LOCATION_FILTER).
    window: Window = field(default_factory=Window)
    #: Forward State (§"FORWARD"): False sends no objects until an update sets it again.
    forward: bool = True
    #: SUBSCRIBER_PRIORITY of the request (kept; objects go out as they are written).
    subscriber_priority: int = 128
    #: What waits to be handed to QUIC for this subscriber (set by the track).
    backlog: Backlog | None = None


@dataclass
class _Stored:
    """One object a FETCH can serve. ``payload`` is the buffer, or a zero-argument callable
    that returns it when the FETCH reaches this object (a track that serves objects from
    elsewhere, e.g. a block store, reads each payload only when it sends it)."""

    payload: Buffer | Callable[[], Buffer]
    properties: tuple[tuple[int, int | bytes], ...]
    priority: int
    #: Published as an OBJECT_DATAGRAM (Forwarding Preference Datagram): a FETCH carries
    #: it with the datagram flag instead of a Subgroup ID (§"Fetch Header").
    datagram: bool = False
    #: The payload's bytes never change (a view of a store that never rewrites what it
    #: handed out): the transport may send from them without a copy (``send_stable``).
    stable: bool = False


#: Public name of a FETCH-servable object (for :meth:`TrackPublisher.objects_in` overrides).
StoredObject = _Stored


class TrackPublisher:
    """A track we publish: write objects, they reach every subscriber.

    Extension points for tracks whose objects live elsewhere (docs/pubsub.md "Serving from
    your own store"): override :meth:`objects_in` (FETCH), :meth:`response_properties` (the
    Track Properties of SUBSCRIBE_OK, FETCH_OK and TRACK_STATUS's REQUEST_OK), and set
    :attr:`subscribe_after_finish` to accept SUBSCRIBE on a finished track.
    """

    #: Accept a SUBSCRIBE after :meth:`finish`: SUBSCRIBE_OK (with LARGEST_OBJECT), then at
    #: once PUBLISH_DONE TRACK_ENDED with Stream Count 0; the subscriber FETCHes the past
    #: objects. False (the default): such a SUBSCRIBE gets REQUEST_ERROR DOES_NOT_EXIST.
    subscribe_after_finish: bool = False

    def __init__(self, namespace: Sequence[str | bytes] | str | bytes, name: str | bytes, *,
                 keep: bool = True, priority: int = 128,
                 subscriber_queue_bytes: int = DEFAULT_SUBSCRIBER_QUEUE_BYTES) -> None:
        if subscriber_queue_bytes <= 0:
            raise ValueError("subscriber_queue_bytes must be > 0")
        self.namespace = normalize_namespace(namespace)
        self.name = track_name(name)
        self.keep = keep
        self.priority = priority
        #: Bytes one subscriber may have waiting here (beyond its stream's QUIC send
        #: buffer) before it is dropped with TOO_FAR_BEHIND (see the module docstring).
        self.subscriber_queue_bytes = subscriber_queue_bytes
        #: Subscribers dropped for being too far behind.
        self.too_far_behind = 0
        self.store: dict[tuple[int, int], _Stored] = {}
        self.largest: tuple[int, int] | None = None
        self._subs: list[Outgoing] = []
        self._lock = asyncio.Lock()
        self.finished = False
        #: Set whenever a subscriber is added (tests and apps may await a subscriber).
        self.subscribed = asyncio.Event()
        #: Set whenever a subscriber goes away (cancelled, stopped, session closed).
        self.unsubscribed = asyncio.Event()
        #: Set while at least one live subscriber has Forward State 1 (§"FORWARD"), cleared
        #: while none has: an update that pauses the last forwarding subscriber (FORWARD=0),
        #: or its going away, clears it; a forwarding subscriber added, or an update raising
        #: a paused one, sets it. Objects written while it is clear reach nobody and are
        #: never sent later (e.g. a relay that pauses our PUBLISH with FORWARD=0 until a
        #: subscriber of its own forwards).
        self.forwarding = asyncio.Event()
        #: Track Properties sent in SUBSCRIBE_OK / FETCH_OK / TRACK_STATUS (see
        #: :meth:`response_properties`); types non-decreasing, even types int, odd bytes.
        self.track_properties: tuple[tuple[int, int | bytes], ...] = ()

    def response_properties(self) -> tuple[tuple[int, int | bytes], ...]:
        """The Track Properties of a response sent now (default :attr:`track_properties`)."""
        return self.track_properties

    @property
    def subscriber_count(self) -> int:
        return sum(1 for s in self._subs if not s.dead)

    def subscriptions(self) -> list[Outgoing]:
        """The live subscriptions (each with its :attr:`Outgoing.backlog`)."""
        return [s for s in self._subs if not s.dead]

    # -- subscribers (called by the session's catalog server) ---------------------------------------------------
    def add_subscriber(self, out: Outgoing) -> None:
        session = out.session
        b = out.backlog = Backlog(lambda: session.connection, session.spawn,
                                  self.subscriber_queue_bytes, session)
        b.on_overflow = lambda: self._too_far_behind(out)
        b.on_stopped = lambda sid: self._stream_stopped(out) if out.stream_id == sid else None
        b.on_gone = lambda: self._subscriber_gone(out)
        self._subs.append(out)
        self.subscribed.set()
        self.forward_changed()

    def forward_changed(self) -> None:
        """Bring :attr:`forwarding` in line with the subscribers' Forward States (call after
        adding or removing one, or after an update changed one)."""
        if any(s.forward and not s.dead for s in self._subs):
            self.forwarding.set()
        else:
            self.forwarding.clear()

    def outgoing(self, session: DataPlane, request_id: int) -> Outgoing | None:
        """The live subscription ``request_id`` of ``session`` (None if gone)."""
        for s in self._subs:
            if s.session is session and s.request_id == request_id and not s.dead:
                return s
        return None

    def remove_subscriber(self, session: DataPlane, request_id: int) -> None:
        for s in self._subs:
            if s.session is session and s.request_id == request_id:
                s.dead = True
                if s.backlog is not None:
                    s.backlog.close()
                self.unsubscribed.set()
        self._subs = [s for s in self._subs if not s.dead]
        self.forward_changed()

    def stream_stopped(self, session: DataPlane, request_id: int, stream_id: int) -> None:
        """The subscriber stopped data stream ``stream_id`` of its subscription
        ``request_id`` (STOP_SENDING): that stream ends, the rest of its group is not sent
        to it; later groups are, on new streams. The subscription stays."""
        for s in self._subs:
            if s.session is session and s.request_id == request_id \
                    and s.stream_id == stream_id:
                self._stream_stopped(s)

    @staticmethod
    def _stream_stopped(sub: Outgoing) -> None:
        sid = sub.stream_id
        if sid is None:
            return
        sub.stream_id, sub.encoder = None, None  # sub.group kept: skip the rest of it
        if sub.backlog is not None:
            sub.backlog.drop_stream(sid)
        sub.session.data_stream_done(sid)

    def _subscriber_gone(self, sub: Outgoing) -> None:
        """The subscriber's connection is gone (its session removes it too)."""
        sub.dead = True
        self._subs = [s for s in self._subs if s is not sub]
        self.forward_changed()

    def _too_far_behind(self, sub: Outgoing) -> None:
        """More than ``subscriber_queue_bytes`` wait for ``sub``: reset its streams with
        TOO_FAR_BEHIND and end the subscription with PUBLISH_DONE TOO_FAR_BEHIND and its
        Stream Count (draft-22 §"Delivery Timeouts"); the others are not affected."""
        if sub.dead:
            return
        backlog = sub.backlog
        sids = backlog.streams() if backlog is not None else set()
        queued = backlog.queued if backlog is not None else 0
        if sub.stream_id is not None:
            sids.add(sub.stream_id)
        if backlog is not None:
            backlog.close()
        sub.dead = True
        sub.stream_id, sub.encoder, sub.group = None, None, None
        for sid in sorted(sids):
            try:
                sub.session.connection.reset_stream(sid, StreamResetCode.TOO_FAR_BEHIND)
            except TransportError:
                pass
            sub.session.data_stream_done(sid)
        sub.session.publish_done(sub.request_id, PublishDoneCode.TOO_FAR_BEHIND,
                                 sub.streams_opened,
                                 f"subscriber queue exceeded {self.subscriber_queue_bytes} bytes "
                                 f"({queued} queued)")
        self.too_far_behind += 1
        self._subs = [s for s in self._subs if s is not sub]
        self.unsubscribed.set()
        self.forward_changed()

    # -- writing ---------------------------------------------------------------------------
    async def write_object(self, group: int, object_id: int, payload: Buffer, *,
                           properties: PropertyList = (), priority: int | None = None,
                           stable: bool = False) -> None:
        """Publish one whole object. ``stable``: as :meth:`ObjectWriter.write`'s."""
        w = await self.begin_object(group, object_id, len(payload), properties=properties,
                                    priority=priority)
        await w.write(payload, stable=stable)
        await w.close()

    async def begin_object(self, group: int, object_id: int, length: int, *,
                           properties: PropertyList = (),
                           priority: int | None = None) -> ObjectWriter:
        """Start an object of ``length`` payload bytes; send them with
        :meth:`ObjectWriter.write` and finish with :meth:`ObjectWriter.close`."""
        if self.finished:
            raise RuntimeError("track finished")
        # Properties that cannot be encoded fail here, for every later subscriber and FETCH
        # alike (even types carry integers, odd types bytes; non-decreasing types).
        encode_kvps(properties)
        await self._lock.acquire()
        try:
            prio = self.priority if priority is None else priority
            props = tuple(properties)
            targets: list[Outgoing] = []
            for sub in list(self._subs):
                if sub.dead or not sub.forward:
                    continue
                if sub.window.passed(group, object_id):
                    self._complete(sub)  # its range is delivered: PUBLISH_DONE
                    continue
                if not sub.window.admits(group, object_id):
                    continue  # MUST NOT send objects outside the requested range
                if sub.group == group and sub.stream_id is None:
                    continue  # the subscriber stopped this group's stream
                try:
                    self._object_header(sub, group, object_id, length, props, prio)
                    if not sub.dead:
                        targets.append(sub)
                except StreamClosedError:  # stopped by the subscriber: this stream only
                    self._stream_stopped(sub)
                except (TransportError, KeyError):  # the session (or request) is gone
                    sub.dead = True
            return ObjectWriter(self, group, object_id, length, props, prio, targets)
        except BaseException:
            self._lock.release()
            raise

    def _object_header(self, sub: Outgoing, group: int, object_id: int, length: int,
                       props: tuple[tuple[int, int | bytes], ...], prio: int) -> None:
        if sub.group != group:
            self._end_stream(sub)
            header = SubgroupHeader(sub.track_alias, group, 0, prio, SubgroupIdMode.ZERO,
                                    has_properties=True)
            sub.stream_id = sub.session.open_subgroup(sub.request_id, header)
            sub.encoder = SubgroupStreamEncoder(header, sub.session.version)
            sub.group = group
            sub.streams_opened += 1
        assert sub.encoder is not None and sub.stream_id is not None
        data = sub.encoder.object_header(object_id, length, properties=props)
        assert sub.backlog is not None
        sub.backlog.send(sub.stream_id, data)

    def _end_stream(self, sub: Outgoing) -> None:
        """FIN the subscriber's stream (after what waits for it), then tell the session."""
        if sub.stream_id is None:
            return
        sid, sub.stream_id, sub.encoder, sub.group = sub.stream_id, None, None, None
        backlog = sub.backlog
        try:
            if backlog is None:
                sub.session.connection.send(sid, b"", end_stream=True)
            else:
                backlog.send(sid, b"", fin=True)
        except TransportError:
            pass
        if backlog is None:
            sub.session.data_stream_done(sid)
        else:
            backlog.after(sid, lambda: sub.session.data_stream_done(sid))

    @staticmethod
    def _publish_done(sub: Outgoing, status: int, reason: str) -> None:
        """PUBLISH_DONE once the subscriber's data streams are closed (its FINs handed to
        QUIC: §"PUBLISH_DONE")."""
        def done() -> None:
            sub.session.publish_done(sub.request_id, status, sub.streams_opened, reason)
        if sub.backlog is None:
            done()
        else:
            sub.backlog.after(-1, done)

    async def write_datagram(self, group: int, object_id: int, payload: Buffer, *,
                             properties: PropertyList = (), priority: int | None = None,
                             end_of_group: bool = False) -> None:
        """Publish one object as an OBJECT_DATAGRAM (Forwarding Preference Datagram,
        draft-22 §"Object Datagram") to every subscriber whose Forward State is 1 and whose
        window admits it; kept for FETCH like any object (``keep=True``).

        Raises :class:`~kvsp_moq.pubsub.errors.DatagramTooLargeError`, sending nothing, when
        the encoded datagram exceeds any subscriber session's maximum datagram payload
        (the peer's ``max_datagram_frame_size``, the path MTU): the draft would have it
        "dropped without any explicit notification" (§"Datagrams"). Datagrams are
        unreliable: a subscriber may not get it."""
        if self.finished:
            raise RuntimeError("track finished")
        encode_kvps(properties)  # fail early on properties that cannot be encoded
        prio = self.priority if priority is None else priority
        props = tuple(properties)
        async with self._lock:
            out: list[tuple[Outgoing, bytes]] = []
            for sub in list(self._subs):
                if sub.dead or not sub.forward:
                    continue
                if sub.window.passed(group, object_id):
                    self._complete(sub)
                    continue
                if not sub.window.admits(group, object_id):
                    continue
                version = sub.session.version
                data = encode_datagram(ObjectDatagram(
                    sub.track_alias, group, object_id, prio, payload=memoryview(payload),
                    end_of_group=end_of_group,
                    raw_properties=encode_kvps(props, seven_byte=version.vi64_seven_byte)
                    if props else b""), version)
                limit = sub.session.max_datagram_size
                if len(data) > limit:
                    raise DatagramTooLargeError(len(data), limit)
                out.append((sub, data))
            for sub, data in out:
                sub.session.send_datagram(data)
            if self.keep:
                self.store[(group, object_id)] = _Stored(bytes(payload), props, prio,
                                                         datagram=True)
            if self.largest is None or (group, object_id) > self.largest:
                self.largest = (group, object_id)
            for sub, _data in out:  # a range ending at this very object is complete now
                w = sub.window
                if w.end_object is not None and (group, object_id) == (w.end_group, w.end_object):
                    self._complete(sub)

    async def end_group(self) -> None:
        """FIN the current group's streams (the next object opens a new one)."""
        async with self._lock:
            for sub in self._subs:
                self._end_stream(sub)

    def _complete(self, sub: Outgoing, status: int = PublishDoneCode.SUBSCRIPTION_ENDED,
                  reason: str = "range delivered") -> None:
        """End one subscription (by default: its range is complete): FIN its stream, then
        PUBLISH_DONE with its Stream Count. Called with the track's lock held."""
        self._end_stream(sub)
        self._publish_done(sub, status, reason)
        sub.dead = True
        self._subs = [s for s in self._subs if s is not sub]
        self.forward_changed()

    def complete_soon(self, sub: Outgoing, status: int = PublishDoneCode.SUBSCRIPTION_ENDED,
                       reason: str = "range delivered") -> None:
        """:meth:`_complete` once no object is being written (never FIN mid-object)."""
        if not self._lock.locked():
            self._complete(sub, status, reason)
            return

        async def later() -> None:
            async with self._lock:
                if not sub.dead:
                    self._complete(sub, status, reason)

        sub.session.spawn(later())

    async def finish(self, status: int = PublishDoneCode.TRACK_ENDED, reason: str = "") -> None:
        """End the track: close every data stream, then PUBLISH_DONE with the Stream Count
        (§"PUBLISH_DONE": sent only after all data streams are closed)."""
        async with self._lock:
            self.finished = True
            for sub in self._subs:
                self._end_stream(sub)
                self._publish_done(sub, status, reason)
            self._subs.clear()
            self.forward_changed()

    def _stored(self, group: int, object_id: int, payload: bytes | bytearray,
                props: tuple[tuple[int, int | bytes], ...], prio: int) -> None:
        self.store[(group, object_id)] = _Stored(payload, props, prio)
        if self.largest is None or (group, object_id) > self.largest:
            self.largest = (group, object_id)

    def objects_in(self, start: tuple[int, int],
                   end: tuple[int, int | None] | None) -> list[tuple[tuple[int, int], _Stored]]:
        """Stored objects from ``start`` to ``end`` inclusive (end object None: whole
        group; end None: to the largest), ascending. Override to serve FETCH from another
        store (payloads may be callables, read when sent)."""
        out = []
        for loc in sorted(self.store):
            if loc < tuple(start):
                continue
            if end is not None:
                eg, eo = end
                if loc[0] > eg or (eo is not None and loc[0] == eg and loc[1] > eo):
                    continue
            out.append((loc, self.store[loc]))
        return out


class ObjectWriter:
    """Sends the payload of one object in chunks to every subscriber of its track."""

    def __init__(self, track: TrackPublisher, group: int, object_id: int, length: int,
                 props: tuple[tuple[int, int | bytes], ...], prio: int,
                 targets: list[Outgoing]) -> None:
        self.track = track
        self.group, self.object_id, self.length = group, object_id, length
        self._props, self._prio = props, prio
        self._targets = targets
        self.written = 0
        self._keep = bytearray() if track.keep else None
        self._closed = False

    async def write(self, chunk: Buffer, *, stable: bool = False) -> None:
        """Send the next ``chunk`` of the payload to every subscriber of the object; returns
        once one of them has nothing waiting (the module docstring). ``stable``: the bytes
        never change while a transport may still send them (a view of a store that never
        rewrites what it handed out, as ``StoredObject.stable``): they are neither copied nor
        frozen here, and go to QUIC with ``Connection.send_stable`` (the native backend holds
        them until acknowledged); ``bytes`` are stable anyway. Otherwise the caller may
        reuse its buffer once this returns."""
        n = len(chunk)
        if self.written + n > self.length:
            raise ValueError("more payload than the declared length")
        self.written += n
        if self._keep is not None:
            self._keep += chunk
        shared = Chunk(chunk, stable)
        for sub in self._targets:
            if sub.dead or sub.stream_id is None:
                continue
            assert sub.backlog is not None
            try:
                sub.backlog.send(sub.stream_id, shared)
            except StreamClosedError:  # stopped by the subscriber: this stream only
                self.track._stream_stopped(sub)
            except TransportError:  # the session is gone
                sub.dead = True
        await self._pace()

    async def _pace(self) -> None:
        """Wait while every subscriber still receiving this object has bytes waiting: the
        writer goes at the pace of the fastest one; the others queue (up to their bound)."""
        while True:
            live = [s.backlog for s in self._targets
                    if not s.dead and s.stream_id is not None and s.backlog is not None]
            if not live or not all(b.blocked for b in live):
                return
            waits = [asyncio.ensure_future(b.empty.wait()) for b in live]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.written != self.length:
                for sub in self._targets:  # a truncated object cannot be sent: reset
                    if sub.stream_id is not None and not sub.dead:
                        if sub.backlog is not None:
                            sub.backlog.drop_stream(sub.stream_id)
                        sub.session.connection.reset_stream(sub.stream_id,
                                                            StreamResetCode.INTERNAL_ERROR)
                        sub.session.data_stream_done(sub.stream_id)
                        sub.stream_id, sub.group = None, None
                raise ValueError(f"object closed after {self.written} of {self.length} bytes")
            if self._keep is not None:
                self.track._stored(self.group, self.object_id, self._keep,  # owned: no copy
                                   self._props, self._prio)
            elif self.track.largest is None or (self.group, self.object_id) > self.track.largest:
                self.track.largest = (self.group, self.object_id)
            for sub in self._targets:  # a range ending at this very object is complete now
                w = sub.window
                if not sub.dead and w.end_object is not None and \
                        (self.group, self.object_id) == (w.end_group, w.end_object):
                    self.track._complete(sub)
        finally:
            self.track._lock.release()

    async def __aenter__(self) -> ObjectWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass
class Catalog:
    """Tracks served by sessions, by full track name; share one among sessions."""

    tracks: dict[tuple[Namespace, bytes], TrackPublisher] = field(default_factory=dict)
    #: Bumped by :meth:`add` / :meth:`remove`; :meth:`sorted_namespaces` is cached per value.
    version: int = 0
    _sorted: tuple[int, tuple[Namespace, ...]] | None = field(default=None, repr=False)
    #: Tracks per namespace, and who hears a namespace appear (True) or go (False): the
    #: sessions answering a SUBSCRIBE_NAMESPACE (draft-22 §"SUBSCRIBE_NAMESPACE": "When there
    #: are changes to the namespaces being published ... the publisher sends the
    #: corresponding NAMESPACE or NAMESPACE_DONE messages").
    _counts: dict[Namespace, int] = field(default_factory=dict, repr=False)
    _watchers: list[Callable[[Namespace, bool], None]] = field(default_factory=list, repr=False)

    def add(self, track: TrackPublisher) -> TrackPublisher:
        key = (track.namespace, track.name)
        replaced = key in self.tracks
        self.tracks[key] = track
        self.version += 1
        if not replaced:
            n = self._counts.get(track.namespace, 0)
            self._counts[track.namespace] = n + 1
            if n == 0:
                self._changed(track.namespace, True)
        return track

    def create(self, namespace: Sequence[str | bytes] | str | bytes, name: str | bytes,
               **kw: object) -> TrackPublisher:
        return self.add(TrackPublisher(namespace, name, **kw))  # type: ignore[arg-type]

    def get(self, namespace: Namespace, name: bytes) -> TrackPublisher | None:
        return self.tracks.get((tuple(namespace), bytes(name)))

    def remove(self, namespace: Sequence[str | bytes] | str | bytes,
               name: str | bytes) -> TrackPublisher | None:
        """Stop serving a track (new requests for it get DOES_NOT_EXIST); returns it."""
        ns = normalize_namespace(namespace)
        track = self.tracks.pop((ns, name.encode() if isinstance(name, str) else bytes(name)),
                                None)
        self.version += 1
        if track is not None:
            n = self._counts.get(ns, 0) - 1
            if n > 0:
                self._counts[ns] = n
            else:
                self._counts.pop(ns, None)
                self._changed(ns, False)
        return track

    def has_namespace(self, namespace: Namespace) -> bool:
        return namespace in self._counts

    def watch(self, fn: Callable[[Namespace, bool], None]) -> None:
        """Call ``fn(namespace, present)`` when a namespace gets its first track or loses
        its last one."""
        self._watchers.append(fn)

    def unwatch(self, fn: Callable[[Namespace, bool], None]) -> None:
        if fn in self._watchers:
            self._watchers.remove(fn)

    def _changed(self, ns: Namespace, present: bool) -> None:
        for fn in list(self._watchers):
            fn(ns, present)

    def namespaces(self) -> set[Namespace]:
        return set(self._counts)

    def sorted_namespaces(self) -> tuple[Namespace, ...]:
        """The namespaces in ascending order: one immutable tuple per catalog version,
        shared by every reader (the namespaces under a prefix are one contiguous run)."""
        cached = self._sorted
        if cached is None or cached[0] != self.version:
            cached = self._sorted = (self.version, tuple(sorted(self.namespaces())))
        return cached[1]
