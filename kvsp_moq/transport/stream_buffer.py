"""A QUIC stream's send buffer kept as the chunks written, for aioquic's ``QuicStreamSender``
(issue 16: the relay's per-subscriber cost).

aioquic keeps a stream's unacknowledged bytes in one ``bytearray``: ``+=`` on write,
``del buf[:n]`` when the front is acknowledged, ``bytes(buf[a:b])`` per STREAM frame. After a
front deletion CPython's bytearray has a start offset, and growing it then allocates anew and
copies the whole live buffer (``PyByteArray_Resize``), about every eighth of its size: with
megabytes in flight per stream each byte written is copied ~8 times. Profiled on the relay
with 8 subscribers, ``QuicStreamSender.write`` was 15 % of the process (self time).

:class:`SendBuffer` offers the same four operations on a list of the chunks as written (each
copied once, on ``+=``): a slice within one chunk is a view of it (``get_frame``'s
``bytes()`` is then the frame's only copy), the front is dropped chunk by chunk. Installed by
the aioquic backend on every stream it opens (``AioquicLibrary.open_stream``).
"""

from __future__ import annotations

from bisect import bisect_right

__all__ = ["SendBuffer"]

#: Dropped chunks kept at the list's front before it is compacted.
_COMPACT = 64


class SendBuffer:
    """The bytearray operations aioquic's stream sender uses: ``len``, ``+=``, ``[a:b]``,
    ``del [:n]`` (indices relative to the first byte still held)."""

    __slots__ = ("_chunks", "_starts", "_head", "_base", "_end")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        #: Stream-relative offset of each chunk's first byte.
        self._starts: list[int] = []
        #: Index of the first chunk still (partly) held.
        self._head = 0
        #: Offset of index 0 (the first byte held), and of the end.
        self._base = 0
        self._end = 0

    def __len__(self) -> int:
        return self._end - self._base

    def __iadd__(self, data: bytes | bytearray | memoryview) -> SendBuffer:
        n = len(data)
        if n:
            self._chunks.append(bytes(data))
            self._starts.append(self._end)
            self._end += n
        return self

    def __getitem__(self, index: slice) -> bytes | memoryview:
        # aioquic slices [start:stop] within the buffer (no step, no negative index): the
        # common case goes without slice.indices().
        if index.step not in (None, 1):
            raise ValueError("SendBuffer slices have step 1")
        size = self._end - self._base
        start, stop = index.start, index.stop
        if start is None or start < 0 or stop is None or stop < 0 or stop > size:
            start, stop, _ = index.indices(size)
        if stop <= start:
            return b""
        a, b = self._base + start, self._base + stop
        i = bisect_right(self._starts, a, self._head) - 1
        chunk, at = self._chunks[i], self._starts[i]
        if b <= at + len(chunk):
            return memoryview(chunk)[a - at:b - at]
        parts = []
        while a < b:
            chunk, at = self._chunks[i], self._starts[i]
            end = min(b, at + len(chunk))
            parts.append(memoryview(chunk)[a - at:end - at])
            a = end
            i += 1
        return b"".join(parts)

    def __delitem__(self, index: slice) -> None:
        stop = index.stop
        if index.start not in (None, 0) or index.step not in (None, 1) or stop is None \
                or not 0 <= stop <= self._end - self._base:
            start, stop, _ = index.indices(self._end - self._base)
            if start != 0:
                raise ValueError("SendBuffer drops bytes from its front only")
        self._base += stop
        chunks, starts = self._chunks, self._starts
        head = self._head
        while head < len(chunks) and starts[head] + len(chunks[head]) <= self._base:
            chunks[head] = b""
            head += 1
        if head >= _COMPACT and head * 2 >= len(chunks):
            del chunks[:head]
            del starts[:head]
            head = 0
        self._head = head
