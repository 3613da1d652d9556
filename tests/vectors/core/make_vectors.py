"""Generate the pinned KVSP core vectors with hashlib/hmac/json only (never kvsp_moq).

Run once: python tests/vectors/core/make_vectors.py. The outputs are committed; the tests
compare the code under test against them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
from pathlib import Path

HERE = Path(__file__).parent

DESCRIPTORS = {
    "llama-like": {
        "model": "example/llama-3-8b",
        "model_digest": "sha-256:" + hashlib.sha256(b"weights").hexdigest(),
        "tokenizer_digest": "sha-256:" + hashlib.sha256(b"tokenizer").hexdigest(),
        "layers": 32, "kv_heads": 8, "head_dim": 128,
        "kv_dtype": "bf16", "positional": "rope;theta=500000", "block_tokens": 16,
        "layout": "kvsp-layout-1",
    },
    "with-adapters": {
        "model": "tiny",
        "model_digest": "sha-256:" + hashlib.sha256(b"w").hexdigest(),
        "tokenizer_digest": "sha-256:" + hashlib.sha256(b"t").hexdigest(),
        "adapters": ["sha-256:" + hashlib.sha256(b"a1").hexdigest(),
                     "sha-256:" + hashlib.sha256(b"a2").hexdigest()],
        "layers": 4, "kv_heads": 2, "head_dim": 64,
        "kv_dtype": "fp16", "positional": "none", "block_tokens": 256,
        "layout": "kvsp-layout-1",
        "ñ-unknown-member": "non-ASCII key sorts by UTF-16 code unit",
    },
}


def jcs_simple(doc: dict) -> bytes:
    # For objects of strings, integers and arrays, RFC 8785 equals sorted keys (UTF-16 order,
    # which for these BMP keys is code point order), no whitespace, UTF-8 without escapes.
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def main() -> None:
    out: dict = {"descriptors": {}, "scopes": [], "block_keys": [], "namespaces": []}
    for name, doc in DESCRIPTORS.items():
        cid = hashlib.sha256(b"KVSP-COMPAT-1\x00" + jcs_simple(doc)).hexdigest()
        out["descriptors"][name] = {"descriptor": doc, "compat_id": cid}
    scope_key = bytes(range(32))
    out["scopes"].append({"scope_key": scope_key.hex(),
                          "scope_id": hashlib.sha256(b"KVSP-SCOPE-1\x00" + scope_key).digest()[:16].hex()})
    compat = bytes.fromhex(out["descriptors"]["llama-like"]["compat_id"])
    tokens = [(i * 7919) % 128256 for i in range(16 * 5 + 3)] + [0xFFFFFFFF]
    prev = bytes(32)
    keys = []
    for i in range(len(tokens) // 16):
        block = tokens[i * 16:(i + 1) * 16]
        msg = b"KVSP-BLOCK-1\x00" + compat + prev + struct.pack(">16I", *block)
        prev = hmac.new(scope_key, msg, hashlib.sha256).digest()
        keys.append(prev.hex())
    out["block_keys"].append({"scope_key": scope_key.hex(), "compat_id": compat.hex(),
                              "block_tokens": 16, "tokens": tokens, "keys": keys})
    fields = [b"kvsp-1", compat, bytes.fromhex(out["scopes"][0]["scope_id"]),
              bytes.fromhex(keys[0]), bytes(range(16))]
    raw = b"".join(bytes([len(f)]) + f for f in fields)
    out["namespaces"].append({"fields": [f.hex() for f in fields],
                              "moqt_namespace": base64.urlsafe_b64encode(raw).rstrip(b"=").decode()})
    (HERE / "core.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
