"""Codec policy (DESIGN.md §10: lossy codecs only where a scope's policy allows them): the
policy object, its TOML form, and the instance's prefetch honouring it against a real IS, a
real transcoding holder (§6.7 ``codec=n``) and real instances: a scope configured for
fp8-e4m3 loads and publishes an fp8 replica (its record says the codec); an instance without
that policy neither asks for fp8 nor takes the lossy replica as a source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from typing import cast

from kvsp_moq.control.client.http import HttpBlockFetcher, HttpIndexClient
from kvsp_moq.control.client.retrieval import BlockFetcher
from kvsp_moq.control.common.config import ControlConfig, HolderConfig, TierConfig, config_from_mapping
from kvsp_moq.control.common.errors import ConfigError
from kvsp_moq.control.holder.serve import HOLDER_SERVICE, serve_holder
from kvsp_moq.control.engine.loader import PrefixLoader
from kvsp_moq.kvsp.codecs import decode_block, encode_block
from kvsp_moq.kvsp.codecs.policy import CodecPolicy
from kvsp_moq.kvsp.errors import RecordError
from kvsp_moq.kvsp.layout import Geometry
from kvsp_moq.kvsp.registries import CODECS_BY_NAME
from kvsp_moq.storage import BlockStore, HostTier, RecordKey
from test_instance import directive, post, wait_done
from test_instance_support import AUTH, BLOCK_TOKENS, COMPAT, DESCRIPTOR, SCOPE_A, SCOPE_B, TOKENS, bkey, call, instance_service, world

FP8 = CODECS_BY_NAME["fp8-e4m3"]
PLANES = CODECS_BY_NAME["zstd-planes"]


def test_policy_chooses_lossy_only_where_configured() -> None:
    policy = CodecPolicy.from_mapping({"scopes": {SCOPE_A.hex(): "fp8-e4m3"}, "classes": {"batch": "int8"},
                                       "lossless": "zstd-planes"})
    assert policy.choose(SCOPE_A).codec == FP8 and policy.choose(SCOPE_A).lossy
    assert policy.choose(SCOPE_A, "batch").codec == CODECS_BY_NAME["int8"]  # the class wins
    assert policy.choose(SCOPE_B).codec == PLANES and not policy.choose(SCOPE_B).lossy
    assert policy.accepts(FP8.value, SCOPE_A) and not policy.accepts(FP8.value, SCOPE_B)
    assert policy.accepts(PLANES.value, SCOPE_B) and policy.accepts(1, SCOPE_B)
    default = CodecPolicy()
    assert default.choose(SCOPE_A).codec is None and not default.accepts(FP8.value, SCOPE_A)
    for bad, member in (({"scopes": {"zz": "fp8-e4m3"}}, "codec_policy.scopes"),
                        ({"scopes": {SCOPE_A.hex(): "fp9"}}, f"codec_policy.scopes.{SCOPE_A.hex()}"),
                        ({"lossless": "int8"}, "lossless"), ({"codecs": {}}, "codec_policy.codecs")):
        with pytest.raises(RecordError) as info:
            CodecPolicy.from_mapping(bad)
        assert info.value.member == member


def test_instance_config_reads_the_policy(tmp_path: Path) -> None:
    doc = {"instance": {"codec_policy": {"scopes": {SCOPE_A.hex(): "fp8-e4m3"}}}}
    config = config_from_mapping(json.loads(json.dumps(doc)), base_dir=tmp_path)
    assert config.instance.codec_policy.choose(SCOPE_A).codec == FP8
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"instance": {"codec_policy": {"scopes": {SCOPE_A.hex(): "nope"}}}}, base_dir=tmp_path)
    assert info.value.key == f"instance.codec_policy.scopes.{SCOPE_A.hex()}"


def _block() -> bytes:
    geo = Geometry.from_descriptor_fields(DESCRIPTOR["kv_heads"], DESCRIPTOR["head_dim"], DESCRIPTOR["kv_dtype"])
    rng = np.random.default_rng(7)
    shape = geo.shape(BLOCK_TOKENS)
    return encode_block("raw", [(rng.normal(0, 1, shape).astype(np.float16), rng.normal(0, 1, shape).astype(np.float16))
                                for _ in range(DESCRIPTOR["layers"])], geo)


async def test_prefetch_honours_the_scope_policy() -> None:
    async with world(holders=0) as w:
        hc = HolderConfig(index_url=w.index.url, index_token=TOKENS["holder-svc"], tiers=(TierConfig("host", 1 << 20),),
                          descriptors=(DESCRIPTOR,))
        holder = await w.stack.enter_async_context(await serve_holder(ControlConfig(auth=AUTH, holder=hc), clock=w.clock))
        key = RecordKey(COMPAT, SCOPE_A, bkey(0))
        put = await call(w.session, "PUT", f"{holder.url}blocks/{key.path}", who="holder-svc", body=_block(),
                         content_type="application/kvsp-block", extra={"If-None-Match": "*"})
        assert put.status == 201, put.body

        lossy = await w.start_instance(codec_policy=CodecPolicy.from_mapping({"scopes": {SCOPE_A.hex(): "fp8-e4m3"}}))
        body = directive([(0, [holder.url])])
        await post(w, lossy.url, body)
        assert (await wait_done(w, lossy, body["directive"]))["state"] == "complete"
        stored = instance_service(lossy).store.get(key)
        assert stored is not None and stored.codec == FP8.value
        assert holder.app[HOLDER_SERVICE].metrics.transcodes.labels(str(FP8.value))._value.get() == 1
        listed = await call(w.session, "GET", f"{w.index.url}replicas/{key.path}", who="holder-svc")
        codecs = {r["holder"]: r["codec"] for r in listed.json["replicas"]}
        assert codecs == {holder.url: 1, lossy.url: FP8.value}  # the record says the codec

        plain = await w.start_instance(epoch=2)  # no policy: never lossy
        only_lossy = directive([(0, [lossy.url])])
        await post(w, plain.url, only_lossy)
        refused = await wait_done(w, plain, only_lossy["directive"])
        assert refused["state"] == "failed" and "lossy codec 65281" in refused["error"]
        from_holder = directive([(0, [holder.url])])
        await post(w, plain.url, from_holder)
        assert (await wait_done(w, plain, from_holder["directive"]))["state"] == "complete"
        got = instance_service(plain).store.get(key)
        assert got is not None and got.codec == 1
        assert holder.app[HOLDER_SERVICE].metrics.transcodes.labels(str(FP8.value))._value.get() == 1


        # The instance engine's prefix loader (control/engine/loader.py) honours the policy
        # too: the lossy instance's local fp8 replica is used only under the policy naming
        # fp8 (decoded, within e4m3's bound), and from the IS, whose records list the raw
        # holder and the lossy instance, a loader without that policy takes the raw one.
        geo = Geometry.from_descriptor_fields(DESCRIPTOR["kv_heads"], DESCRIPTOR["head_dim"], DESCRIPTOR["kv_dtype"])
        fetcher = HttpBlockFetcher(TOKENS["inst"])
        index = HttpIndexClient(w.index.url, TOKENS["inst"])
        try:
            def loader(store: BlockStore, policy: CodecPolicy | None, with_index: bool) -> PrefixLoader:
                return PrefixLoader(store=store, index=index if with_index else None, fetcher=cast(BlockFetcher, fetcher),
                                    pool=None, geometry=geo, layers=DESCRIPTOR["layers"], block_tokens=BLOCK_TOKENS,
                                    self_url="", to_tensors=lambda layer, k, v: (k, v), codec_policy=policy)

            lossy_store = instance_service(lossy).store
            assert (await loader(lossy_store, None, False).plan([key], 1)).blocks == []
            (local,) = (await loader(lossy_store, instance_service(lossy).prefetch.codec_policy, False).plan([key], 1)).blocks
            assert local.layers is not None
            original = decode_block(_block(), geo)
            for (k, v), (dk, dv) in zip(original, local.layers, strict=True):
                for x, y in ((k, dk), (v, dv)):
                    a, b = x.view(np.float16).astype(np.float64), np.asarray(y).view(np.float16).astype(np.float64)
                    assert (np.abs(a - b) <= np.abs(a) * (2.0**-4 + 2.0**-10) + np.abs(a).max() * 2.0**-10).all()
            (remote,) = (await loader(BlockStore([HostTier(1 << 20)]), None, True).plan([key], 1)).blocks
            assert remote.holder == holder.url  # never the lossy instance's replica
        finally:
            await fetcher.close()
            await index.close()
