"""The inference engine of an instance: the reference model serving requests with a KV cache
that outlives them (kvsp-draft §1.1; docs/http-api.md "Generation"; docs/architecture.md).

``await engine.generate(principal, request)`` runs one request (``POST {ii}generate``):

1. admission through the instance's lifecycle (§6.3: a draining or sleeping instance takes no
   new request, 409 ``kvsp-not-active``); a prefetch directive carrying the request's
   ``request_ref`` (§6.5) is let finish first, within its deadline;
2. the prompt is tokenized and its Block Keys computed (§4.2) with the scope's key and the
   Compatibility ID of the model's descriptor (§4.1, ``model.build_descriptor``);
3. the reusable prefix is found and loaded by :class:`~.engine.loader.PrefixLoader`: the
   instance's own store, then the IS lookup (§6.2): MOQT replicas stream in layer by layer
   while the prefill computes (:class:`~kvsp_moq.model.LayerwisePrefill`: layer l of the new
   tokens is computed as soon as layer l of every prefix block is loaded, §4.3), HTTP
   replicas are fetched whole; a failed MOQT load falls back to HTTP, then to recomputation;
4. the rest of the prompt is prefilled; the first token is sampled (time to first token);
5. the new complete blocks are encoded (KVB1, codec raw) and published in the background
   (:class:`~kvsp_moq.control.client.computed.ComputedBlockPublisher`: own store + IS, HTTP holder, MOQT via
   the relay) while the tokens are decoded; the answer waits for both;
6. every output token carries its index (the sampler step, §6.8 step 4).

Model computation runs on one worker thread, :meth:`InferenceEngine.run`, which the §6.8
sessions of the instance share (``instance/model_sessions.py``): torch calls are serialized and the
event loop keeps serving HTTP and MOQT. What was done is counted in :class:`~.engine.counters.EngineCounters`
(``GET {ii}engine``), and the measured prefill and decode rates go into the instance's status
record (§6.3, §6.4 inputs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...bridge import MoqtHolder, MoqtPool
from ...kvsp.blockkeys import BlockKeyChain
from ...kvsp.codecs.policy import CodecPolicy
from ...kvsp.compat import compat_id as derive_compat_id
from ...kvsp.records import Sampler as SamplerRecord
from ...sinks import LayerFailed
from ...storage import BlockStore, RecordKey
from ..client.computed import ComputedBlockPublisher
from ..client.retrieval import BlockFetcher
from ..common.auth import Principal, require_scope
from ..common.engine_config import EngineConfig
from ..common.errors import Forbidden
from ..common.lifecycle import Lifecycle
from ..common.session_records import OutputToken
from .counters import EngineCounters
from .loader import HTTP, LOCAL, MOQT, Lookup, PrefixLoader, PrefixPlan
from .records import BlockUse, GenerateRequest, GenerateResult

__all__ = ["Closeable", "DirectiveFinder", "DirectiveProgress", "InferenceEngine", "ModelBundle", "load_model"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Closeable(Protocol):
    async def close(self) -> None:
        ...


class DirectiveProgress(Protocol):
    """One §6.5 directive as the engine waits for it (``instance.prefetch.DirectiveRun``)."""

    @property
    def done(self) -> asyncio.Event:
        """Set once the directive has ended."""
        ...


class DirectiveFinder(Protocol):
    """The instance's prefetch executor, as the engine asks it for a request's directives."""

    def by_request_ref(self, request_ref: str) -> Sequence[DirectiveProgress]:
        ...


@dataclass(frozen=True)
class ModelBundle:
    """The loaded reference model and what identifies its caches (§4.1)."""

    model: Any  # kvsp_moq.model.ReferenceModel
    tokenizer: Any  # kvsp_moq.model.ByteTokenizer
    descriptor: dict[str, Any]
    compat_id: bytes
    geometry: Any  # kvsp_moq.kvsp.layout.Geometry
    layers: int
    block_tokens: int


def load_model(config: EngineConfig) -> ModelBundle:
    """Load the model files named by ``config`` (generated once if the directory is empty)
    and build its Compatibility Descriptor. Imports torch; sets its intra-op threads."""
    import torch

    from ...model import ByteTokenizer, ReferenceModel, build_descriptor, ensure_model_files, model_geometry

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    files = ensure_model_files(directory=config.model_dir)
    model = ReferenceModel.load(directory=files.directory, device=config.device)
    descriptor = build_descriptor(files, block_tokens=config.block_tokens)
    # Warm-up: the first torch call of a process pays one-time costs; a request should not.
    warm = ByteTokenizer().encode("warm-up " * 8)
    lp = model.layerwise(warm[8:], prefix_tokens=8)
    first = model.prefill(warm[:8])
    for layer in range(model.config.layers):
        lp.step(layer, *first.cache.tokens(0, 8)[layer])
    model.decode(int(lp.finish().logits[-1].argmax()), lp.cache)
    return ModelBundle(model, ByteTokenizer(), descriptor, derive_compat_id(descriptor), model_geometry(model.config),
                       model.config.layers, config.block_tokens)


class InferenceEngine:
    """Runs requests on the reference model with reusable KV (see the module notes)."""

    def __init__(
        self,
        *,
        config: EngineConfig,
        bundle: ModelBundle,
        store: BlockStore,
        lifecycle: Lifecycle,
        index: Lookup | None,
        fetcher: BlockFetcher,
        publisher: ComputedBlockPublisher,
        url: Callable[[], str],
        pool: MoqtPool | None = None,
        moqt_holder: MoqtHolder | None = None,
        directives: DirectiveFinder | None = None,
        counters: EngineCounters | None = None,
        owned: Sequence[Closeable] = (),
        codec_policy: CodecPolicy | None = None,
    ) -> None:
        self.config = config
        self._owned = tuple(owned)
        self.bundle = bundle
        self.store = store
        self.lifecycle = lifecycle
        self.directives = directives
        self.publisher = publisher
        self.counters = counters if counters is not None else EngineCounters()
        self._url = url
        self.pool = pool
        self.moqt_holder = moqt_holder
        self.loader = PrefixLoader(
            store=store, index=index, fetcher=fetcher, pool=pool, geometry=bundle.geometry, layers=bundle.layers,
            block_tokens=bundle.block_tokens, self_url="", to_tensors=self._to_tensors, timeout_s=config.moqt_timeout_s,
            idle_timeout_s=min(config.moqt_idle_timeout_s, config.moqt_timeout_s), index_timeout_s=config.index_timeout_s,
            counters=self.counters, codec_policy=codec_policy,
        )
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsp-engine")
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def compat_id(self) -> bytes:
        return self.bundle.compat_id

    @property
    def descriptor(self) -> dict[str, Any]:
        return self.bundle.descriptor

    # -- the request path -------------------------------------------------------------------------

    async def generate(self, principal: Principal, request: GenerateRequest) -> GenerateResult:
        """Serve one request (module notes). 403 without the scope or its key here; 409
        ``kvsp-not-active`` when the instance is not active (§6.3)."""
        require_scope(principal, request.scope_id)
        scope_key = self.config.scope_key(request.scope_id)
        if scope_key is None:
            raise Forbidden(f"this instance holds no scope key for scope {request.scope_id.hex()} (§4.2)")
        if request.max_tokens > self.config.max_tokens:
            from ...kvsp.errors import RecordError

            raise RecordError("max_tokens", f"at most {self.config.max_tokens} at this instance")
        token_ids = list(request.prompt_ids) if request.prompt_ids is not None else self.bundle.tokenizer.encode(request.prompt or "")
        self.bundle.model.token_tensor(token_ids)  # ModelError (400) for ids outside the vocabulary
        rid = uuid.uuid4()
        self.lifecycle.admit(rid, request.scope_id)
        self.counters.requests += 1
        try:
            return await self._serve(rid, request, scope_key, token_ids)
        except BaseException:
            self.counters.failed_requests += 1
            raise
        finally:
            self.lifecycle.finish(rid)

    async def _serve(self, rid: uuid.UUID, request: GenerateRequest, scope_key: bytes, token_ids: list[int]) -> GenerateResult:
        started = time.perf_counter()
        await self.wait_for_prefetch(request.request_ref)
        serving = time.perf_counter()
        B = self.bundle.block_tokens
        keys = [RecordKey(self.compat_id, request.scope_id, k)
                for k in BlockKeyChain(scope_key, self.compat_id, B).extend(token_ids)]
        # A fully cached prompt still needs the last token's logits: reuse at most (T-1)//B blocks.
        usable = min(len(keys), (len(token_ids) - 1) // B)
        self.loader.self_url = self._url()
        plan = await self.loader.plan(keys, usable)
        try:
            prefill, layerwise = await self._prefill(plan, token_ids)
        finally:
            await plan.close()
        sampler = self._sampler(request.sampler)
        logits = prefill.logits[-1]
        first = await self.run(sampler.sample, logits)
        ttft_ms = (time.perf_counter() - serving) * 1e3
        reused = len(plan.blocks)
        self._count_prefix(plan, len(token_ids), len(keys), ttft_ms)
        # New complete blocks: encoded now (before decode extends the cache), published meanwhile.
        containers = await self.run(self._encode_blocks, prefill.cache, reused, len(keys))
        publication = asyncio.create_task(self._publish(keys, reused, containers, plan))
        try:
            tokens, finish = await self._decode(prefill.cache, sampler, first, request.max_tokens)
        finally:
            published = await publication
        self.counters.output_tokens += len(tokens)
        blocks = [BlockUse(index=b.index, source=b.source, octets=b.octets, holder=b.holder) for b in plan.blocks]
        blocks += [BlockUse(index=i, source="recomputed", octets=0) for i in range(reused, len(keys))]
        return GenerateResult(
            request=rid, instance=self._url(), prompt_tokens=len(token_ids), matched=plan.matched, blocks=tuple(blocks),
            tokens=tuple(OutputToken(index=i, token=t) for i, t in tokens),
            text=self.bundle.tokenizer.decode([t for _, t in tokens]), finish=finish, ttft_ms=round(ttft_ms, 3),
            prefetch_wait_ms=round((serving - started) * 1e3, 3), total_ms=round((time.perf_counter() - started) * 1e3, 3),
            layerwise=layerwise, published=tuple(sorted(published)),
        )

    async def wait_for_prefetch(self, request_ref: str | None) -> None:
        """§6.5: the directives carrying ``request_ref`` run to their end (their own deadline
        bounds them). ``generate`` passes the request's ``request_ref``; a §6.8 session passes
        its session id, which the PC uses as the ``request_ref`` of the directives it sends
        with a start or resume (``pc/sessions.py``)."""
        if request_ref is None or self.directives is None:
            return
        for run in self.directives.by_request_ref(request_ref):
            await run.done.wait()

    async def _prefill(self, plan: PrefixPlan, token_ids: list[int]) -> tuple[Any, bool]:
        """The prefill of the tokens after the prefix; layer-wise while MOQT loads run."""
        model = self.bundle.model
        if plan.streaming:
            lp = model.layerwise(token_ids[plan.tokens:], prefix_tokens=plan.tokens)
            try:
                for layer in range(self.bundle.layers):
                    parts = await plan.wait_layer(layer)
                    k, v = await self.run(_join, parts)
                    await self.run(lp.step, layer, k, v)
                return await self.run(lp.finish), True
            except LayerFailed as exc:
                log.info("a prefix layer failed over MOQT (%s): falling back", exc)
                await plan.settle(self.loader)
                self.counters.moqt_fallbacks += plan.fallbacks
        prefix = None
        if plan.blocks:
            from ...model import KVCache

            layers_of = [[b.layer(l) for l in range(self.bundle.layers)] for b in plan.blocks]
            prefix = await self.run(KVCache.from_blocks, model.config, layers_of, model.device)
        return await self.run(model.prefill, token_ids[plan.tokens:], prefix), False

    async def _decode(self, cache: Any, sampler: Any, first: int, limit: int) -> tuple[list[tuple[int, int]], str]:
        from ...model import EOS_ID

        model = self.bundle.model
        tokens = [(sampler.step - 1, first)]
        token = first
        decode_start = time.perf_counter()
        while token != EOS_ID and len(tokens) < limit:
            logits = await self.run(model.decode, token, cache)
            index = sampler.step
            token = await self.run(sampler.sample, logits)
            tokens.append((index, token))
        if len(tokens) > 1:
            self.counters.decode_s += time.perf_counter() - decode_start
            self.counters.decode_tokens += len(tokens) - 1
        return tokens, "eos" if token == EOS_ID else "length"

    def _sampler(self, record: SamplerRecord | None) -> Any:
        from ...model import Sampler

        if record is None:
            return Sampler.greedy()
        return Sampler.restore(record.method, dict(record.params), record.seed, record.step)

    def _count_prefix(self, plan: PrefixPlan, tokens: int, blocks: int, ttft_ms: float) -> None:
        self.count_prefix(loaded=[(b.source, b.octets) for b in plan.blocks], matched=plan.matched, tokens=tokens,
                          blocks=blocks, prefilled=tokens - plan.tokens, ttft_ms=ttft_ms)

    def count_prefix(self, *, loaded: Sequence[tuple[str, int]], matched: int, tokens: int, blocks: int,
                     prefilled: int, ttft_ms: float) -> None:
        """Count one request's or session's context: ``tokens`` tokens in ``blocks`` complete
        blocks, of which ``loaded`` ((source, KV octets) each) were reused and the rest
        recomputed; ``prefilled`` tokens computed before the first token, after ``ttft_ms``."""
        c = self.counters
        c.prompt_tokens += tokens
        c.prompt_blocks += blocks
        c.lookup_matched += matched
        c.prefill_tokens += prefilled
        c.ttft_ms.append(ttft_ms)
        for source, octets in loaded:
            {LOCAL: c.local, MOQT: c.moqt, HTTP: c.http}[source].add(octets)
        c.recomputed_blocks += blocks - len(loaded)

    # -- publication ------------------------------------------------------------------------------

    def _encode_blocks(self, cache: Any, first: int, end: int) -> list[bytes]:
        from ...model import encode_block

        B = self.bundle.block_tokens
        return [encode_block(cache, i * B, (i + 1) * B) for i in range(first, end)]

    async def _publish(self, keys: Sequence[RecordKey], first: int, containers: list[bytes], plan: PrefixPlan) -> set[str]:
        done: set[str] = set()
        for block in plan.blocks:  # loaded on demand: kept here like a prefetched block (§6.5)
            if block.source in (MOQT, HTTP):
                layers = [tuple(t.detach().to("cpu").contiguous() for t in block.layer(l)) for l in range(self.bundle.layers)]
                await self.publisher.keep(block.key, layers, self.bundle.block_tokens)
        for offset, container in enumerate(containers):
            done.update(await self.publisher.publish(keys[first + offset], container))
        return done

    # -- the worker thread --------------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` on the instance's one model thread (torch releases the GIL, so the
        event loop keeps serving meanwhile). Requests (``generate``) and §6.8 sessions
        (``instance.model_sessions``) share it: one model computation at a time per instance."""
        started = time.perf_counter()
        result = await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        if getattr(fn, "__name__", "") in ("prefill", "step", "finish"):
            self.counters.prefill_s += time.perf_counter() - started
        return result

    def _to_tensors(self, layer: int, k: Any, v: Any) -> tuple[Any, Any]:
        from ...model import kv_from_sections

        return kv_from_sections(self.bundle.model.config, layer, k, v, self.bundle.model.device)

    # -- status (§6.3) and shutdown -------------------------------------------------------------------

    def measured_rates(self) -> tuple[float | None, float | None]:
        """(prefill, decode) tokens per second measured so far, or None before any."""
        return self.counters.prefill_rate(), self.counters.decode_rate()

    def stats(self) -> dict[str, Any]:
        """What ``GET {ii}engine`` returns: the model and the counters."""
        return {
            "instance": self._url(),
            "model": self.descriptor["model"],
            "compat_id": self.compat_id.hex(),
            "descriptor": self.descriptor,
            "block_tokens": self.bundle.block_tokens,
            "scopes": sorted(s.hex() for s in self.config.scope_keys),
            "relay": self.config.relay_url,
            "holder": self.config.holder_url,
            "counters": self.counters.to_json(),
        }

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for resource in self._owned:
            await resource.close()
        if self.moqt_holder is not None:
            await self.moqt_holder.close()
        if self.pool is not None:
            await self.pool.close()
        self._worker.shutdown(wait=True)


def _join(parts: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    from ...model import join_layer_kv

    return join_layer_kv(parts) if len(parts) > 1 else parts[0]
