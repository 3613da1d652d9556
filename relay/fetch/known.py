"""What the relay knows of a FETCH's range: the objects it holds, the spans it knows hold no
other object, and the gaps whose objects' status is unknown (draft-22 §"Objects", §"FETCH").

§"Objects": an object is known to exist, known not to exist, or of unknown status; "A gap in
the observed Object IDs does not by itself convey any information about the skipped
Objects." So a location is known only when

* an object is cached there (from a subscription or a FETCH, :meth:`relay.fetch.cache.ObjectCache.held`);
* it lies inside a range an upstream FETCH returned completely (§"FETCH": "Any gaps in the
  Group and Object IDs in the response stream indicate objects that do not exist",
  :meth:`relay.fetch.cache.ObjectCache.complete_spans`);
* a cached END_OF_GROUP status object at or before it in its group, or an END_OF_TRACK
  status object (or a complete range that ended with End Of Track) at or before it
  (§"Object Status": "no objects with the specified Group ID and the Object ID that is
  greater than or equal to the one specified exist");
* or nothing can lie there: ``{G, N}`` and ``{G, N + 1}`` are adjacent, and so are the end of
  a group and ``{G + 1, 0}``.

:func:`plan` turns a range into the objects held (ascending: §"FETCH": "fetched groups in
the requested group order ... Within each group, objects are sent in Object ID order") and
:class:`Gap` s between them, each a sub-range to FETCH upstream (§"FETCH": "If it encounters
an object in the requested range that is not cached and has unknown status, the relay MUST
pause subsequent delivery until it has confirmed the object's status upstream"). Pure: no
I/O, no cache mutation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsp_moq.moqt.objects import ObjectStatus
from kvsp_moq.wire.varint import VI64_MAX

from .cache import CachedObject

__all__ = ["Gap", "HeldPlan", "after", "before", "plan"]

Loc = tuple[int, int]
#: The inclusive end object of a whole group (the same value as ``relay.fetch.inflight.WHOLE_GROUP``).
GROUP_END = VI64_MAX - 1
#: Past every location: the end of a span known to reach the end of the track.
TRACK_END: Loc = (VI64_MAX, VI64_MAX)


def after(loc: Loc) -> Loc:
    """The first location after ``loc``."""
    g, o = loc
    return (g + 1, 0) if o >= GROUP_END else (g, o + 1)


def before(loc: Loc) -> Loc | None:
    """The last location before ``loc`` (None before ``{0, 0}``)."""
    g, o = loc
    if o > 0:
        return (g, o - 1)
    return (g - 1, GROUP_END) if g > 0 else None


@dataclass(frozen=True, slots=True)
class Gap:
    """Locations ``start`` .. ``end`` (inclusive; None: to the Largest Object) of unknown
    status: FETCHed upstream."""

    start: Loc
    end: Loc | None

    def holds(self, loc: Loc) -> bool:
        return self.start <= loc and (self.end is None or loc <= self.end)


@dataclass(slots=True)
class HeldPlan:
    """A range as the relay can answer it: Normal objects held and gaps, ascending."""

    segments: list[CachedObject | Gap]
    #: A known span reaches the end of the track from the range's end on.
    end_of_track: bool

    @property
    def gaps(self) -> list[Gap]:
        return [s for s in self.segments if isinstance(s, Gap)]

    @property
    def objects(self) -> list[CachedObject]:
        return [s for s in self.segments if isinstance(s, CachedObject)]


def _spans(objects: Iterable[CachedObject],
           complete: Iterable[tuple[Loc, Loc, bool]]) -> list[tuple[Loc, Loc]]:
    """Every span known (an object's location, what a status or a complete range rules out),
    sorted by start."""
    spans: list[tuple[Loc, Loc]] = []
    for o in objects:
        loc = o.location
        if o.status is ObjectStatus.END_OF_TRACK:
            spans.append((loc, TRACK_END))
        elif o.status is ObjectStatus.END_OF_GROUP:
            spans.append((loc, (loc[0], GROUP_END)))
        else:
            spans.append((loc, loc))
    for start, end, end_of_track in complete:
        spans.append((start, TRACK_END if end_of_track else end))
    spans.sort()
    return spans


def plan(start: Loc, end: Loc | None, objects: Sequence[CachedObject],
         complete: Iterable[tuple[Loc, Loc, bool]] = ()) -> HeldPlan:
    """The range ``start`` .. ``end`` (inclusive; None: to the Largest Object, unknown here)
    as the Normal ``objects`` held in it (ascending) and the gaps of unknown status between
    them, given the complete ranges ``complete`` (``(start, end, end_of_track)``)."""
    stop = TRACK_END if end is None else end
    gaps: list[Gap] = []
    pos: Loc | None = start  # the first location not known yet (None: past the range)
    spans = _spans(objects, complete)
    for s, e in spans:
        if pos is None or s > stop:
            break
        if e < pos:
            continue
        if s > pos:
            gaps.append(Gap(pos, before(s)))
        pos = None if e >= stop else after(e)
    end_of_track = pos is None and any(e == TRACK_END and s <= stop for s, e in spans)
    if pos is not None:
        gaps.append(Gap(pos, end))
    segments: list[CachedObject | Gap] = []
    normal = [o for o in objects if o.status is ObjectStatus.NORMAL and start <= o.location <= stop]
    i = 0
    for gap in gaps:
        while i < len(normal) and normal[i].location < gap.start:
            segments.append(normal[i])
            i += 1
        segments.append(gap)
    segments.extend(normal[i:])
    return HeldPlan(segments, end_of_track)
