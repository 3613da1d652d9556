"""Priority order of one subscriber's queued streams (draft §"Priorities",
§"Scheduling Algorithm").

A stream's key is (subscriber priority, publisher priority, group rank, subgroup ID):
lower sorts first. The group rank is the Group ID for GROUP_ORDER ascending and its
negation for descending, so that for equal priorities the subscription's group order
decides between groups; the lowest Subgroup ID breaks the remaining tie. Equal keys keep
arrival order.
"""

from __future__ import annotations

import heapq
import itertools

from kvsp_moq.moqt.objects import GroupOrder

__all__ = ["StreamKey", "ReadyHeap", "stream_key"]

StreamKey = tuple[int, int, int, int]


def stream_key(subscriber_priority: int, publisher_priority: int, group_order: int,
               group_id: int, subgroup_id: int) -> StreamKey:
    rank = -group_id if group_order == GroupOrder.DESCENDING else group_id
    return (subscriber_priority, publisher_priority, rank, subgroup_id)


class ReadyHeap:
    """Stream ids with queued data, best key first; each id at most once."""

    def __init__(self) -> None:
        self._heap: list[tuple[StreamKey, int, int]] = []
        self._in: set[int] = set()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._in)

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._in

    def push(self, stream_id: int, key: StreamKey) -> None:
        if stream_id not in self._in:
            self._in.add(stream_id)
            heapq.heappush(self._heap, (key, next(self._seq), stream_id))

    def peek(self) -> int | None:
        while self._heap and self._heap[0][2] not in self._in:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def pop(self) -> int | None:
        sid = self.peek()
        if sid is not None:
            heapq.heappop(self._heap)
            self._in.discard(sid)
        return sid

    def discard(self, stream_id: int) -> None:
        self._in.discard(stream_id)  # its heap entry is skipped lazily

    def clear(self) -> None:
        self._heap.clear()
        self._in.clear()
