"""Codec dispatch: one layer's K and V to and from the sections of any registered codec
(kvsp-draft §4.3: "Other codecs ... define their own section encoding"), and whole KVB1
containers in a codec.

Codec ``raw`` goes through :mod:`kvsp_moq.kvsp.layout` unchanged (zero-copy views, the same
octets as ``encode_raw_block``). Layer digests are over the coded sections, whatever the codec
(§4.3): the container functions hash what they carry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import numpy as np

from ..container import BytesLike, Container, ContainerLimits, DEFAULT_LIMITS, decode_container, encode_container
from ..errors import ContainerError
from ..layout import Geometry, decode_raw_layer, encode_raw_layer
from ..registries import CODEC_RAW, CODECS, CODECS_BY_NAME, Codec
from .elements import check_tokens
from .fp8 import FP8_E4M3
from .int8 import INT8
from .planes import ZSTD_PLANES

__all__ = [
    "LAYER_CODECS",
    "LayerCodec",
    "coded_section_bytes",
    "decode_block",
    "decode_layer",
    "encode_block",
    "encode_layer",
    "layer_codec",
]


class LayerCodec(Protocol):
    """What each codec implements: a layer's sections, and their size when it is fixed."""

    @property
    def codec(self) -> Codec:
        """Its registry entry."""
        ...

    def section_bytes(self, geometry: Geometry, tokens: int) -> int | None:
        """Octets of one K or V section of ``tokens`` tokens; None when content decides."""
        ...

    def encode_layer(
        self, k: np.ndarray, v: np.ndarray, geometry: Geometry, tokens: int
    ) -> tuple[BytesLike, BytesLike]:
        """The K and V sections of a layer given in kvsp-layout-1 element type."""
        ...

    def decode_layer(
        self, k_section: BytesLike, v_section: BytesLike, geometry: Geometry, tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """K and V [tokens, kv_heads, head_dim] in the geometry's ``numpy_storage`` dtype;
        ContainerError naming the field for anything malformed."""
        ...


class RawCodec:
    """Codec ``raw`` (kvsp-layout-1): :func:`encode_raw_layer` / :func:`decode_raw_layer`."""

    codec = CODEC_RAW

    def section_bytes(self, geometry: Geometry, tokens: int) -> int | None:
        return geometry.section_bytes(check_tokens(tokens))

    def encode_layer(
        self, k: np.ndarray, v: np.ndarray, geometry: Geometry, tokens: int
    ) -> tuple[memoryview, memoryview]:
        check_tokens(tokens)
        sections = encode_raw_layer(k, v, geometry)
        if k.shape[0] != tokens:
            raise ContainerError("token_count", f"K and V hold {k.shape[0]} tokens, not {tokens}")
        return sections

    def decode_layer(
        self, k_section: BytesLike, v_section: BytesLike, geometry: Geometry, tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        return decode_raw_layer(k_section, v_section, geometry, check_tokens(tokens))


LAYER_CODECS: Mapping[int, LayerCodec] = MappingProxyType(
    {c.codec.value: c for c in (RawCodec(), FP8_E4M3, INT8, ZSTD_PLANES)}
)
assert set(LAYER_CODECS) == set(CODECS), "every registered codec has an implementation"


def layer_codec(codec: int | str | Codec) -> LayerCodec:
    """The implementation of a codec given by value, registry name or entry;
    ContainerError("codec") when it is not registered."""
    entry: Codec | None
    if isinstance(codec, Codec):
        entry = CODECS.get(codec.value)
    elif isinstance(codec, str):
        entry = CODECS_BY_NAME.get(codec)
    elif isinstance(codec, int) and not isinstance(codec, bool):
        entry = CODECS.get(codec)
    else:
        entry = None
    if entry is None:
        raise ContainerError("codec", f"{codec!r} is not a registered codec")
    return LAYER_CODECS[entry.value]


def coded_section_bytes(codec: int | str | Codec, geometry: Geometry, tokens: int) -> int | None:
    """Octets of one K or V section in ``codec``; None where the content decides (lossless)."""
    return layer_codec(codec).section_bytes(geometry, tokens)


def encode_layer(
    codec: int | str | Codec, k: np.ndarray, v: np.ndarray, geometry: Geometry, tokens: int
) -> tuple[BytesLike, BytesLike]:
    """The (K section, V section) of one layer in ``codec``. ``k`` and ``v`` are shaped
    [tokens, kv_heads, head_dim] and carry the geometry's element type (any dtype of its
    itemsize: bf16 and fp8 as bit patterns), as for ``encode_raw_layer``."""
    return layer_codec(codec).encode_layer(k, v, geometry, tokens)


def decode_layer(
    codec: int | str | Codec, k_section: BytesLike, v_section: BytesLike, geometry: Geometry,
    tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) [tokens, kv_heads, head_dim] in the geometry's element type (``numpy_storage``
    dtype) from one layer's sections in ``codec``. Raises ContainerError naming the field."""
    return layer_codec(codec).decode_layer(k_section, v_section, geometry, tokens)


def encode_block(
    codec: int | str | Codec,
    layers_kv: Sequence[tuple[np.ndarray, np.ndarray]],
    geometry: Geometry,
    first_layer: int = 0,
) -> bytes:
    """A KVB1 container (§4.3) in ``codec`` of ``layers_kv`` = [(K, V), ...] from
    ``first_layer`` on; every layer must hold the same number of tokens. For codec raw the
    octets equal ``encode_raw_block``'s."""
    implementation = layer_codec(codec)
    if len(layers_kv) == 0:
        raise ContainerError("layer_count", "a container holds at least one layer")
    first = layers_kv[0][0]
    # Every layer's encoder checks its arrays, and that they hold this many tokens.
    count = first.shape[0] if isinstance(first, np.ndarray) and first.ndim == 3 else 0
    sections = [implementation.encode_layer(k, v, geometry, count) for k, v in layers_kv]
    return encode_container(implementation.codec.value, first_layer, count, sections)


def decode_block(
    data: BytesLike | Container,
    geometry: Geometry,
    *,
    limits: ContainerLimits = DEFAULT_LIMITS,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(K, V) of every layer of a container in any registered codec, ascending, in the
    geometry's element type. Framing is checked by :func:`decode_container` (with the
    geometry: codec raw's lengths), then every section by its codec."""
    container = data if isinstance(data, Container) else decode_container(data, geometry=geometry, limits=limits)
    header = container.header
    implementation = layer_codec(header.codec)
    return [implementation.decode_layer(view.k, view.v, geometry, header.token_count)
            for view in container.layers()]
