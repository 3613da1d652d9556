"""The cached prefix of one request: which prompt blocks are reused and where their KV comes
from (kvsp-draft §6.2 lookup, §6.7 retrieval; binding v1 docs/binding.md §5).

For the Block Keys of a prompt, in prefix order (§4.2: a key names its whole prefix, so the
reusable blocks are always a prefix of them):

1. **local** — blocks the instance's own store holds (computed here earlier, or loaded by a
   prefetch directive, §6.5), read from its tiers;
2. then the IS is asked (``POST lookup``, §6.2) for the rest; for each matched block in order:
   **moqt** — a ``moqt://`` replica (relay or origin) is FETCHed into a
   :class:`~kvsp_moq.sinks.TorchSink`, every layer verified against the record's layer digest
   as it lands (§6.7; binding §4.1). These loads run *while* the prefill computes: the engine
   awaits layer l of every prefix block (:meth:`PrefixPlan.wait_layer`) just before it computes
   layer l of the new tokens (§4.3 "start using layer l as soon as it has been received");
   **http** — otherwise an HTTP holder (``GET blocks/...``: Repr-Digest, layer digests and the
   replica digest verified, §6.7), fetched whole before the prefill;
3. the first block no replica can deliver ends the prefix (a 404 or DOES_NOT_EXIST is a cache
   miss, §6.1); the remaining tokens are recomputed. An IS that cannot be reached, fails or
   does not answer within ``index_timeout_s`` matches nothing: the index is advisory (§6.1),
   the instance recomputes what it cannot look up (docs/reliability.md).

Codecs (``codec_policy``, :mod:`kvsp_moq.kvsp.codecs.policy`): a replica — local or remote —
stored in a lossy codec is used only where the policy names that codec for the scope (else it
is not a source, as if absent); HTTP and local replicas in any other codec are decoded to the
element type (``kvsp.codecs.decode_layer``); MOQT loads take ``raw`` replicas only (the sink
lands raw sections).

A MOQT load that fails (a layer refused, the relay gone, a source silent for
``idle_timeout_s``) is retried over HTTP (:meth:`PrefixPlan.settle`); a block neither
delivers cuts the prefix there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...bridge import BlockLoad, LoadResult, MoqtPool, Source, sink_for_record
from ...kvsp.codecs import decode_layer
from ...kvsp.codecs.policy import CodecPolicy
from ...kvsp.layout import Geometry
from ...kvsp.registries import CODEC_RAW
from ...kvsp.records import LookupRequest, LookupResponse, ReplicaRecord
from ...storage import BlockStore, RecordKey
from ..client.retrieval import BlockFetcher, RetrievalFailed, Retrieved, retrieve_block
from .counters import EngineCounters

__all__ = ["LOCAL", "HTTP", "MOQT", "Lookup", "PrefixBlock", "PrefixLoader", "PrefixPlan"]

log = logging.getLogger(__name__)

LOCAL, MOQT, HTTP = "local", "moqt", "http"


class Lookup(Protocol):
    """The IS as the engine reads it (``client.http.HttpIndexClient``)."""

    async def lookup(self, request: LookupRequest) -> LookupResponse:
        ...


@dataclass
class PrefixBlock:
    """One reused block: its source and, once loaded, its (K, V) torch tensors per layer."""

    index: int
    key: RecordKey
    source: str
    holder: str | None = None
    octets: int = 0
    layers: list[tuple[Any, Any]] | None = None
    #: MOQT only: the load into the sink, running in ``task``.
    load: BlockLoad | None = None
    task: asyncio.Task[LoadResult] | None = None
    #: HTTP replicas of the block (the fallback of a MOQT load).
    http_records: tuple[ReplicaRecord, ...] = ()

    def layer(self, layer: int) -> tuple[Any, Any]:
        if self.layers is not None:
            return self.layers[layer]
        assert self.load is not None
        return self.load.sink.layer(layer)


@dataclass
class PrefixPlan:
    """The reused blocks of one request (a prefix of its Block Keys) and the IS's answer."""

    block_tokens: int
    blocks: list[PrefixBlock] = field(default_factory=list)
    matched: int = 0
    fallbacks: int = 0

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    @property
    def streaming(self) -> bool:
        """Whether some block is still arriving over MOQT (layer-wise prefill applies)."""
        return any(b.load is not None for b in self.blocks)

    async def wait_layer(self, layer: int) -> list[tuple[Any, Any]]:
        """(K, V) of ``layer`` of every prefix block, in prefix order, once all have arrived;
        ``kvsp_moq.sinks.LayerFailed`` when a MOQT load gave up on it."""
        out = []
        for block in self.blocks:
            if block.load is not None:
                out.append(await block.load.wait_for_layer(layer))
            else:
                out.append(block.layer(layer))
        return out

    async def settle(self, loader: PrefixLoader) -> None:
        """After a MOQT failure: let every load end, fetch what failed over HTTP, and cut the
        prefix at the first block still missing (§6.1: a miss, recomputed)."""
        for i, block in enumerate(self.blocks):
            if block.task is None:
                continue
            result = await asyncio.gather(block.task, return_exceptions=True)
            ok = not isinstance(result[0], BaseException) and result[0].complete
            if ok:
                block.layers = [block.load.sink.layer(l) for l in range(loader.layers)]  # type: ignore[union-attr]
            else:
                self.fallbacks += 1
                log.info("block %d: MOQT load failed (%s), trying HTTP", i, result[0])
                fetched = await loader.fetch_http(block.key, block.http_records)
                if fetched is None:
                    self.cut(i)
                    return
                block.source, block.holder, block.octets, block.layers = HTTP, fetched[0], fetched[1], fetched[2]
            block.load, block.task = None, None

    def cut(self, count: int) -> None:
        """Keep only the first ``count`` blocks (cancelling the loads of the others)."""
        for block in self.blocks[count:]:
            if block.task is not None and not block.task.done():
                block.task.cancel()
        del self.blocks[count:]

    async def close(self) -> None:
        tasks = [b.task for b in self.blocks if b.task is not None and not b.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PrefixLoader:
    """Builds a :class:`PrefixPlan` from the store, the IS and the replicas (module notes)."""

    def __init__(
        self,
        *,
        store: BlockStore,
        index: Lookup | None,
        fetcher: BlockFetcher,
        pool: MoqtPool | None,
        geometry: Geometry,
        layers: int,
        block_tokens: int,
        self_url: str,
        to_tensors: Any,
        timeout_s: float = 10.0,
        idle_timeout_s: float | None = None,
        index_timeout_s: float = 10.0,
        counters: EngineCounters | None = None,
        codec_policy: CodecPolicy | None = None,
    ) -> None:
        self.store = store
        #: Which lossy codecs a replica may be in to be used, per scope (``[instance.codec_policy]``).
        self.codec_policy = codec_policy if codec_policy is not None else CodecPolicy()
        self.index = index
        self.fetcher = fetcher
        self.pool = pool
        self.geometry = geometry
        self.layers = layers
        self.block_tokens = block_tokens
        self.self_url = self_url
        #: ``to_tensors(layer, k_array, v_array) -> (K, V)`` torch tensors on the model's device.
        self.to_tensors = to_tensors
        self.timeout_s = timeout_s
        #: A MOQT source silent this long is abandoned for the next one (docs/reliability.md).
        self.idle_timeout_s = idle_timeout_s
        #: The bound on the IS lookup; past it (or with the IS unreachable) nothing is matched.
        self.index_timeout_s = index_timeout_s
        #: Where failed lookups are counted (``lookup_failures``).
        self.counters = counters

    async def plan(self, keys: Sequence[RecordKey], usable: int) -> PrefixPlan:
        """The reusable prefix of at most ``usable`` blocks of ``keys``; MOQT loads started."""
        plan = PrefixPlan(self.block_tokens)
        for i, key in enumerate(keys[:usable]):
            layers = self._local(key)
            if layers is None:
                break
            plan.blocks.append(PrefixBlock(i, key, LOCAL, layers=layers))
        if self.index is not None and keys:
            answer = await self._lookup(keys)
            if answer is not None:
                plan.matched = answer.matched
                await self._remote(plan, keys, usable, answer)
        return plan

    async def _lookup(self, keys: Sequence[RecordKey]) -> LookupResponse | None:
        """``POST {is}lookup`` (§6.2) within ``index_timeout_s``; None when the IS failed or
        did not answer in time: the index is advisory (§6.1), the blocks are recomputed."""
        assert self.index is not None
        first = keys[0]
        request = LookupRequest(scope_id=first.scope_id, compat_id=first.compat_id,
                                block_keys=tuple(k.block_key for k in keys))
        try:
            async with asyncio.timeout(self.index_timeout_s):
                return await self.index.lookup(request)
        except Exception as exc:  # unreachable, timed out, 5xx, a malformed answer: all a miss
            if self.counters is not None:
                self.counters.lookup_failures += 1
            log.warning("lookup at the IS failed (%s: %s): recomputing", type(exc).__name__, exc)
            return None

    def _local(self, key: RecordKey) -> list[tuple[Any, Any]] | None:
        info = self.store.get(key)
        if info is None or not info.complete or info.first_layer != 0 or info.layer_count != self.layers \
                or info.token_count != self.block_tokens or not self.codec_policy.accepts(info.codec, key.scope_id):
            return None
        out = []
        for layer in range(self.layers):
            payload = self.store.layer_payload(key, layer)
            k_len, v_len = info.lengths[layer]
            k, v = decode_layer(info.codec, payload[:k_len], payload[k_len:k_len + v_len], self.geometry,
                                self.block_tokens)
            out.append(self.to_tensors(layer, k, v))
        return out

    async def _remote(self, plan: PrefixPlan, keys: Sequence[RecordKey], usable: int, answer: LookupResponse) -> None:
        http_fetches: list[tuple[PrefixBlock, asyncio.Task[tuple[str, int, list[tuple[Any, Any]]] | None]]] = []
        for i in range(len(plan.blocks), min(usable, answer.matched)):
            records = [r for r in answer.blocks[i].replicas
                       if r.holder != self.self_url and self.codec_policy.accepts(r.codec, keys[i].scope_id)]
            moqt = [r for r in records if r.is_moqt and r.layer_digests is not None and r.codec == CODEC_RAW.value]
            http = tuple(r for r in records if not r.is_moqt)
            block = PrefixBlock(i, keys[i], MOQT if (moqt and self.pool is not None) else HTTP, http_records=http)
            if block.source == MOQT:
                assert self.pool is not None
                sink = sink_for_record(moqt[0], self.geometry, self.block_tokens, backend="torch")
                block.load = BlockLoad(sink, [Source.from_record(r) for r in moqt], pool=self.pool, timeout=self.timeout_s,
                                       idle_timeout=self.idle_timeout_s)
                block.task = asyncio.get_running_loop().create_task(block.load.run(), name=f"moqt load block {i}")
                block.holder = moqt[0].holder
                block.octets = sum(2 * self.geometry.section_bytes(self.block_tokens) for _ in range(self.layers))
            elif http:
                http_fetches.append((block, asyncio.get_running_loop().create_task(self.fetch_http(keys[i], http))))
            else:
                break
            plan.blocks.append(block)
        # HTTP-only blocks are fetched whole, concurrently; the first that failed cuts the prefix.
        for block, task in http_fetches:
            fetched = await task
            if fetched is None:
                plan.cut(plan.blocks.index(block))
                for _, rest in http_fetches:
                    rest.cancel()
                await asyncio.gather(*(t for _, t in http_fetches), return_exceptions=True)
                return
            block.holder, block.octets, block.layers = fetched

    async def fetch_http(self, key: RecordKey, records: Sequence[ReplicaRecord]) -> tuple[str, int, list[tuple[Any, Any]]] | None:
        """The block from the first HTTP replica that verifies (§6.7); None when none does."""
        if not records:
            return None
        try:
            retrieved: Retrieved = await retrieve_block(self.fetcher, list(records))
        except RetrievalFailed as exc:
            log.info("block %s: no HTTP replica delivered: %s", key.block_key.hex()[:12], exc)
            return None
        tokens = retrieved.header.token_count
        if tokens != self.block_tokens or len(retrieved.layers) != self.layers or retrieved.first_layer != 0:
            log.warning("block %s from %s has %d tokens, %d layers: not a block of this model", key.block_key.hex()[:12],
                        retrieved.record.holder, tokens, len(retrieved.layers))
            return None
        layers = []
        octets = 0
        for lv in retrieved.layers:
            k, v = decode_layer(retrieved.header.codec, lv.k, lv.v, self.geometry, tokens)
            layers.append(self.to_tensors(lv.index, k, v))
            octets += len(lv.k) + len(lv.v)
        return retrieved.record.holder, octets, layers

