"""The fourteen moq-interop-runner test cases (the ones aiomoqt's ``moq-interop-client``
knows), written on ``kvsp_moq.pubsub``. Each case connects one or two sessions to the relay
under test and returns a :class:`~interop.tap.CaseResult`; an exception is a failure.

What each case asserts follows aiomoqt 0.13.3's client (read, not copied); where we check
more (payload bytes, counts) the docstring says so. Readiness is always an answer on the
wire; the timeouts are safety nets.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import LocationFilter, MessageParameters
from kvsp_moq.moqt.objects import GroupOrder, ObjectStatus
from kvsp_moq.pubsub import Catalog, MoqtError, ReceivedObject, MoqtSession, connect
from kvsp_moq.pubsub.errors import ErrorKind

from .client_support import (Namespace, Target, announce, joining_fetch, next_update, ns,
                             publish_done_now, publish_track, subscribe_tracks, withdraw)
from .tap import CaseResult


T = TypeVar("T")


class CaseFailed(AssertionError):
    """A case observed something other than what it asserts."""


STEP = 5.0  # seconds: safety net for one exchange
CASE_GUARD = 20.0  # seconds: safety net for a whole case
DATA_CASE = ("moq-test-00", "0", "0", "0", "2", "4", "5", "64", "32", "2", "1", "1", "0",
             "-1", "-1", "0")  # MoQT Test tuple of data-subgroup-basic (groups 0-2, objects 0-4)
NOT_FOUND = {RequestErrorCode.DOES_NOT_EXIST, 0x04}  # 0x04: draft-14 TRACK_DOES_NOT_EXIST
BENIGN = {RequestErrorCode.UNAUTHORIZED, RequestErrorCode.TIMEOUT,
          RequestErrorCode.NOT_SUPPORTED, RequestErrorCode.DOES_NOT_EXIST,
          RequestErrorCode.UNINTERESTED}


class Run:
    """Per-run state: the target and a unique namespace per case."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.run_id = secrets.token_hex(8)

    def namespace(self, case: str, *more: str) -> Namespace:
        return ns("moq-test", "kvsp", self.run_id, case, *more)

    @contextlib.asynccontextmanager
    async def session(self, *, catalog: Catalog | None = None,
                      accept_publish: bool = False) -> AsyncIterator[MoqtSession]:
        s = await connect(self.target.url, self.target.transport(), catalog=catalog,
                          setup_timeout=STEP, accept_publish=accept_publish)
        try:
            yield s
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(s.close(), STEP)


async def _within(aw: Awaitable[T], what: str, timeout: float = STEP) -> T:
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise CaseFailed(f"no {what} within {timeout:g} s") from None


def _request_error(exc: BaseException) -> int | None:
    if isinstance(exc, MoqtError) and exc.kind is ErrorKind.REQUEST:
        return int(exc.code)
    return None


# ---------------------------------------------------------------------------------------------
# control plane
async def setup_only(run: Run) -> str:
    """CLIENT_SETUP / SERVER_SETUP on the pinned version, then a clean close."""
    async with run.session() as s:
        return f"SETUP done, version {s.version}"


async def announce_only(run: Run) -> str:
    async with run.session() as s:
        await _within(s.publish_namespace(run.namespace("announce-only")), "REQUEST_OK")
    return "PUBLISH_NAMESPACE answered with REQUEST_OK"


async def publish_namespace_done(run: Run) -> str:
    """Announce, then withdraw (draft 18+: cancel the request stream); the session must stay
    usable afterwards (we check with a second announce, which aiomoqt does not)."""
    async with run.session() as s:
        rid = await _within(announce(s, run.namespace("pnd")), "REQUEST_OK")
        withdraw(s, int(rid))
        await _within(s.publish_namespace(run.namespace("pnd", "again")), "second REQUEST_OK")
    return "REQUEST_OK, withdrawn by cancelling the request, session still usable"


async def subscribe_error(run: Run) -> str:
    async with run.session() as s:
        try:
            await _within(s.subscribe(ns("nonexistent", "namespace"), "test-track"),
                          "SUBSCRIBE answer")
        except MoqtError as exc:
            code = _request_error(exc)
            if code in NOT_FOUND:
                return f"REQUEST_ERROR {code:#x} (DOES_NOT_EXIST)"
            if code is not None and code != RequestErrorCode.INTERNAL_ERROR:
                return f"REQUEST_ERROR {code:#x} accepted as a refusal (not DOES_NOT_EXIST)"
            raise CaseFailed(f"expected REQUEST_ERROR DOES_NOT_EXIST, got {exc!r}") from None
    raise CaseFailed("SUBSCRIBE_OK for a track nobody publishes")


async def rendezvous_timeout(run: Run) -> str:
    """SUBSCRIBE with RENDEZVOUS_TIMEOUT 500 ms for a track nobody publishes: REQUEST_ERROR
    TIMEOUT within 2 s."""
    params = MessageParameters(rendezvous_timeout=500)
    async with run.session() as s:
        try:
            await _within(s.subscribe(ns("nonexistent", "rendezvous"), "test-track",
                                      parameters=params), "REQUEST_ERROR TIMEOUT", 2.0)
        except MoqtError as exc:
            code = _request_error(exc)
            if code == RequestErrorCode.TIMEOUT:
                return "REQUEST_ERROR TIMEOUT"
            raise CaseFailed(f"REQUEST_ERROR {code!r} ({exc.reason}), expected TIMEOUT (0x2)"
                             ) from None
    raise CaseFailed("SUBSCRIBE_OK for a track nobody publishes")


async def announce_subscribe(run: Run) -> str:
    """A publisher announces; a second session's SUBSCRIBE is routed to it (SUBSCRIBE_OK)."""
    namespace = run.namespace("announce-subscribe")
    catalog = Catalog()
    track = catalog.create(namespace, "track")
    async with run.session(catalog=catalog) as pub, run.session() as sub:
        await _within(pub.publish_namespace(namespace), "REQUEST_OK")
        subscription = await _within(sub.subscribe(namespace, "track"), "SUBSCRIBE_OK")
        await _within(track.subscribed.wait(), "SUBSCRIBE at the publisher")
        await subscription.cancel()
    return "SUBSCRIBE_OK; the relay routed the SUBSCRIBE to the publisher"


async def subscribe_before_announce(run: Run) -> str:
    """SUBSCRIBE before any publisher exists; then a publisher announces. Valid outcomes:
    SUBSCRIBE_OK (the relay held it) or a benign REQUEST_ERROR (it did not)."""
    namespace = run.namespace("subscribe-before-announce")
    catalog = Catalog()
    catalog.create(namespace, "track")
    async with run.session() as sub:
        pending = asyncio.ensure_future(sub.subscribe(namespace, "track"))
        try:
            await asyncio.sleep(0)  # the SUBSCRIBE is on the wire before the publisher exists
            async with run.session(catalog=catalog) as pub:
                await _within(pub.publish_namespace(namespace), "REQUEST_OK")
                try:
                    got = await _within(asyncio.shield(pending), "SUBSCRIBE answer")
                except MoqtError as exc:
                    code = _request_error(exc)
                    if code in BENIGN:
                        return f"REQUEST_ERROR {code:#x}: the relay did not hold the SUBSCRIBE"
                    raise CaseFailed(f"non-benign answer {exc!r}") from None
                await got.cancel()
                return "SUBSCRIBE_OK after the announce: the relay held the SUBSCRIBE"
        finally:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


# ---------------------------------------------------------------------------------------------
# data plane
def _check_data(objs: list[ReceivedObject]) -> list[str]:
    problems: list[str] = []
    seen: set[tuple[int, int]] = set()
    for o in objs:
        if o.status != ObjectStatus.NORMAL:
            continue
        loc = (o.group_id, o.object_id)
        if loc in seen:
            problems.append(f"duplicate {loc}")
        seen.add(loc)
        size = 64 if o.object_id == 0 else 32
        if o.subgroup_id not in (0, None) or o.publisher_priority != 128:
            problems.append(f"{loc}: subgroup {o.subgroup_id} priority {o.publisher_priority}")
        if bytes(o.payload) != b"t" * size:
            problems.append(f"{loc}: payload {len(o.payload)} bytes, not {size} x 't'")
    missing = {(g, i) for g in range(3) for i in range(5)} - seen
    if missing:
        problems.append(f"missing {sorted(missing)}")
    return problems


async def data_subgroup_basic(run: Run) -> str:
    """3 groups x 5 objects (64 then 32 bytes of 't', priority 128), one subgroup stream per
    group, then PUBLISH_DONE TRACK_ENDED; checked object by object, plus the Stream Count."""
    prefix = run.namespace("data-subgroup-basic")
    full = prefix + ns(*DATA_CASE)
    catalog = Catalog()
    track = catalog.create(full, "track")
    async with run.session(catalog=catalog) as pub, run.session() as sub:
        await _within(pub.publish_namespace(prefix), "REQUEST_OK")
        subscription = await _within(sub.subscribe(
            full, "track", parameters=MessageParameters(group_order=GroupOrder.ASCENDING)),
            "SUBSCRIBE_OK")
        await _within(track.subscribed.wait(), "upstream SUBSCRIBE")
        for g in range(3):
            for o in range(5):
                await track.write_object(g, o, b"t" * (64 if o == 0 else 32), priority=128)
        await track.finish()
        objs = await _within(subscription.collect(), "all objects and PUBLISH_DONE", 10.0)
        problems = _check_data(objs)
        done = subscription.publish_done
        if done is None or done.status_code != PublishDoneCode.TRACK_ENDED:
            problems.insert(0, f"PUBLISH_DONE {done!r}, expected TRACK_ENDED")
        if problems or done is None:
            raise CaseFailed("; ".join(problems))
        return (f"{len(objs)} objects exact; PUBLISH_DONE TRACK_ENDED, "
                f"Stream Count {done.stream_count}")


async def namespace_discovery(run: Run) -> str:
    """A subscriber that knows only the namespace learns the track name: SUBSCRIBE_NAMESPACE
    (NAMESPACE), then SUBSCRIBE_TRACKS, answered by a PUBLISH naming the track."""
    namespace = run.namespace("namespace-discovery")
    catalog = Catalog()
    track = catalog.create(namespace, "track-x")
    async with run.session(catalog=catalog) as pub:
        await _within(pub.publish_namespace(namespace), "REQUEST_OK")
        await _within(publish_track(pub, track, alias=1), "PUBLISH answer")
        async with run.session(accept_publish=True) as sub:
            await _within(sub.subscribe_namespace(namespace), "REQUEST_OK (SUBSCRIBE_NAMESPACE)")
            await _within(subscribe_tracks(sub, namespace), "REQUEST_OK (SUBSCRIBE_TRACKS)")
            incoming = await _within(sub.incoming_publishes.get(), "PUBLISH")
            name = incoming.name
            if name != b"track-x":
                raise CaseFailed(f"PUBLISH for {name!r}, expected b'track-x'")
            return "discovered 'track-x' from the relay's PUBLISH"


async def _history(run: Run, case: str,
                   body: Callable[[MoqtSession, Namespace], Awaitable[str]]) -> str:
    """A live track of 5-object groups the relay has forwarded (groups 0-2 reached a
    subscriber); then ``body(fetcher_session, namespace)``."""
    namespace = run.namespace(case)
    catalog = Catalog()
    track = catalog.create(namespace, "track")
    async with run.session(catalog=catalog) as pub, run.session() as live:
        await _within(pub.publish_namespace(namespace), "REQUEST_OK")
        subscription = await _within(live.subscribe(namespace, "track"), "SUBSCRIBE_OK")
        await _within(track.subscribed.wait(), "upstream SUBSCRIBE")
        for g in range(3):
            for o in range(5):
                await track.write_object(g, o, f"{g}.{o}".encode() * 8)
        seen = 0
        async for _obj in subscription:
            seen += 1
            if seen == 15:
                break
        async with run.session() as fetcher:
            return await body(fetcher, namespace)


def _expect_group(objs: list[ReceivedObject], group: int, what: str) -> str:
    """``objs`` must be exactly objects 0-4 of ``group`` with the bytes ``_history`` wrote."""
    got = sorted((o.group_id, o.object_id) for o in objs if o.status == ObjectStatus.NORMAL)
    want = [(group, i) for i in range(5)]
    bad = [o for o in objs if bytes(o.payload) != f"{o.group_id}.{o.object_id}".encode() * 8]
    if got != want or bad:
        raise CaseFailed(f"{what}: got {got}, expected {want}"
                         + (" (payload mismatch)" if bad else ""))
    return f"{len(objs)} objects of group {group} by {what}, bytes exact"


async def fetch(run: Run) -> str:
    """A standalone FETCH of a whole group the relay has forwarded returns its objects (we
    check all five and their bytes; aiomoqt checks for at least one)."""

    async def body(s: MoqtSession, namespace: Namespace) -> str:
        stream = await _within(s.fetch(namespace, "track", start=(1, 0), end=(1, 4)), "FETCH_OK")
        objs = await _within(stream.collect(), "the fetch stream")
        return _expect_group(objs, 1, "the FETCH")

    return await _history(run, "fetch", body)


async def join(run: Run) -> str:
    """SUBSCRIBE plus a joining request one group back while the track is live: the earlier
    group arrives. Draft 18: SUBSCRIBE + Relative Joining FETCH (joining start 1); drafts
    20+: SUBSCRIBE with FILL_PARAMETERS (LOCATION_FILTER RelativeStart 2 = one group back)."""

    async def body(s: MoqtSession, namespace: Namespace) -> str:
        if s.version.fetch_has_fetch_type:
            sub = await _within(s.subscribe(namespace, "track"), "SUBSCRIBE_OK")
            stream = await _within(joining_fetch(s, sub, 1), "FETCH_OK (joining)")
            objs = await _within(stream.collect(), "the joining fetch stream")
            # {Largest.Group - 1, 0} up to the subscription's start: groups 1 and 2 here.
            if {o.group_id for o in objs} - {1, 2}:
                raise CaseFailed(f"joining FETCH returned groups {sorted({o.group_id for o in objs})}")
            return _expect_group([o for o in objs if o.group_id == 1], 1,
                                 "the joining FETCH")
        fill = MessageParameters(location_filter=LocationFilter.relative_start(2))
        sub = await _within(s.subscribe(namespace, "track",
                                        parameters=MessageParameters(fill_parameters=fill)),
                            "SUBSCRIBE_OK")
        got: list[ReceivedObject] = []

        async def first_group() -> None:
            async for obj in sub:
                got.append(obj)
                if sum(1 for o in got if o.group_id == 1) == 5:
                    return

        await _within(first_group(), "objects of group 1 from the fill")
        return _expect_group([o for o in got if o.group_id == 1], 1, "the fill")

    return await _history(run, "join", body)


async def subscribe_namespace_lifecycle(run: Run) -> str:
    """SUBSCRIBE_NAMESPACE; another session announces (NAMESPACE with an empty suffix), then
    withdraws (NAMESPACE_DONE)."""
    namespace = run.namespace("snl")
    async with run.session() as sub, run.session() as pub:
        await _within(sub.subscribe_namespace(namespace), "REQUEST_OK")
        rid = await _within(announce(pub, namespace), "REQUEST_OK (PUBLISH_NAMESPACE)")
        first = await next_update(sub, ("namespace", "namespace_done"), STEP)
        if first != ("namespace", ()):
            raise CaseFailed(f"first update {first!r}, expected NAMESPACE ()")
        withdraw(pub, int(rid))
        second = await next_update(sub, ("namespace", "namespace_done"), STEP)
        if second != ("namespace_done", ()):
            raise CaseFailed(f"then {second!r}, expected NAMESPACE_DONE ()")
    return "NAMESPACE then NAMESPACE_DONE"


async def publish_track_only(run: Run) -> str:
    """PUBLISH a track nobody subscribes to: REQUEST_OK (PUBLISH_OK); end it with PUBLISH_DONE."""
    catalog = Catalog()
    track = catalog.create(run.namespace("publish-track-only"), "track")
    async with run.session(catalog=catalog) as pub:
        rid = await _within(publish_track(pub, track, alias=1), "PUBLISH answer")
        publish_done_now(pub, int(rid), PublishDoneCode.TRACK_ENDED, 0)
        await pub.drain()
    return "REQUEST_OK to PUBLISH; PUBLISH_DONE sent"


async def publish_track_subscribe(run: Run) -> str:
    """PUBLISH before any subscriber; a second session SUBSCRIBEs and gets the 5 objects the
    publisher writes after that SUBSCRIBE_OK (bytes checked)."""
    namespace = run.namespace("publish-track-subscribe")
    catalog = Catalog()
    track = catalog.create(namespace, "track")
    async with run.session(catalog=catalog) as pub, run.session() as sub:
        await _within(publish_track(pub, track, alias=1), "PUBLISH answer")
        subscription = await _within(sub.subscribe(namespace, "track"), "SUBSCRIBE_OK")
        # A relay may pause the PUBLISH with REQUEST_UPDATE FORWARD=0 (aiomoqt's sends it right
        # behind PUBLISH_OK) and raise it with FORWARD=1 once a subscriber forwards
        # (§"Publisher Interactions"); that raise can reach the publisher after the
        # subscriber's SUBSCRIBE_OK, and objects written in Forward State 0 are never sent.
        # `forwarding` is the publisher's current state: clear while paused, set once raised.
        # The pause is sent before the relay can have our SUBSCRIBE, so it is applied by now.
        await _within(track.forwarding.wait(), "Forward State 1 at the publisher")
        for o in range(5):
            await track.write_object(0, o, f"0.{o}".encode() * 8)
        got: list[ReceivedObject] = []

        async def five() -> None:
            async for obj in subscription:
                got.append(obj)
                if len(got) == 5:
                    return

        await _within(five(), "5 objects")
        return _expect_group(got, 0, "the subscription")


CASES: dict[str, Callable[[Run], Awaitable[str]]] = {
    "setup-only": setup_only,
    "announce-only": announce_only,
    "publish-namespace-done": publish_namespace_done,
    "subscribe-error": subscribe_error,
    "rendezvous-timeout": rendezvous_timeout,
    "announce-subscribe": announce_subscribe,
    "subscribe-before-announce": subscribe_before_announce,
    "data-subgroup-basic": data_subgroup_basic,
    "namespace-discovery": namespace_discovery,
    "fetch": fetch,
    "join": join,
    "subscribe-namespace-lifecycle": subscribe_namespace_lifecycle,
    "publish-track-only": publish_track_only,
    "publish-track-subscribe": publish_track_subscribe,
}


async def run_case(run: Run, name: str) -> CaseResult:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        message = await asyncio.wait_for(CASES[name](run), CASE_GUARD)
        return CaseResult(name, True, message, (loop.time() - t0) * 1000)
    except asyncio.TimeoutError:
        msg = f"no result within {CASE_GUARD:g} s"
    except Exception as exc:  # every failure is reported, never raised
        msg = f"{type(exc).__name__}: {exc}"
    return CaseResult(name, False, msg, (loop.time() - t0) * 1000)
