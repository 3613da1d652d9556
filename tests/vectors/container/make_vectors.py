"""Generate the pinned KVB1 container vectors (kvsp-draft §4.3).

Run once from this directory: ``python make_vectors.py``. The vectors are committed; this
script is committed with them to show how they were made. It deliberately does not import
kvsp_moq: every octet is laid out here with ``struct`` and every digest computed with
``hashlib``, straight from the text of §4.3, so that the vectors check the implementation
instead of echoing it.

Element values (kvsp-layout-1: row-major [token][kv_head][dim], little-endian):

- fp16 / bf16 / fp32: value = layer + section/2 + token/4 + head/8 + dim/16, where layer is
  the absolute layer index and section is 0 for K, 1 for V (exact in every one of these types
  for the ranges used); bf16 is the upper 16 bits of the fp32 encoding.
- int8 / fp8-*: the octet (layer*37 + section*101 + token*13 + head*7 + dim) mod 256.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8-e4m3": 1, "fp8-e5m2": 1}


def element(dtype: str, layer: int, section: int, t: int, h: int, d: int) -> bytes:
    if ITEMSIZE[dtype] == 1:
        return bytes([(layer * 37 + section * 101 + t * 13 + h * 7 + d) % 256])
    value = layer + section / 2 + t / 4 + h / 8 + d / 16
    if dtype == "fp32":
        return struct.pack("<f", value)
    if dtype == "fp16":
        return struct.pack("<e", value)
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    assert bits & 0xFFFF == 0, "value not exact in bf16"
    return struct.pack("<H", bits >> 16)


def section(dtype: str, layer: int, which: int, tokens: int, kv_heads: int, head_dim: int) -> bytes:
    return b"".join(
        element(dtype, layer, which, t, h, d)
        for t in range(tokens)
        for h in range(kv_heads)
        for d in range(head_dim)
    )


def header(codec: int, first: int, tokens: int, lengths: list[tuple[int, int]],
           magic: bytes = b"KVB1", version: int = 1, flags: int = 0,
           layer_count: int | None = None) -> bytes:
    count = len(lengths) if layer_count is None else layer_count
    fixed = struct.pack(">4sBBHIII", magic, version, flags, codec, first, count, tokens)
    return fixed + b"".join(struct.pack(">QQ", k_len, v_len) for k_len, v_len in lengths)


VALID = [
    # name, dtype, first_layer, layer_count, tokens, kv_heads, head_dim
    ("raw-fp16-3layers", "fp16", 0, 3, 2, 2, 4),
    ("raw-bf16-range", "bf16", 5, 2, 3, 1, 2),
    ("raw-fp32-1layer", "fp32", 31, 1, 1, 2, 2),
    ("raw-int8-zero-tokens", "int8", 0, 2, 0, 1, 1),
    ("raw-fp8-e4m3-4layers", "fp8-e4m3", 2, 4, 4, 1, 8),
]


def make_valid(name: str, dtype: str, first: int, count: int, tokens: int,
               kv_heads: int, head_dim: int) -> dict[str, object]:
    layers = [
        (section(dtype, layer, 0, tokens, kv_heads, head_dim),
         section(dtype, layer, 1, tokens, kv_heads, head_dim))
        for layer in range(first, first + count)
    ]
    lengths = [(len(k), len(v)) for k, v in layers]
    data = header(1, first, tokens, lengths) + b"".join(k + v for k, v in layers)
    (HERE / f"{name}.bin").write_bytes(data)
    digests = [hashlib.sha256(k + v).digest() for k, v in layers]
    return {
        "name": name,
        "file": f"{name}.bin",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "header": {
            "version": 1, "flags": 0, "codec": 1, "first_layer": first, "layer_count": count,
            "token_count": tokens, "lengths": lengths,
            "header_size": 20 + 16 * count,
        },
        "geometry": {"kv_heads": kv_heads, "head_dim": head_dim, "kv_dtype": dtype},
        "layer_digests": [d.hex() for d in digests],
        "replica_digest": hashlib.sha256(b"".join(digests)).hexdigest(),
    }


def make_invalid() -> list[dict[str, object]]:
    sec = 2 * 1 * 2 * 2  # fp16, 2 tokens, 1 kv_head, head_dim 2: 8 octets
    good_lengths = [(sec, sec), (sec, sec)]
    body = bytes(range(4 * sec))
    good = header(1, 0, 2, good_lengths) + body
    geometry = {"kv_heads": 1, "head_dim": 2, "kv_dtype": "fp16"}
    cases: list[tuple[str, bytes, str, dict[str, object] | None]] = [
        ("bad-magic", header(1, 0, 2, good_lengths, magic=b"KVB2") + body, "magic", None),
        ("bad-magic-short", b"KVX", "magic", None),
        ("version-2", header(1, 0, 2, good_lengths, version=2) + body, "version", None),
        ("flags-nonzero", header(1, 0, 2, good_lengths, flags=0x80) + body, "flags", None),
        ("codec-unregistered", header(0x7FFF, 0, 2, good_lengths) + body, "codec", None),
        ("codec-zero", header(0, 0, 2, good_lengths) + body, "codec", None),
        ("layer-count-zero", header(1, 0, 2, []), "layer_count", None),
        ("layer-range-overflow", header(1, 0xFFFFFFFF, 2, good_lengths) + body,
         "first_layer", None),
        ("layer-count-over-limit", header(1, 0, 2, [], layer_count=4097), "layer_count", None),
        ("layer-count-max-uint32", header(1, 0, 2, [], layer_count=0xFFFFFFFF),
         "layer_count", None),
        ("token-count-over-limit", header(1, 0, (1 << 24) + 1, good_lengths) + body,
         "token_count", None),
        ("section-over-limit", header(1, 0, 2, [(sec, (1 << 34) + 1), (sec, sec)]) + body,
         "lengths", None),
        ("section-2-63", header(1, 0, 2, [(1 << 63, sec), (sec, sec)]) + body, "lengths", None),
        ("section-2-64-minus-1", header(1, 0, 2, [(sec, sec), (sec, (1 << 64) - 1)]) + body,
         "lengths", None),
        ("truncated-header", good[:13], "truncated", None),
        ("truncated-lengths", good[:20 + 16 + 5], "truncated", None),
        ("truncated-data", good[:-1], "truncated", None),
        ("empty", b"", "truncated", None),
        ("trailing", good + b"\x00", "trailing", None),
        ("geometry-k-length",
         header(1, 0, 2, [(sec + 2, sec + 2), (sec, sec)]) + bytes(4 * sec + 4),
         "lengths", geometry),
        ("geometry-k-ne-v", header(1, 0, 2, [(sec, sec - 2), (sec, sec)]) + bytes(4 * sec - 2),
         "lengths", geometry),
        # K right, V wrong for the geometry (so also K != V).
        ("geometry-v-length", header(1, 0, 2, [(sec, sec), (sec, sec + 2)]) + bytes(4 * sec + 2),
         "lengths", geometry),
    ]
    out = []
    for name, data, field, geom in cases:
        (HERE / f"invalid-{name}.bin").write_bytes(data)
        entry: dict[str, object] = {"name": name, "file": f"invalid-{name}.bin", "field": field}
        if geom is not None:
            entry["geometry"] = geom
        out.append(entry)
    return out


def main() -> None:
    vectors = {
        "spec": "kvsp-draft §4.3 (KVB1), generated by make_vectors.py with struct + hashlib",
        "element_formula": {
            "float": "layer + section/2 + token/4 + head/8 + dim/16 (section 0=K, 1=V)",
            "octet": "(layer*37 + section*101 + token*13 + head*7 + dim) mod 256",
        },
        "valid": [make_valid(*v) for v in VALID],
        "invalid": make_invalid(),
    }
    (HERE / "container.json").write_text(json.dumps(vectors, indent=1) + "\n")


if __name__ == "__main__":
    main()
