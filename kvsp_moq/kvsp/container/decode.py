"""Decoding KVB1 containers (kvsp-draft §4.3): :func:`decode_container` validates a whole
buffer and returns a zero-copy :class:`Container`; :class:`ContainerDecoder` decodes
incrementally, handing out each layer with its digest as soon as its octets are in (§4.3: "a
receiver [can] start using layer l as soon as it has been received"); :func:`extract_layers`
cuts a layer range (§6.7 ``layers=a-b``)."""

from __future__ import annotations

from dataclasses import dataclass
from hashlib import sha256

from ..errors import ContainerError
from .digests import layer_digest, replica_digest
from .encode import encode_container
from .header import (
    DEFAULT_LIMITS,
    FIXED_HEADER_SIZE,
    BytesLike,
    ContainerHeader,
    ContainerLimits,
    HeaderFixed,
    SectionGeometry,
    byte_view,
    check_prefix,
    is_int,
    parse_fixed,
    parse_lengths,
    truncated_data,
)

__all__ = ["Container", "ContainerDecoder", "DecodedLayer", "LayerView", "decode_container",
           "extract_layers"]


# ---------------------------------------------------------------------------------------------
# Whole-buffer decoding


@dataclass(frozen=True, slots=True)
class LayerView:
    """One layer of a decoded :class:`Container`: read-only views into the container octets."""

    index: int  # absolute layer index
    k: memoryview
    v: memoryview

    def digest(self) -> bytes:
        """The layer digest SHA-256(K || V) (§4.3)."""
        return layer_digest(self.k, self.v)


class Container:
    """A validated KVB1 container over a read-only, zero-copy view of its octets.

    Obtain one with :func:`decode_container`. Layer accessors take absolute layer indices.
    """

    __slots__ = ("_header", "_view", "_digests")

    def __init__(self, header: ContainerHeader, view: memoryview) -> None:
        self._header = header
        self._view = view
        self._digests: tuple[bytes, ...] | None = None

    @property
    def header(self) -> ContainerHeader:
        return self._header

    @property
    def buffer(self) -> memoryview:
        """All octets of the container (read-only)."""
        return self._view

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    def layer(self, index: int) -> LayerView:
        """Absolute layer ``index``; ContainerError(field="layers") if not held."""
        k_start, v_start, end = self._header.offsets(index)
        view = self._view
        return LayerView(index, view[k_start:v_start], view[v_start:end])

    def layer_payload(self, index: int) -> memoryview:
        """K followed by V of absolute layer ``index`` as one contiguous view.

        This is the MOQT object payload of binding v1; its SHA-256 is the layer digest.
        """
        k_start, _, end = self._header.offsets(index)
        return self._view[k_start:end]

    def layers(self) -> list[LayerView]:
        """All layers in ascending order."""
        h = self._header
        return [self.layer(i) for i in range(h.first_layer, h.last_layer + 1)]

    def layer_digests(self) -> list[bytes]:
        """The layer digests (§4.3) of the held layers, ascending; computed once."""
        if self._digests is None:
            view = self._view
            self._digests = tuple(
                sha256(view[start:end]).digest() for start, _, end in self._header.layer_offsets
            )
        return list(self._digests)

    def replica_digest(self) -> bytes:
        """SHA-256 over :meth:`layer_digests` (§4.3).

        This is the replica digest only when the container holds every layer of the block.
        """
        return replica_digest(self.layer_digests())

    def __repr__(self) -> str:
        h = self._header
        return (
            f"Container(codec=0x{h.codec:04x}, layers={h.first_layer}-{h.last_layer}, "
            f"tokens={h.token_count}, nbytes={self.nbytes})"
        )


def decode_container(
    data: BytesLike,
    *,
    geometry: SectionGeometry | None = None,
    limits: ContainerLimits = DEFAULT_LIMITS,
) -> Container:
    """Validate a whole container (§4.3) and return a zero-copy :class:`Container`.

    With ``geometry`` and codec raw, every K and V length must equal the geometry's section
    size for the Token Count (kvsp-layout-1). Raises :class:`ContainerError` on any problem.
    """
    view = byte_view(data).toreadonly()
    n = view.nbytes
    check_prefix(view[:FIXED_HEADER_SIZE])
    if n < FIXED_HEADER_SIZE:
        raise ContainerError("truncated", f"header needs {FIXED_HEADER_SIZE} octets, got {n}")
    fixed = parse_fixed(view, limits)
    if n < fixed.header_size:
        raise ContainerError(
            "truncated",
            f"lengths table of {fixed.layer_count} layers needs {fixed.header_size} octets, "
            f"got {n}",
        )
    header = parse_lengths(fixed, view, limits, geometry)
    total = header.total_size
    if n < total:
        raise truncated_data(header, n)
    if n > total:
        raise ContainerError("trailing", f"{n - total} octets after the last layer")
    return Container(header, view)


def extract_layers(data_or_container: BytesLike | Container, first: int, last: int) -> bytes:
    """A new container holding the inclusive absolute layer range [first, last] (§4.3, §6.7).

    The sections are copied once, straight from the source into the result.
    ContainerError(field="layers") when the range is empty or not inside the container.
    """
    container = (
        data_or_container
        if isinstance(data_or_container, Container)
        else decode_container(data_or_container)
    )
    header = container.header
    if not (is_int(first) and is_int(last)) or first > last:
        raise ContainerError("layers", f"invalid layer range {first!r}-{last!r}")
    if first < header.first_layer or last > header.last_layer:
        raise ContainerError(
            "layers",
            f"layers {first}-{last} are not all in the container "
            f"({header.first_layer}-{header.last_layer})",
        )
    sections = [(lv.k, lv.v) for lv in (container.layer(i) for i in range(first, last + 1))]
    return encode_container(header.codec, first, header.token_count, sections)


# ---------------------------------------------------------------------------------------------
# Incremental decoding


@dataclass(frozen=True, slots=True)
class DecodedLayer:
    """A layer completed by :class:`ContainerDecoder`: read-only K and V views and its digest."""

    index: int  # absolute layer index
    k: memoryview
    v: memoryview
    digest: bytes  # SHA-256(K || V), computed while the octets arrived (§4.3)


class ContainerDecoder:
    """Incremental (sans-IO) KVB1 decoder: ``feed`` it octets in any chunking.

    ``feed`` returns the layers completed by that chunk, in ascending order, so layer ``l`` is
    usable as soon as its octets are in (§4.3). The header is validated as soon as it is
    complete (bad magic, version, flags and codec as soon as their octets arrive). After the
    last layer any octet is an error (``trailing``); :meth:`finish` reports truncation. Once an
    error was raised, every later call raises it again.

    Memory: header octets are buffered up to the size the (limit-checked) header declares;
    a layer's buffer grows only with octets received (``bytearray`` appends, amortised
    linear), so a forged length cannot trigger a large allocation. A layer lying entirely
    inside one ``bytes`` chunk is not copied at all: its views point into that chunk.
    """

    def __init__(
        self,
        *,
        geometry: SectionGeometry | None = None,
        limits: ContainerLimits = DEFAULT_LIMITS,
    ) -> None:
        self._geometry = geometry
        self._limits = limits
        self._head = bytearray()  # header octets received so far
        self._head_need = FIXED_HEADER_SIZE  # header octets needed for the next step
        self._fixed: HeaderFixed | None = None
        self._header: ContainerHeader | None = None
        self._position = 0  # 0-based position of the layer being received
        self._buf = bytearray()  # octets of the current layer (K then V)
        self._hash = sha256()  # digest of the current layer so far
        self._digests: list[bytes] = []
        self._received = 0
        self._error: ContainerError | None = None

    # -- state ------------------------------------------------------------------------------

    @property
    def header(self) -> ContainerHeader | None:
        """The validated header once complete, else None."""
        return self._header

    @property
    def done(self) -> bool:
        """True once the last layer is complete."""
        h = self._header
        return h is not None and self._position == h.layer_count

    @property
    def received(self) -> int:
        """Octets fed so far."""
        return self._received

    @property
    def layer_digests(self) -> list[bytes]:
        """Digests of the layers completed so far, ascending."""
        return list(self._digests)

    def replica_digest(self) -> bytes:
        """SHA-256 over the layer digests (§4.3); requires the container to be complete."""
        self.finish()
        return replica_digest(self._digests)

    # -- input ------------------------------------------------------------------------------

    def feed(self, chunk: BytesLike) -> list[DecodedLayer]:
        """Consume ``chunk``; return the layers it completed (possibly none)."""
        if self._error is not None:
            raise self._error
        try:
            view = byte_view(chunk)
            self._received += view.nbytes
            return self._feed(view, zero_copy=type(chunk) is bytes)
        except ContainerError as exc:
            self._error = exc
            raise

    def finish(self) -> ContainerHeader:
        """Assert the container is complete; ContainerError("truncated") if it is not."""
        if self._error is not None:
            raise self._error
        header = self._header
        if header is None:
            what = "header" if self._fixed is None else "lengths table"
            self._error = ContainerError(
                "truncated", f"{what} incomplete: {len(self._head)} of {self._head_need} octets"
            )
            raise self._error
        if self._position < header.layer_count:
            self._error = truncated_data(header, self._received)
            raise self._error
        return header

    # -- internals --------------------------------------------------------------------------

    def _feed(self, view: memoryview, *, zero_copy: bool) -> list[DecodedLayer]:
        pos = 0
        if self._header is None:
            pos = self._feed_header(view)
        if self._header is None:
            return []
        out: list[DecodedLayer] = []
        header = self._header
        n = view.nbytes
        while self._position < header.layer_count:
            k_len, v_len = header.lengths[self._position]
            want = k_len + v_len - len(self._buf)
            take = min(want, n - pos)
            piece = view[pos : pos + take]
            pos += take
            self._hash.update(piece)  # incremental digest (§4.3), per chunk
            if take < want:
                self._buf += piece  # grows only with octets received
                return out
            if zero_copy and not self._buf:
                payload = piece.toreadonly()  # whole layer inside an immutable chunk
            else:
                self._buf += piece
                payload = memoryview(self._buf).toreadonly()
                self._buf = bytearray()
            out.append(self._complete_layer(payload, k_len))
        if pos < n:
            raise ContainerError("trailing", f"{n - pos} octets after the last layer")
        return out

    def _feed_header(self, view: memoryview) -> int:
        """Take header octets from ``view``; return how many were consumed."""
        pos = 0
        n = view.nbytes
        while self._header is None:
            take = min(self._head_need - len(self._head), n - pos)
            self._head += view[pos : pos + take]
            pos += take
            if len(self._head) < self._head_need:
                if self._fixed is None:
                    check_prefix(self._head)  # fail fast on garbage
                return pos
            if self._fixed is None:
                # Fixed fields complete: validated (and limits applied) before the
                # lengths table, whose size they bound, is buffered.
                self._fixed = parse_fixed(self._head, self._limits)
                self._head_need = self._fixed.header_size
            else:
                self._header = parse_lengths(self._fixed, self._head, self._limits, self._geometry)
                self._head = bytearray()
        return pos

    def _complete_layer(self, payload: memoryview, k_len: int) -> DecodedLayer:
        assert self._header is not None
        digest = self._hash.digest()
        layer = DecodedLayer(
            self._header.first_layer + self._position, payload[:k_len], payload[k_len:], digest
        )
        self._digests.append(digest)
        self._hash = sha256()
        self._position += 1
        return layer
