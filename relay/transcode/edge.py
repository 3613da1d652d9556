"""Transcoding at the relay's edge (docs/relay.md "Transcoding", docs/binding.md §13).

Binding v1 names a replica's codec by its track name, and "another codec of the same replica
is another track under the same namespace". A consumer asks for a codec by FETCHing that
track (e.g. ``fp8-e4m3``) under the replica's namespace. When the relay has a
:class:`Transcoder` (``RelayConfig.transcoder``) that makes that track from another one of the
same namespace (its *source*, ``raw``), a FETCH of it that the cache cannot answer is served
by transcoding, **once per replica and codec** (single flight: every FETCH of the coded track
that arrives meanwhile waits on the same job):

1. group 0 of the source track — all of it, whatever range the FETCH asked for — is read
   through the relay itself: from the cache, or by one upstream FETCH (``FetchService``'s
   single flight, so it is cached for later raw consumers too);
2. every source object is checked against the source's LAYER_DIGESTS when the track declares
   them (a mismatch fails the job: nothing is coded from a corrupted layer);
3. the transcoder codes the payloads on a worker thread (``asyncio.to_thread``);
4. the coded objects go into the cache under the coded track, each with its own layer digest
   as the LAYER_DIGEST Object Property, and the track's properties are the source's with
   LAYER_DIGESTS replaced by the **digests the relay computed over the coded objects**
   (SHA-256 of each coded payload); the range is recorded complete;
5. every waiting FETCH is answered from the cache (later ones are plain cache hits).

What a consumer can check: each coded object against the LAYER_DIGESTS of the coded track's
FETCH_OK (and its LAYER_DIGEST property): that proves the bytes are what this relay coded,
not that the relay coded them faithfully, as for ``Repr-Digest`` over HTTP (kvsp-draft §6.7:
"Transcoded representations are protected only by Repr-Digest"); a consumer that needs the
producer's integrity FETCHes the ``raw`` track and checks it against the Replica Record.

The relay stays content-agnostic: it never parses a payload; the transcoder is passed in (the
KVSP one is ``kvsp_moq.bridge.transcoding``). Every wait is bounded by ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvsp_moq.moqt.errors import RequestErrorCode
from kvsp_moq.moqt.objects import ObjectStatus
from kvsp_moq.wire.kvp import encode_kvps

from ..fetch.cache import CachedObject, ObjectCache, TrackName
from ..fetch.digests import BLOCK_GROUP, LAYER_DIGESTS, LayerDigests
from ..fetch.service import FetchService
from ..fetch.inflight import WHOLE_GROUP, FetchRange, FetchSink, UpstreamFetch
from ..ops.names import format_namespace
from ..session.peer import PeerSession
from ..ops.stats import RelayStats
from .transcoder import Properties, Transcoder

__all__ = ["LAYER_DIGEST", "EdgeTranscoding", "Transcoder"]

logger = logging.getLogger(__name__)

#: Binding v1 §3.1 Object Property: the object's layer digest (pinned to the binding's by
#: tests/test_relay_transcode.py; the relay may not import the bridge).
LAYER_DIGEST = 0x3801



@dataclass(eq=False)
class _Job:
    """One transcoding in flight: the coded track, the FETCHes waiting on it."""

    track: TrackName
    source: TrackName
    waiters: list[tuple[PeerSession, int, FetchRange]] = field(default_factory=list)
    done: bool = False
    timer: asyncio.TimerHandle | None = None


class _SourceSink(FetchSink):
    """Collects the source range from the relay's upstream FETCH (whole, at its end)."""

    def __init__(self, edge: EdgeTranscoding, job: _Job) -> None:
        self.edge, self.job = edge, job
        self.properties: Properties = ()

    def start(self, up: UpstreamFetch) -> bool:
        self.properties = tuple(up.properties)
        return False  # wait for deliver: the job needs every object

    def deliver(self, objects: list[CachedObject], end_of_track: bool) -> None:
        props = self.properties or self.edge.cache.track_properties(self.job.source) or ()
        self.edge.got_source(self.job, objects, props, end_of_track)

    def fail(self, code: int, reason: str, retry_interval: int = 0) -> None:
        self.edge.fail(self.job, code, f"source track: {reason}")


class EdgeTranscoding:
    """FETCHes of tracks the transcoder makes (see the module docstring)."""

    def __init__(self, transcoder: Transcoder, fetches: FetchService, cache: ObjectCache, stats: RelayStats,
                 spawn: Callable[[Awaitable[None]], None],
                 route_then: Callable[[PeerSession, int, tuple[bytes, ...], Callable[[PeerSession], None]], None],
                 reject: Callable[[PeerSession, int, int, str], None], timeout: float) -> None:
        self.transcoder, self.fetches, self.cache, self.stats = transcoder, fetches, cache, stats
        self.spawn, self.route_then, self.reject, self.timeout = spawn, route_then, reject, timeout
        self.jobs: dict[TrackName, _Job] = {}

    def fetch(self, peer: PeerSession, rid: int, rng: FetchRange) -> bool:
        """Take a FETCH the cache missed if its track is one the transcoder makes; False
        for any other track."""
        ns, name = rng.track
        source = self.transcoder.source_track(ns, name)
        if source is None:
            return False
        job = self.jobs.get(rng.track)
        if job is not None:
            job.waiters.append((peer, rid, rng))
            return True
        job = _Job(rng.track, (ns, source), [(peer, rid, rng)])
        self.jobs[rng.track] = job
        job.timer = asyncio.get_running_loop().call_later(
            self.timeout, self.fail, job, RequestErrorCode.TIMEOUT, f"no source within {self.timeout} s")
        whole = FetchRange(job.source, (BLOCK_GROUP, 0), (BLOCK_GROUP, WHOLE_GROUP))
        hit = self.cache.lookup_range(job.source, whole.start, whole.end)
        if hit is not None:
            self.stats.cache_hits += 1
            self.got_source(job, hit.objects, self.cache.track_properties(job.source) or (), hit.end_of_track)
            return True
        self.route_then(peer, rid, ns, lambda route: self.fetches.wait_upstream(_SourceSink(self, job), whole, route))
        return True

    def got_source(self, job: _Job, objects: list[CachedObject], properties: Properties,
                   end_of_track: bool) -> None:
        if job.done:
            return
        normal = [o for o in objects if o.status is ObjectStatus.NORMAL and o.group_id == BLOCK_GROUP]
        if not normal:
            self.fail(job, RequestErrorCode.DOES_NOT_EXIST, "the source track has no objects")
            return
        digests = LayerDigests.of(properties)
        payloads = [o.payload() for o in normal]
        if digests is not None:
            for o, payload in zip(normal, payloads):
                want = digests.expected(o.group_id, o.object_id)
                self.stats.digest_checks += 1
                if want is not None and hashlib.sha256(payload).digest() != want:
                    self.stats.digest_mismatches += 1
                    self.fail(job, RequestErrorCode.INTERNAL_ERROR,
                              f"source object {o.object_id} does not match its layer digest")
                    return
        self.spawn(self._code(job, normal, payloads, properties, end_of_track))

    async def _code(self, job: _Job, normal: list[CachedObject], payloads: list[bytes],
                    properties: Properties, end_of_track: bool) -> None:
        ns, name = job.track
        try:
            coded = await asyncio.to_thread(self.transcoder.transcode, ns, name, properties, payloads)
            if len(coded) != len(payloads):
                raise ValueError(f"{len(coded)} coded payloads for {len(payloads)} objects")
        except Exception as exc:  # the transcoder's refusal, or its bug: the FETCHes fail
            self.fail(job, RequestErrorCode.INTERNAL_ERROR, f"cannot transcode: {exc}")
            return
        if job.done:
            return
        self.stats.transcodes += 1
        digests = [hashlib.sha256(c).digest() for c in coded]
        coded_props = _coded_properties(properties, normal, digests)
        keys = []
        for o, payload, digest in zip(normal, coded, digests):
            obj = CachedObject(o.group_id, o.object_id, o.subgroup_id, o.publisher_priority, ObjectStatus.NORMAL,
                               encode_kvps([(LAYER_DIGEST, digest)]), (memoryview(payload),), len(payload),
                               o.expires_at)
            self.cache.put(job.track, obj, coded_props)
            keys.append(obj.location)
        self.cache.record_range(job.track, keys[0], keys[-1], keys, end_of_track)
        self.stats.transcoded_bytes += sum(len(c) for c in coded)
        logger.info("relay: transcoded %s %s from %s: %d objects, %d -> %d octets", format_namespace(ns),
                    name.decode("utf-8", "backslashreplace"), job.source[1].decode("utf-8", "backslashreplace"),
                    len(coded), sum(map(len, payloads)), sum(map(len, coded)))
        self._finish(job)
        for peer, rid, rng in job.waiters:
            if not self.fetches.try_cache(peer, rid, rng):  # evicted meanwhile, or out of range
                self.reject(peer, rid, RequestErrorCode.INTERNAL_ERROR, "the transcoded objects are not held")

    def fail(self, job: _Job, code: int, reason: str) -> None:
        if job.done:
            return
        self._finish(job)
        logger.info("relay: transcoding %s failed: %s", format_namespace(job.track[0]), reason)
        for peer, rid, _ in job.waiters:
            self.reject(peer, rid, code, reason)

    def _finish(self, job: _Job) -> None:
        job.done = True
        if job.timer is not None:
            job.timer.cancel()
        if self.jobs.get(job.track) is job:
            del self.jobs[job.track]


def _coded_properties(source: Properties, objects: list[CachedObject], digests: list[bytes]) -> Properties:
    """The source's Track Properties with LAYER_DIGESTS over the coded objects (when the
    objects are exactly the layers the source declares; else none: nothing to declare)."""
    declared = LayerDigests.of(source)
    ids = [o.object_id for o in objects]
    rest = tuple((t, v) for t, v in source if t != LAYER_DIGESTS)
    if declared is None or ids != list(range(declared.first, declared.first + declared.count)):
        return rest
    return tuple(sorted((*rest, (LAYER_DIGESTS, b"".join(digests))), key=lambda p: p[0]))
