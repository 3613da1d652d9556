"""``kvsp bench container``: KVB1 decode + digests (kvsp-draft §4.3) against SHA-256 alone.

Workload: one block of 32 layers, each 1 MiB (K and V sections of 512 KiB), codec raw.
Figures, in GB/s of container bytes:

- ``container_decode_digest``: :func:`decode_container` on the whole buffer, every layer
  digest and the replica digest;
- ``container_incremental_64k``: the incremental :class:`ContainerDecoder` fed 64 KiB chunks
  (how bytes arrive from a transport), digests included.

Baseline, same run: ``hashlib_sha256`` — ``hashlib.sha256`` over the same container bytes,
one pass. Decoding must hash every layer (§4.3), so this is the floor: the ratio is the share
of the decoder's time that is the hashing it cannot avoid (target >= 0.8, issue 9).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..kvsp.container import ContainerDecoder, decode_container, encode_container
from ..kvsp.registries import CODEC_RAW
from .report import Figure, best_seconds

CHUNK = 64 * 1024


def _block(layers: int, layer_bytes: int) -> bytes:
    rng = np.random.default_rng(7)
    half = layer_bytes // 2
    payload = rng.integers(0, 256, size=layers * 2 * half, dtype=np.uint8).tobytes()
    view = memoryview(payload)
    sections = [(view[(2 * i) * half:(2 * i + 1) * half], view[(2 * i + 1) * half:(2 * i + 2) * half])
                for i in range(layers)]
    return encode_container(CODEC_RAW.value, 0, half // 2, sections)


def run(layers: int = 32, layer_bytes: int = 1 << 20, repeat: int = 5) -> list[Figure]:
    data = _block(layers, layer_bytes)
    size = len(data)

    def whole() -> bytes:
        box = decode_container(data)
        box.layer_digests()
        return box.replica_digest()

    def incremental() -> bytes:
        dec = ContainerDecoder()
        view = memoryview(data)
        for off in range(0, size, CHUNK):
            dec.feed(view[off:off + CHUNK])
        dec.finish()
        return dec.replica_digest()

    if whole() != incremental():
        raise AssertionError("whole and incremental decoding disagree")
    base = size / best_seconds(lambda: hashlib.sha256(data).digest(), repeat) / 1e9
    params: dict[str, object] = {"layers": layers, "layer_bytes": layer_bytes, "container_bytes": size}
    return [
        Figure("container_decode_digest", "GB/s", size / best_seconds(whole, repeat) / 1e9,
               "hashlib_sha256", base, params=params),
        Figure("container_incremental_64k", "GB/s", size / best_seconds(incremental, repeat) / 1e9,
               "hashlib_sha256", base, params=params | {"chunk": CHUNK}),
    ]
