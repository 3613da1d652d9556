"""Byte reader and writer used by every codec.

:class:`Reader` walks a bytes-like object with an offset. It never copies: ``pull_bytes(n)``
returns a ``memoryview`` slice of the input (valid as long as the input is alive and not
mutated). When the input ends inside a field it raises :class:`BufferUnderflow` with the exact
number of missing bytes and leaves its position unchanged, so a caller can retry the whole
unit once more bytes have arrived. A reader can be bounded (``end``), e.g. to the body of a
length-prefixed control message; an underflow inside a bounded region means the region is too
short, which the caller reports as the draft says (usually PROTOCOL_VIOLATION).

:class:`Writer` appends into one growing ``bytearray`` (amortised O(1); never ``bytes +=``).
``reserve_uint16``/``patch_uint16`` back-fill a length field after the body is written, as the
16-bit Message Length of control messages needs (draft-20 §"Control Messages").

Both carry the ``seven_byte`` switch of the vi64 encoding (see ``varint``), so message codecs
can pass one reader/writer around without threading the version through every call.
"""

from __future__ import annotations

from .errors import BufferUnderflow
from .varint import encode_quic_varint, encode_vi64, read_quic_varint, read_vi64

__all__ = ["Buffer", "Reader", "Writer"]

Buffer = bytes | bytearray | memoryview


def as_byte_view(data: Buffer) -> memoryview:
    """A flat, 1-byte-per-item memoryview of ``data`` (no copy)."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class Reader:
    """Read fields from ``data[offset:end]`` without copying."""

    __slots__ = ("_view", "_pos", "_end", "seven_byte")

    def __init__(
        self, data: Buffer, offset: int = 0, end: int | None = None, *, seven_byte: bool = True
    ) -> None:
        self._view = as_byte_view(data)
        size = len(self._view)
        self._end = size if end is None else end
        if not 0 <= offset <= self._end <= size:
            raise ValueError(f"bad window [{offset}:{end}] of {size} bytes")
        self._pos = offset
        self.seven_byte = seven_byte

    # -- position -------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Offset of the next unread byte in the underlying data."""
        return self._pos

    @property
    def end(self) -> int:
        return self._end

    @property
    def remaining(self) -> int:
        return self._end - self._pos

    def at_end(self) -> bool:
        return self._pos >= self._end

    def seek(self, position: int) -> None:
        if not 0 <= position <= self._end:
            raise ValueError(f"seek to {position} outside [0:{self._end}]")
        self._pos = position

    def skip(self, n: int) -> None:
        self.pull_bytes(n)

    def bounded(self, n: int) -> Reader:
        """A reader over the next ``n`` bytes, which this reader skips.

        Raises :class:`BufferUnderflow` if fewer than ``n`` bytes remain.
        """
        start = self._pos
        self.pull_bytes(n)
        sub = Reader.__new__(Reader)
        sub._view = self._view
        sub._pos = start
        sub._end = start + n
        sub.seven_byte = self.seven_byte
        return sub

    # -- fields ---------------------------------------------------------------------------
    def pull_bytes(self, n: int) -> memoryview:
        """The next ``n`` bytes as a memoryview slice of the input (no copy)."""
        if n < 0:
            raise ValueError("negative length")
        pos = self._pos
        stop = pos + n
        if stop > self._end:
            raise BufferUnderflow(stop - self._end)
        self._pos = stop
        return self._view[pos:stop]

    def pull_rest(self) -> memoryview:
        """Everything up to the end of the window."""
        pos = self._pos
        self._pos = self._end
        return self._view[pos : self._end]

    def peek_uint8(self) -> int:
        if self._pos >= self._end:
            raise BufferUnderflow(1)
        return self._view[self._pos]

    def pull_uint8(self) -> int:
        pos = self._pos
        if pos >= self._end:
            raise BufferUnderflow(1)
        self._pos = pos + 1
        return self._view[pos]

    def _pull_uint(self, n: int) -> int:
        pos = self._pos
        stop = pos + n
        if stop > self._end:
            raise BufferUnderflow(stop - self._end)
        self._pos = stop
        return int.from_bytes(self._view[pos:stop], "big")

    def pull_uint16(self) -> int:
        return self._pull_uint(2)

    def pull_uint32(self) -> int:
        return self._pull_uint(4)

    def pull_uint64(self) -> int:
        return self._pull_uint(8)

    def pull_vi64(self) -> int:
        value, n = read_vi64(self._view, self._pos, seven_byte=self.seven_byte, end=self._end)
        self._pos += n
        return value

    def pull_quic_varint(self) -> int:
        value, n = read_quic_varint(self._view, self._pos, end=self._end)
        self._pos += n
        return value


class Writer:
    """Append fields to a growing ``bytearray``."""

    __slots__ = ("_buf", "seven_byte")

    def __init__(self, *, seven_byte: bool = True) -> None:
        self._buf = bytearray()
        self.seven_byte = seven_byte

    def __len__(self) -> int:
        return len(self._buf)

    def tell(self) -> int:
        return len(self._buf)

    def getvalue(self) -> bytes:
        return bytes(self._buf)

    def view(self) -> memoryview:
        """A view of what was written (no copy); do not write while holding it."""
        return memoryview(self._buf)

    def clear(self) -> None:
        del self._buf[:]

    def push_bytes(self, data: Buffer) -> None:
        self._buf += data

    def push_uint8(self, value: int) -> None:
        if not 0 <= value <= 0xFF:
            raise ValueError(f"uint8 out of range: {value}")
        self._buf.append(value)

    def push_uint16(self, value: int) -> None:
        self._buf += value.to_bytes(2, "big")

    def push_uint32(self, value: int) -> None:
        self._buf += value.to_bytes(4, "big")

    def push_uint64(self, value: int) -> None:
        self._buf += value.to_bytes(8, "big")

    def push_vi64(self, value: int) -> None:
        if 0 <= value < 0x80:
            self._buf.append(value)
        else:
            self._buf += encode_vi64(value, seven_byte=self.seven_byte)

    def push_quic_varint(self, value: int) -> None:
        self._buf += encode_quic_varint(value)

    def reserve_uint16(self) -> int:
        """Write a 2-byte placeholder; returns its offset for :meth:`patch_uint16`."""
        offset = len(self._buf)
        self._buf += b"\x00\x00"
        return offset

    def patch_uint16(self, offset: int, value: int) -> None:
        if not 0 <= value <= 0xFFFF:
            raise ValueError(f"uint16 out of range: {value}")
        self._buf[offset : offset + 2] = value.to_bytes(2, "big")
