"""The KV Block Container "KVB1" (kvsp-draft §4.3).

Wire layout (all integers big-endian, §4.3)::

    Magic "KVB1" (32) | Version (8) = 1 | Flags (8) = 0 | Codec (16)
    First Layer (32) | Layer Count (32) | Token Count (32)
    Layer Count x { K Length (64), V Length (64) }
    Data: for each layer in ascending order, K octets then V octets

The layer digest of layer ``l`` is SHA-256(K || V); the replica digest is the SHA-256 of the
concatenated layer digests in ascending layer order (§4.3).

What this package offers (:mod:`.header`, :mod:`.encode`, :mod:`.decode`, :mod:`.digests`):

- :class:`ContainerHeader`, :func:`encode_header`, :func:`encode_container`,
  :func:`encode_container_into` and :func:`iter_container_chunks` (zero-copy streaming);
- :func:`decode_container`, a whole-buffer decoder returning a zero-copy :class:`Container`;
- :class:`ContainerDecoder`, an incremental decoder that accepts arbitrary chunking, hands out
  each layer as soon as its octets are complete and hashes while bytes arrive (§4.3: "a
  receiver [can] start using layer l as soon as it has been received");
- :func:`layer_digest`, :func:`replica_digest` and :func:`extract_layers` (layer-range
  retrieval, §6.7 ``layers=a-b``).

Every problem with a container raises :class:`~kvsp_moq.kvsp.errors.ContainerError` whose
``field`` names the culprit (see ``docs/container.md`` for the list). Nothing here allocates
memory in proportion to a length read from the wire: buffers only grow with octets actually
received (untrusted lengths are bounded by :class:`ContainerLimits` before anything else).
"""

from .decode import (
    Container,
    ContainerDecoder,
    DecodedLayer,
    LayerView,
    decode_container,
    extract_layers,
)
from .digests import layer_digest, replica_digest
from .encode import encode_container, encode_container_into, encode_header, iter_container_chunks
from .header import (
    DEFAULT_LIMITS,
    DIGEST_SIZE,
    FIXED_HEADER_SIZE,
    LENGTH_ENTRY_SIZE,
    MAGIC,
    VERSION,
    BytesLike,
    ContainerHeader,
    ContainerLimits,
    SectionGeometry,
)

__all__ = [
    "BytesLike",
    "Container",
    "ContainerDecoder",
    "ContainerHeader",
    "ContainerLimits",
    "DEFAULT_LIMITS",
    "DIGEST_SIZE",
    "DecodedLayer",
    "FIXED_HEADER_SIZE",
    "LENGTH_ENTRY_SIZE",
    "LayerView",
    "MAGIC",
    "SectionGeometry",
    "VERSION",
    "decode_container",
    "encode_container",
    "encode_container_into",
    "encode_header",
    "extract_layers",
    "iter_container_chunks",
    "layer_digest",
    "replica_digest",
]
