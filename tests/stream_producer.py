"""A faulty prefill→decode producer, a process of its own (tests/test_vllm_disagg.py).

``python tests/stream_producer.py SPEC_JSON``: attaches a ``MoqtHolder`` to the relay as a
publisher and publishes the blocks SPEC names under their stream replica ids (binding §6.1),
random KV of the engine's geometry, then does its fault:

- ``"flip"``: every block complete, one bit of layer ``flip_layer`` flipped in the store
  after its digest was computed (the objects' LAYER_DIGEST are the true bytes'); then the
  blocks are published (a consumer's SUBSCRIBE finds them complete and FETCHes them);
- ``"half"``: each block begun and published live, its first ``half`` layers written (sent
  to the subscribers as they are stored); then it prints ``half`` and waits to be killed
  (the test SIGKILLs it: a prefill engine dying mid-stream).

It prints ``attached`` once the relay accepted its session, and ``published`` / ``half`` when
its part is done; it exits when its stdin closes.

SPEC: {"relay_url", "ca_file", "compat_id", "scope_id", "block_keys": [hex], "stream_id",
"layers", "kv_heads", "head_dim", "kv_dtype", "tokens", "fault", "flip_layer", "half"}.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from kvsp_moq.bridge import MoqtHolder
from kvsp_moq.control.common.tls import TlsConfig
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.integrations.vllm.stream import stream_replica_id
from kvsp_moq.storage import BlockStore, HostTier, RecordKey


async def main(spec: dict) -> None:
    geometry = Geometry.from_descriptor_fields(spec["kv_heads"], spec["head_dim"], spec["kv_dtype"])
    store = BlockStore([HostTier(256 << 20, name="host")])
    holder = MoqtHolder(store)
    transport = TlsConfig().transport(ca_file=spec["ca_file"], purpose="the test's producer")
    await holder.attach_relay(spec["relay_url"], transport)
    print("attached", flush=True)
    stream_id = bytes.fromhex(spec["stream_id"])
    rng = np.random.default_rng(7)
    layers, tokens = int(spec["layers"]), int(spec["tokens"])
    shape = (tokens, geometry.kv_heads, geometry.head_dim)
    keys = [RecordKey(bytes.fromhex(spec["compat_id"]), bytes.fromhex(spec["scope_id"]), bytes.fromhex(k))
            for k in spec["block_keys"]]

    def kv() -> tuple[np.ndarray, np.ndarray]:
        return (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))

    if spec["fault"] == "flip":
        for key in keys:
            writer = store.begin(key, geometry, layers, tokens, replica_id=stream_replica_id(stream_id, key))
            for layer in range(layers):
                writer.write_layer(layer, *kv())
            writer.finish()
            payload = store.layer_payload(key, int(spec["flip_layer"]), touch=False).obj
            payload[len(payload) // 2] ^= 0x10
            holder.publish(key)
        await holder.wait_announced(30)
        print("published", flush=True)
    else:
        for key in keys:
            writer = holder.begin(key, geometry, layers, tokens, replica_id=stream_replica_id(stream_id, key))
            for layer in range(int(spec["half"])):
                writer.write_layer(layer, *kv())
        await holder.wait_announced(30)
        print("half", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await holder.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
