"""Chunk-driven parsing of data streams: headers re-parsed from a small carry-over buffer,
payloads passed through as memoryview slices of the input.

A data stream is a sequence of *units* (a stream header, an object header, an End of Range
marker), some followed by a payload of known length. :class:`IncrementalParser` feeds
arbitrary chunks through a subclass's pure ``_parse_unit`` (which reads one unit with a
:class:`Reader`, raising :class:`BufferUnderflow` with the exact number of missing bytes) and
``_apply_unit`` (which updates state, appends events and returns the payload length).

* A unit that lies wholly inside one chunk is parsed in place (no copy).
* A unit split across chunks is accumulated in ``_pending``; only as many bytes as the
  parse says it needs are moved there, so payload bytes are never copied into it, and its size
  is bounded by the largest unit (header fields + the Object Properties limit).
* Payload bytes are emitted as :class:`ObjectPayload` views of the caller's chunk; a declared
  payload length of 2**60 allocates nothing.
"""

from __future__ import annotations

from ...wire.buffer import Buffer, Reader, as_byte_view
from ...wire.errors import BufferUnderflow, SessionErrorCode, WireError
from ..objects import ObjectEnd, ObjectPayload

__all__ = ["Event", "IncrementalParser"]

Event = object


class IncrementalParser:
    """Base class; subclasses implement ``_parse_unit`` and ``_apply_unit``."""

    __slots__ = ("_pending", "_payload_left", "_end_event", "_error", "_finished", "_seven_byte")

    def __init__(self, *, seven_byte: bool = True) -> None:
        self._pending = bytearray()
        self._payload_left = 0
        self._end_event: ObjectEnd | None = None
        self._error: WireError | None = None
        self._finished = False
        self._seven_byte = seven_byte

    # -- subclass interface ---------------------------------------------------------------
    def _parse_unit(self, r: Reader) -> object:  # pragma: no cover - abstract
        """Read one unit from ``r``.

        Must not change parser state (it may be retried) and must not keep views of the
        reader's data (copy the bytes it keeps): the carry-over buffer is reused.
        """
        raise NotImplementedError

    def _apply_unit(self, unit: object, events: list[object]) -> int:  # pragma: no cover
        """Commit a parsed unit; append its events; return its payload length (0: none).

        When it returns > 0 it must also set ``self._end_event``.
        """
        raise NotImplementedError

    def _unit_complete(self) -> bool:
        """True when the stream may end here (between units, not inside one)."""
        return True

    # -- driver ---------------------------------------------------------------------------
    @property
    def in_payload(self) -> bool:
        """True while inside an object payload."""
        return self._payload_left > 0

    def feed(self, data: Buffer, end_stream: bool = False) -> list[object]:
        """Feed the next chunk of the stream; returns the events it completes.

        ``end_stream`` marks the FIN: ending inside a header or an object is a
        PROTOCOL_VIOLATION (draft-20 §"Streams"). After a :class:`WireError` the parser is
        dead and raises it again.
        """
        if self._error is not None:
            raise self._error
        if self._finished:
            raise ValueError("data fed after the end of the stream")
        events: list[object] = []
        try:
            self._run(as_byte_view(data), events)
            if end_stream:
                self._finished = True
                if self._payload_left or self._pending or not self._unit_complete():
                    raise WireError(
                        SessionErrorCode.PROTOCOL_VIOLATION, "stream ended inside a unit"
                    )
        except WireError as exc:
            self._error = exc
            raise
        return events

    def _try_parse(self, data: Buffer, pos: int) -> tuple[object | None, int]:
        """``(unit, end position)`` or ``(None, bytes needed)``.

        Kept in its own frame so no view of ``data`` (the Reader, or a traceback holding one)
        outlives the call: the carry-over ``bytearray`` cannot be resized while exported.
        """
        r = Reader(data, pos, seven_byte=self._seven_byte)
        try:
            return self._parse_unit(r), r.position
        except BufferUnderflow as under:
            return None, under.needed

    def _run(self, view: memoryview, events: list[object]) -> None:
        pos = 0
        size = len(view)
        pending = self._pending
        while True:
            left = self._payload_left
            if left:
                if pos >= size:
                    return
                take = min(left, size - pos)
                events.append(ObjectPayload(view[pos : pos + take]))
                pos += take
                left -= take
                self._payload_left = left
                if left:
                    return
                end = self._end_event
                self._end_event = None
                events.append(end)
                continue
            if pending:
                # A unit straddles chunks: top up the carry-over with exactly what it lacks.
                while True:
                    unit, n = self._try_parse(pending, 0)
                    if unit is not None:
                        break
                    if pos >= size:
                        return
                    take = min(n, size - pos)
                    pending += view[pos : pos + take]
                    pos += take
                if n != len(pending):  # pragma: no cover - exact-need invariant
                    raise AssertionError("carry-over buffer overran its unit")
                pending.clear()
            else:
                if pos >= size:
                    return
                unit, n = self._try_parse(view, pos)
                if unit is None:
                    pending += view[pos:]
                    return
                pos = n
            payload = self._apply_unit(unit, events)
            if payload:
                self._payload_left = payload
            else:
                end = self._end_event
                if end is not None:
                    self._end_event = None
                    events.append(end)
