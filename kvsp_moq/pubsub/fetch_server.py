"""Serving the peer's FETCH from a track's stored objects (draft-22 §"FETCH").

:func:`serve_fetch` answers one FETCH on a :class:`~.ports.ServingSession`: FETCH_OK, then
one fetch stream with the objects of the range (§"Fetch Header"), read from the track's
store (:meth:`~.publish.TrackPublisher.objects_in`) as they are sent; :func:`fetch_range` is
the range a FETCH asks for, in every draft's form.
"""

from __future__ import annotations

import logging

from ..moqt.data import FetchStreamEncoder
from ..moqt.errors import RequestErrorCode, StreamResetCode
from ..moqt.messages import Fetch, LocationFilterType, Message, StandaloneFetch
from ..moqt.objects import GroupOrder
from ..transport import TransportError
from .errors import MoqtError
from .ports import ServingSession
from .publish import Catalog

__all__ = ["fetch_range", "serve_fetch"]

logger = logging.getLogger(__name__)


def fetch_range(msg: Message) -> tuple[tuple[bytes, ...], bytes, tuple[int, int],
                                       tuple[int, int | None] | None]:
    """(namespace, name, start, end) of a FETCH; end inclusive, end object None = whole
    group, end None = to the largest object."""
    if isinstance(msg, StandaloneFetch):
        # Draft 18 §"FETCH": End Location is the end plus 1; Object 0 = the whole group.
        e = msg.end_location
        end: tuple[int, int | None] | None = (e.group, None) if e.object == 0 else (
            e.group, e.object - 1)
        return msg.track_namespace, msg.track_name, tuple(msg.start_location), end  # type: ignore[return-value]
    if isinstance(msg, Fetch):
        flt = msg.parameters.location_filter
        if flt is None or flt.start_location is None:
            return msg.track_namespace, msg.track_name, (0, 0), None
        start = tuple(flt.start_location)
        if flt.filter_type is LocationFilterType.ABSOLUTE_RANGE_END_OBJECT:
            end = (flt.end_group, flt.end_object)  # type: ignore[assignment]
        elif flt.filter_type is LocationFilterType.ABSOLUTE_RANGE:
            end = (flt.end_group, None)  # type: ignore[assignment]
        else:
            end = None
        return msg.track_namespace, msg.track_name, start, end  # type: ignore[return-value]
    raise MoqtError(RequestErrorCode.NOT_SUPPORTED, "joining FETCH not supported")


async def serve_fetch(session: ServingSession, catalog: Catalog, rid: int,
                      msg: Message) -> None:
    """Answer the peer's FETCH ``msg`` (Request ID ``rid``) on ``session`` from the tracks
    of ``catalog``: REQUEST_ERROR (DOES_NOT_EXIST, INVALID_RANGE), or FETCH_OK and the
    range's objects on one fetch stream, groups in the requested order."""
    moqt = session.moqt
    assert moqt is not None
    ns, name, start, end = fetch_range(msg)
    track = catalog.get(ns, name)
    if track is None:
        moqt.reject(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")
        session.pump()
        return
    objs = track.objects_in(start, end)
    if not objs:
        # §"FETCH": nothing published, or start beyond the Largest Object.
        moqt.reject(rid, RequestErrorCode.INVALID_RANGE, "no objects in range")
        session.pump()
        return
    largest = objs[-1][0]
    order = GroupOrder(msg.parameters.group_order or GroupOrder.ASCENDING)  # type: ignore[attr-defined]
    if order is GroupOrder.DESCENDING:
        # §"FETCH": groups in the requested order, objects ascending within a group.
        objs.sort(key=lambda item: (-item[0][0], item[0][1]))
    moqt.accept_fetch(rid, largest, end_of_track=track.finished,
                      track_properties=track.response_properties())
    sid = moqt.open_fetch_stream(rid)
    session.pump()
    enc = FetchStreamEncoder(rid, session.version, order)
    conn = session.connection
    try:
        for (g, o), obj in objs:
            # A callable payload is read now, when the FETCH reaches it (no copy).
            payload = obj.payload() if callable(obj.payload) else obj.payload
            await conn.write(sid, enc.object_header(
                g, o, len(payload), subgroup_id=None if getattr(obj, "datagram", False) else 0,
                publisher_priority=obj.priority,
                properties=obj.properties))
            await conn.write(sid, payload, stable=obj.stable or isinstance(payload, bytes))
            del payload
        conn.send(sid, b"", end_stream=True)
    except TransportError:
        pass
    except Exception as exc:  # an object that cannot be read or serialized: fail the stream, not hang
        if isinstance(exc, LookupError):  # the store dropped it meanwhile (an evicted replica): routine
            logger.warning("FETCH %d: an object is no longer stored (%s: %s); fetch stream reset",
                           rid, type(exc).__name__, exc)
        else:
            logger.exception("FETCH %d: cannot serve an object", rid)
        try:
            conn.reset_stream(sid, StreamResetCode.INTERNAL_ERROR)
        except TransportError:
            pass
    if session.moqt is not None and not session.moqt.closed:
        moqt.data_stream_done(sid)
        moqt.finish_request(rid)
        session.pump()
