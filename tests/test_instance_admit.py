"""``POST {ii}sessions`` (§6.5): ``resident`` counts the leading blocks of the prompt this
instance holds *complete*. A block still landing (a prefetch or a MOQT load writing it layer
by layer through a ``BlockWriter``) is in the store but cannot serve the prefix yet: it ends
the resident run. A real instance on 127.0.0.1 with its own BlockStore; no mocks."""

from __future__ import annotations

import uuid

from test_instance_support import BLOCK_TOKENS, COMPAT, SCOPE_A, bkey, call, instance_service, world

from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.storage import RecordKey

LAYERS = 4
SECTION = bytes(BLOCK_TOKENS * 2 * 8 * 2)  # fp16, 2 KV heads x 8 dims (the suite's descriptor)


async def test_a_block_still_landing_is_not_resident() -> None:
    async with world(holders=0) as w:
        ii = await w.start_instance()
        store = instance_service(ii).store
        geometry = Geometry.from_descriptor_fields(2, 8, "fp16")

        def begin(i: int):
            return store.begin(RecordKey(COMPAT, SCOPE_A, bkey(i)), geometry, LAYERS, BLOCK_TOKENS)

        whole = begin(1)
        for layer in range(LAYERS):
            whole.write_layer(layer, SECTION, SECTION)
        landing = begin(2)
        landing.write_layer(0, SECTION, SECTION)  # one layer of four so far

        async def resident() -> int:
            body = {"session": str(uuid.uuid4()), "scope_id": SCOPE_A.hex(), "compat_id": COMPAT.hex(),
                    "block_keys": [bkey(i).hex() for i in (1, 2, 3)]}
            reply = await call(w.session, "POST", f"{ii.url}sessions", who="client-a", body=body)
            assert reply.status == 201, reply.json
            return int(reply.json["resident"])

        assert store.get(RecordKey(COMPAT, SCOPE_A, bkey(2))) is not None  # in the store...
        assert await resident() == 1  # ... but not resident while it lands
        for layer in range(1, LAYERS):
            landing.write_layer(layer, SECTION, SECTION)
        assert await resident() == 2  # complete now; block 3 is not here
