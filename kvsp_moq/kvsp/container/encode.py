"""Encoding KVB1 containers (kvsp-draft §4.3): whole (one allocation of the final size),
into an existing buffer, or as zero-copy chunks for streaming a response."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..errors import ContainerError
from .header import VERSION, BytesLike, ContainerHeader, byte_view

__all__ = ["encode_container", "encode_container_into", "encode_header", "iter_container_chunks"]


def encode_header(
    codec: int, first_layer: int, token_count: int, lengths: Sequence[tuple[int, int]]
) -> bytes:
    """Encode a KVB1 header (§4.3) for sections of the given (K length, V length) pairs."""
    return _make_header(codec, first_layer, token_count, lengths).encode()


def _make_header(
    codec: int, first_layer: int, token_count: int, lengths: Sequence[tuple[int, int]]
) -> ContainerHeader:
    pairs = tuple((k, v) for k, v in lengths)
    return ContainerHeader(VERSION, 0, codec, first_layer, len(pairs), token_count, pairs)


def _section_views(
    layers: Sequence[tuple[BytesLike, BytesLike]],
) -> list[tuple[memoryview, memoryview]]:
    return [(byte_view(k), byte_view(v)) for k, v in layers]


def _header_for(
    codec: int, first_layer: int, token_count: int, views: Sequence[tuple[memoryview, memoryview]]
) -> ContainerHeader:
    return _make_header(codec, first_layer, token_count, [(k.nbytes, v.nbytes) for k, v in views])


def encode_container(
    codec: int,
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[BytesLike, BytesLike]],
) -> bytes:
    """Encode a container holding ``layers`` = [(K, V), ...] from ``first_layer`` on (§4.3).

    One allocation of the final size: ``bytes.join`` sizes the result first and copies each
    section into it once (no zero fill, no intermediate buffers).
    """
    views = _section_views(layers)
    header = _header_for(codec, first_layer, token_count, views)
    parts: list[BytesLike] = [header.encode()]
    for k, v in views:
        parts.append(k)
        parts.append(v)
    return b"".join(parts)


def encode_container_into(
    buffer: bytearray | memoryview,
    codec: int,
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[BytesLike, BytesLike]],
    offset: int = 0,
) -> int:
    """Write the container straight into ``buffer`` at ``offset``; returns octets written.

    For destinations that already exist (a mapped file, a pinned staging buffer).
    """
    views = _section_views(layers)
    header = _header_for(codec, first_layer, token_count, views)
    out = byte_view(buffer)
    if out.readonly or offset < 0 or offset + header.total_size > out.nbytes:
        raise ContainerError(
            "data", f"buffer cannot take {header.total_size} octets at offset {offset}"
        )
    header.pack_into(out, offset)
    pos = offset + header.header_size
    for k, v in views:
        out[pos : pos + k.nbytes] = k
        pos += k.nbytes
        out[pos : pos + v.nbytes] = v
        pos += v.nbytes
    return pos - offset


def iter_container_chunks(
    codec: int,
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[BytesLike, BytesLike]],
) -> Iterator[memoryview]:
    """Yield the container as the header, then each non-empty K and V section (§4.3 order).

    The sections are views of the caller's buffers (zero-copy): for streaming a response.
    The header is validated before the first chunk is yielded.
    """
    views = _section_views(layers)
    header = _header_for(codec, first_layer, token_count, views)
    yield memoryview(header.encode())
    for k, v in views:
        if k.nbytes:
            yield k
        if v.nbytes:
            yield v
