"""A set of integers held as sorted, disjoint ``[start, stop)`` ranges (as aioquic's
``rangeset``), for the session's history of finished Request IDs and streams.

IDs of one kind are handed out in order (Request IDs +2 per request, stream IDs +4 per stream
of a type, draft-ietf-moq-transport-22 §"Request ID", RFC 9000 §2.1), and requests end in
roughly that order, so a long history is a few ranges: ``[0, n)`` — a watermark — plus one
range per run of IDs still open above it. Adjacent and overlapping ranges are merged as they
fill. The size is the number of ranges, never the number of IDs.

A peer controls which IDs it skips, so each holder bounds its set with :meth:`fill_gaps`:
the lowest gaps are taken as filled (those IDs read as members from then on).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator

__all__ = ["RangeSet"]


class RangeSet:
    """Sorted disjoint half-open integer ranges; membership like a ``set[int]``."""

    __slots__ = ("_starts", "_stops")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        for start, stop in ranges:
            self.add_range(start, stop)

    def __contains__(self, value: int) -> bool:
        i = bisect_right(self._starts, value) - 1
        return i >= 0 and value < self._stops[i]

    def __len__(self) -> int:
        """The number of ranges (the size of the structure)."""
        return len(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._stops, strict=True))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RangeSet) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"RangeSet({list(self)!r})"

    def count(self) -> int:
        """The number of integers in the set."""
        return sum(stop - start for start, stop in self)

    def add(self, value: int) -> None:
        self.add_range(value, value + 1)

    def add_range(self, start: int, stop: int) -> None:
        """Add ``[start, stop)``, merging every range it overlaps or touches."""
        if start > stop:
            raise ValueError(f"range [{start}, {stop}) is reversed")
        if start == stop:
            return
        # Ranges i .. j-1 overlap or touch [start, stop): stops[i] >= start, starts[j-1] <= stop.
        i = bisect_left(self._stops, start)
        j = bisect_right(self._starts, stop)
        if i < j:
            start = min(start, self._starts[i])
            stop = max(stop, self._stops[j - 1])
        self._starts[i:j] = [start]
        self._stops[i:j] = [stop]

    def discard(self, value: int) -> None:
        """Remove ``value`` if present (splitting its range)."""
        i = bisect_right(self._starts, value) - 1
        if i < 0 or value >= self._stops[i]:
            return
        start, stop = self._starts[i], self._stops[i]
        parts = [(s, e) for s, e in ((start, value), (value + 1, stop)) if s < e]
        self._starts[i:i + 1] = [s for s, _ in parts]
        self._stops[i:i + 1] = [e for _, e in parts]

    def fill_gaps(self, max_ranges: int) -> int:
        """Merge the lowest ranges (filling the gaps between them) until at most
        ``max_ranges`` remain; returns the number of gaps filled."""
        if max_ranges < 1:
            raise ValueError("max_ranges must be at least 1")
        k = len(self._starts) - max_ranges
        if k <= 0:
            return 0
        # Ranges 0 .. k become one: [starts[0], stops[k]).
        del self._starts[1:k + 1]
        del self._stops[0:k]
        return k
