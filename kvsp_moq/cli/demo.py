"""``kvsp demo``: the main job.

Today it walks through the KVSP core end to end on generated data (the networked roles —
index, holder, relay, instances over MOQT — join as they land):

1. writes a tiny model's weight and tokenizer files, derives ``model_digest`` and
   ``tokenizer_digest`` and the Compatibility ID (§4.1);
2. computes the Block Keys of two prompts sharing a system prompt and finds the shared prefix (§4.2);
3. packs the KV of each shared block into a KVB1 container and publishes a Replica Record
   (§4.3, §4.4), naming it for MOQT (binding v1);
4. streams each container through the incremental decoder in network-sized chunks, checking
   every layer against the record as it completes, then fetches a layer range;
5. flips one byte in a copy and shows the tampering is caught.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..kvsp import compat, container, layout, scope
from ..kvsp.blockkeys import BlockKeyChain
from ..kvsp.errors import KvspError
from ..kvsp.hexids import format_digest
from ..kvsp.naming import BlockName
from ..kvsp.records import ReplicaRecord

SYSTEM_PROMPT = ("You are a careful assistant. Answer briefly, cite sources, and never invent facts. " * 6)
CHUNK = 1452  # one QUIC datagram's worth of payload at a 1500-byte MTU


def _progress(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[demo] {message}", file=sys.stderr, flush=True)


def _descriptor(workdir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(2026)
    for shard in range(2):
        (workdir / f"model-{shard:05d}.bin").write_bytes(rng.standard_normal(64 * 1024, dtype=np.float32).tobytes())
    (workdir / "tokenizer.json").write_text(json.dumps({"type": "byte-level", "vocab_size": 256}))
    return {
        "model": "kvsp-demo-tiny",
        "model_digest": compat.model_digest([workdir / "model-00000.bin", workdir / "model-00001.bin"]),
        "tokenizer_digest": compat.tokenizer_digest(workdir / "tokenizer.json"),
        "layers": 4, "kv_heads": 2, "head_dim": 64, "kv_dtype": "fp16",
        "positional": "rope;theta=10000", "block_tokens": 64, "layout": "kvsp-layout-1",
    }


def _kv_block(rng: np.random.Generator, geometry: layout.Geometry, layers: int, tokens: int) -> bytes:
    shape = geometry.shape(tokens)
    kv = [(rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16))
          for _ in range(layers)]
    return layout.encode_raw_block(kv, geometry)


def _record(box: bytes, desc: dict[str, Any], cid: bytes, sid: bytes, key: bytes) -> ReplicaRecord:
    decoded = container.decode_container(box)
    digests = decoded.layer_digests()
    name = BlockName.new_replica(cid, sid, key)
    return ReplicaRecord.from_json({
        "block_key": key.hex(), "compat_id": cid.hex(), "scope_id": sid.hex(),
        "holder": "moqt://127.0.0.1:4443/kvsp", "moqt_namespace": name.moqt_namespace(),
        "codec": 1, "size": len(box), "digest": format_digest(container.replica_digest(digests)),
        "layer_digests": [d.hex() for d in digests],
        "residency": [{"tier": "host", "layers": [0, desc["layers"] - 1]}], "ttl_ms": 600000,
    })


def _stream_and_verify(box: bytes, record: ReplicaRecord) -> int:
    """Feed the container in datagram-sized chunks; check each layer the moment it completes."""
    assert record.layer_digests is not None
    decoder = container.ContainerDecoder()
    view = memoryview(box)
    verified = 0
    for off in range(0, len(box), CHUNK):
        for layer in decoder.feed(view[off:off + CHUNK]):
            if layer.digest != record.layer_digests[layer.index]:
                raise KvspError(f"layer {layer.index} does not match the record")
            verified += 1
    decoder.finish()
    if decoder.replica_digest() != record.digest:
        raise KvspError("replica digest does not match the record")
    return verified


def run(show_progress: bool = True) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvsp-demo-") as tmp:
        desc = _descriptor(Path(tmp))
    cid = compat.compat_id(desc)
    _progress(show_progress, f"model digest {desc['model_digest'][:23]}..., compat_id {cid.hex()[:16]}...")
    scope_key = os.urandom(32)
    sid = scope.scope_id(scope_key)
    b = desc["block_tokens"]
    prompts = [SYSTEM_PROMPT + "What is KVSP?", SYSTEM_PROMPT + "Summarize MOQT in one line."]
    keys = []
    for text in prompts:
        chain = BlockKeyChain(scope_key, cid, b)
        keys.append(chain.extend(text.encode()))
    shared = next((i for i, (x, y) in enumerate(zip(*keys)) if x != y), min(map(len, keys)))
    _progress(show_progress, f"prompt blocks {len(keys[0])} and {len(keys[1])}, shared prefix {shared} blocks")

    geometry = layout.Geometry.from_descriptor_fields(desc["kv_heads"], desc["head_dim"], desc["kv_dtype"])
    rng = np.random.default_rng(1)
    blocks = [_kv_block(rng, geometry, desc["layers"], b) for _ in range(shared)]
    records = [_record(box, desc, cid, sid, key) for box, key in zip(blocks, keys[0])]
    layers_verified = sum(_stream_and_verify(box, rec) for box, rec in zip(blocks, records))
    _progress(show_progress, f"streamed {len(blocks)} containers in {CHUNK}-byte chunks, "
                             f"{layers_verified} layers verified as they completed")

    partial = container.decode_container(container.extract_layers(blocks[0], 1, 2))
    assert records[0].layer_digests is not None
    range_ok = partial.layer_digests() == list(records[0].layer_digests[1:3])
    tampered = bytearray(blocks[0])
    tampered[-1] ^= 0x01
    try:
        _stream_and_verify(bytes(tampered), records[0])
        tamper_detected = False
    except KvspError:
        tamper_detected = True
    _progress(show_progress, f"layer range 1-2 verified: {range_ok}; tampered byte detected: {tamper_detected}")
    return {
        "compat_id": cid.hex(),
        "scope_id": sid.hex(),
        "prompt_blocks": [len(k) for k in keys],
        "shared_blocks": shared,
        "containers": len(blocks),
        "container_bytes": sum(map(len, blocks)),
        "layers_verified": layers_verified,
        "layer_range_verified": range_ok,
        "tamper_detected": tamper_detected,
        "moqt_namespace": records[0].moqt_namespace,
        "seconds": round(time.perf_counter() - started, 3),
        "ok": bool(range_ok and tamper_detected and layers_verified == shared * desc["layers"]),
    }


def _print_report(report: dict[str, Any]) -> None:
    print("kvsp demo — the KVSP core end to end (networked roles join in later releases)")
    width = max(map(len, report))
    for key, value in report.items():
        print(f"  {key.ljust(width)}  {value}")


def cmd_demo(args: argparse.Namespace) -> int:
    report = run(show_progress=not args.json)
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("demo", help="run the main job end to end with embedded defaults")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(handler=cmd_demo)
