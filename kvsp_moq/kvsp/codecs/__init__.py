"""KVSP codecs (kvsp-draft §4.3 "Other codecs ... define their own section encoding";
docs/container.md "Codecs"): each turns one layer's K and V, given in kvsp-layout-1 element
type, into a K section and a V section of a KVB1 container, and back.

| codec | value | kind | section |
|---|---|---|---|
| ``raw`` | 0x0001 | reference | kvsp-layout-1 (:mod:`kvsp_moq.kvsp.layout`) |
| ``fp8-e4m3`` | 0xFF01 | lossy | float32 scale per 16-token group and KV head, e4m3fn codes (:mod:`.fp8`) |
| ``int8`` | 0xFF02 | lossy | the same scales, symmetric int8 codes (:mod:`.int8`) |
| ``zstd-planes`` | 0xFF03 | lossless | byte planes in one Zstandard frame (:mod:`.planes`) |

Values 0xFF00-0xFFFF are private use until the registry assigns them. Every decoder
validates what it is given (hostile input): a malformed section raises
:class:`~kvsp_moq.kvsp.errors.ContainerError` naming the field, and no decoder sizes an
allocation from a length the section declares (output sizes come from the geometry and the
container's Token Count). Encoding and decoding are vectorized numpy (and zstd); no torch.
Layer digests of a coded replica are over its coded sections (§4.3).
"""

from .dispatch import (
    LAYER_CODECS,
    LayerCodec,
    RawCodec,
    coded_section_bytes,
    decode_block,
    decode_layer,
    encode_block,
    encode_layer,
    layer_codec,
)
from .fp8 import E4M3_MAX, FP8_E4M3, e4m3_codes, e4m3_values
from .int8 import INT8, INT8_MAX
from .planes import ZSTD_PLANES, PlanesCodec
from .scaled import GROUP_TOKENS, SCALE_MIN, ScaledCodec, group_count

__all__ = [
    "E4M3_MAX",
    "FP8_E4M3",
    "GROUP_TOKENS",
    "INT8",
    "INT8_MAX",
    "LAYER_CODECS",
    "LayerCodec",
    "PlanesCodec",
    "RawCodec",
    "SCALE_MIN",
    "ScaledCodec",
    "ZSTD_PLANES",
    "coded_section_bytes",
    "decode_block",
    "decode_layer",
    "e4m3_codes",
    "e4m3_values",
    "encode_block",
    "encode_layer",
    "group_count",
    "layer_codec",
]
