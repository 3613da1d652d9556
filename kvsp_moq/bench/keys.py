"""``kvsp bench keys``: Block Keys/s (kvsp-draft §4.2) against a bare HMAC loop.

Workload: a 131072-token prompt, B = 16 (8192 keys). The baseline is the least work that
yields the same keys: a Python loop of one-shot ``hmac.digest`` calls over tokens already
packed as big-endian uint32 — no validation, no chain object. The measured code takes the
tokens as integers, validates them and packs them itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import numpy as np

from ..kvsp.blockkeys import block_keys
from .report import Figure, best_seconds


def _bare_hmac_loop(scope_key: bytes, compat_id: bytes, packed: bytes, block_tokens: int) -> list[bytes]:
    label = b"KVSP-BLOCK-1\x00" + compat_id
    step = 4 * block_tokens
    prev = bytes(32)
    keys = []
    for offset in range(0, len(packed) - len(packed) % step, step):
        prev = hmac.digest(scope_key, label + prev + packed[offset:offset + step], "sha256")
        keys.append(prev)
    return keys


def run(tokens: int = 131072, block_tokens: int = 16, repeat: int = 5) -> list[Figure]:
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 128256, size=tokens, dtype=np.int64).tolist()
    scope_key = os.urandom(32)
    compat_id = hashlib.sha256(b"bench descriptor").digest()
    packed = np.asarray(prompt, dtype=">u4").tobytes()
    expected = _bare_hmac_loop(scope_key, compat_id, packed, block_tokens)
    if block_keys(scope_key, compat_id, prompt, block_tokens) != expected:
        raise AssertionError("block_keys disagrees with the bare HMAC loop")
    n = len(expected)
    ours = best_seconds(lambda: block_keys(scope_key, compat_id, prompt, block_tokens), repeat)
    base = best_seconds(lambda: _bare_hmac_loop(scope_key, compat_id, packed, block_tokens), repeat)
    return [Figure("block_keys", "keys/s", n / ours, "bare_hmac_loop", n / base,
                   params={"tokens": tokens, "block_tokens": block_tokens})]
