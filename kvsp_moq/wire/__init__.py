"""Pure wire primitives shared by the MOQT codecs (no I/O).

* :mod:`.buffer` — :class:`Reader` (zero-copy, offset based, raises :class:`BufferUnderflow`)
  and :class:`Writer` (appends to one ``bytearray``).
* :mod:`.varint` — MOQT vi64 (1..9 bytes) and QUIC varints (RFC 9000 §16).
* :mod:`.kvp` — delta-coded Key-Value-Pairs.
* :mod:`.errors` — :class:`WireError` (peer violated the format; carries the session error
  code), :class:`LimitExceeded`, :class:`BufferUnderflow` (need more bytes; not an error),
  and the session / stream-reset code registries.
"""

from .buffer import Buffer, Reader, Writer
from .errors import (
    BufferUnderflow,
    LimitExceeded,
    SessionErrorCode,
    StreamResetCode,
    WireError,
    is_grease,
)
from .kvp import (
    MAX_KVP_VALUE_LENGTH,
    KeyValuePair,
    decode_kvps,
    encode_kvps,
    kvp_formatting_error,
    kvp_get,
    kvp_get_all,
    read_kvps,
    write_kvps,
)
from .varint import (
    QUIC_VARINT_MAX,
    VI64_MAX,
    encode_quic_varint,
    encode_vi64,
    quic_varint_size,
    read_quic_varint,
    read_vi64,
    vi64_length,
    vi64_size,
)

__all__ = [
    "MAX_KVP_VALUE_LENGTH",
    "QUIC_VARINT_MAX",
    "VI64_MAX",
    "Buffer",
    "BufferUnderflow",
    "KeyValuePair",
    "LimitExceeded",
    "Reader",
    "SessionErrorCode",
    "StreamResetCode",
    "WireError",
    "Writer",
    "decode_kvps",
    "encode_kvps",
    "encode_quic_varint",
    "encode_vi64",
    "is_grease",
    "kvp_formatting_error",
    "kvp_get",
    "kvp_get_all",
    "quic_varint_size",
    "read_kvps",
    "read_quic_varint",
    "read_vi64",
    "vi64_length",
    "vi64_size",
    "write_kvps",
]
