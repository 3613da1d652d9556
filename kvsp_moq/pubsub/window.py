"""The object window of a subscription, from its LOCATION_FILTER (draft-20 §"Location
Filter"; draft-22 typed form; draft-18 filter types map onto the same model).

"A publisher MUST NOT send subscription-delivered objects from outside the requested range."
The window is fixed when the SUBSCRIBE is accepted, against the track's Largest Object then.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..moqt.messages import LocationFilter, LocationFilterType

_T = LocationFilterType
Loc = tuple[int, int]


@dataclass(frozen=True)
class Window:
    """Objects at or after ``start``, up to ``end_group`` (whole group when ``end_object`` is
    None; inclusive of ``end_object`` otherwise); no end when ``end_group`` is None."""

    start: Loc = (0, 0)
    end_group: int | None = None
    end_object: int | None = None

    def passed(self, group: int, obj: int) -> bool:
        """Whether (group, obj) lies after the end: the subscription is complete."""
        if self.end_group is None:
            return False
        if group != self.end_group:
            return group > self.end_group
        return self.end_object is not None and obj > self.end_object

    def admits(self, group: int, obj: int) -> bool:
        return (group, obj) >= self.start and not self.passed(group, obj)

    @property
    def empty(self) -> bool:
        """No object can ever match (an end before the start): REQUEST_ERROR INVALID_RANGE."""
        if self.end_group is None:
            return False
        end = (self.end_group, self.end_object if self.end_object is not None else 2**64)
        return end < self.start


def subscription_window(filt: LocationFilter | None, largest: Loc | None) -> Window:
    """The window of a SUBSCRIBE with ``filt`` on a track whose Largest Object is ``largest``
    (None: nothing published yet). No filter means every object (draft-20: "Subscription
    without filter = all objects")."""
    if filt is None or filt.filter_type == _T.NONE:
        return Window()
    if filt.filter_type == _T.NEXT_OBJECT:
        return Window((largest[0], largest[1] + 1) if largest else (0, 0))
    if filt.filter_type == _T.RELATIVE_START_GROUP:
        # {Largest.Group + 1 - StartGroup, 0}, clamped at 0; with nothing published: {0, 0}.
        group = max(0, largest[0] + 1 - filt.start_group) if largest else 0
        return Window((group, 0))
    start = (filt.start_group, filt.start_object)
    if filt.filter_type == _T.ABSOLUTE_START:
        return Window(start)
    end_object = filt.end_object if filt.filter_type == _T.ABSOLUTE_RANGE_END_OBJECT else None
    return Window(start, filt.start_group + filt.end_group_delta, end_object)
