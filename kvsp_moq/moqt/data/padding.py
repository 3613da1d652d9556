"""Padding streams and datagrams (draft-20 / draft-18 §"Padding Streams", §"Padding
Datagrams"). Public API re-exported by :mod:`kvsp_moq.moqt.data`.
"""

from __future__ import annotations

from typing import NamedTuple

from ...wire.buffer import Reader
from ...wire.varint import encode_vi64
from .common import violation
from .incremental import IncrementalParser
from ..objects import PADDING_DATAGRAM_TYPE, PADDING_STREAM_TYPE, PaddingStreamHeader
from ..version import DEFAULT_VERSION, Version

__all__ = ["PaddingStreamParser", "encode_padding_datagram", "encode_padding_stream_header"]


def encode_padding_stream_header(version: Version = DEFAULT_VERSION) -> bytes:
    """The stream type of a padding stream; zero bytes may follow."""
    return encode_vi64(PADDING_STREAM_TYPE, seven_byte=version.vi64_seven_byte)


class _PaddingChunk(NamedTuple):
    length: int


class PaddingStreamParser(IncrementalParser):
    """Consumes a padding stream. The receiver MUST discard its data; the sender MUST send
    zeros, which is checked only with ``check_zero`` (the draft names no error for it; we use
    PROTOCOL_VIOLATION)."""

    __slots__ = ("version", "check_zero", "header", "discarded")

    def __init__(self, version: Version = DEFAULT_VERSION, *, check_zero: bool = False) -> None:
        super().__init__(seven_byte=version.vi64_seven_byte)
        self.version = version
        self.check_zero = check_zero
        self.header: PaddingStreamHeader | None = None
        #: Number of padding bytes discarded so far.
        self.discarded = 0

    def _unit_complete(self) -> bool:
        return self.header is not None

    def _parse_unit(self, r: Reader) -> object:
        if self.header is None:
            t = r.pull_vi64()
            if t != PADDING_STREAM_TYPE:
                raise violation(f"not a padding stream: type {t:#x}")
            return PaddingStreamHeader()
        data = r.pull_rest()
        if self.check_zero and data.tobytes().count(0) != len(data):
            raise violation("non-zero byte on a padding stream")
        return _PaddingChunk(len(data))

    def _apply_unit(self, unit: object, events: list[object]) -> int:
        if isinstance(unit, PaddingStreamHeader):
            self.header = unit
            events.append(unit)
        else:
            assert isinstance(unit, _PaddingChunk)
            self.discarded += unit.length
        return 0


def encode_padding_datagram(length: int, version: Version = DEFAULT_VERSION) -> bytes:
    """A padding datagram with ``length`` zero bytes after its type."""
    if length < 0:
        raise ValueError("negative padding length")
    return encode_vi64(PADDING_DATAGRAM_TYPE, seven_byte=version.vi64_seven_byte) + bytes(length)
