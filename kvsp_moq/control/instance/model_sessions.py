"""Sessions on the reference model (kvsp-draft §6.8): the model-backed :class:`SessionEngine`.

:class:`ModelSessionEngine` runs the sessions the PC starts and resumes on an instance
(``instance.sessions.InstanceSessions``) with the instance's inference engine
(``engine.engine.InferenceEngine``: the model, its Block Key scope keys, the prefix loader and the
block publisher). One code path serves both orders, since a start is a resume from the
epoch-0 checkpoint (docs/decisions/0004):

1. **Context.** The session's context is the prompt (``prompt_blocks``: Block Keys only, whose
   KV must be loaded since their tokens are not in the checkpoint; ``prompt_tail``: tokens)
   followed by ``generated``. The Block Keys of the context's complete blocks chain on from
   the last prompt block (§4.2) with the scope's key, when the instance holds it.
2. **Load** (§6.8 step 1): the longest prefix of those blocks that the instance's store, or a
   replica the IS lists, delivers (``engine.loader.PrefixLoader``: own tiers, then MOQT or HTTP,
   every layer verified, §6.7): the checkpoint's prompt blocks and the generated blocks the
   failed instance published. At most ``(T - 1) // B`` blocks of a T-token context are loaded:
   the last token is always computed, since its logits give the next token.
3. **Recompute** (§6.8 step 2): the prompt tokens not covered are prefilled in one call, as the
   first instance did; the generated tokens not covered are decoded **one per step**, as the
   first instance computed them, so the KV cache is bit for bit the one the failed instance had
   (CPU, same torch build and thread count) and a resumed sampler draws exactly what it would
   have drawn.
4. **Sampler** (§6.8 step 3): ``Sampler.restore(method, params, seed, step)``.
5. **Generate** (§6.8 step 4) from ``output_offset``: every token goes through
   ``SessionOutput.token`` (index and epoch labels; released at once when the checkpoint says
   the sampler is deterministic, else only once a checkpoint covering it is acknowledged —
   batched every ``checkpoint_every`` tokens). Each time a block of the context completes, its
   KV is encoded (KVB1, codec raw) and **published** like the engine's computed blocks (own
   store + IS record, the HTTP holder, MOQT via the relay: ``client.computed``), and then a
   **checkpoint** is sent (§6.8 "whenever a block of generated tokens completes"); the output
   itself checkpoints at least every ``checkpoint_every`` (≤ 64) tokens.

Before step 1 the session waits for the prefetch directives the PC sent with the order: the
PC uses the session id as their ``request_ref`` (§6.5, ``pc/sessions.py``), as ``generate``
waits for its request's. The time to first token is measured from then to the first token
sampled, and the blocks the recomputation completed are published right after that first
token (off its path). What was loaded and recomputed is counted in the instance's engine
counters like a request's (``EngineCounters.count_prefix``; ``sessions`` counts the runs).

A session that cannot run here (another Compatibility ID, prompt blocks that no replica
delivers, an unknown sampler, a token outside the vocabulary) raises
:class:`SessionNotServable` (an ``instance.sessions.SessionRefused``): the instance reports it
to the PC with ``POST {pc}sessions/{id}/failed``, and the PC places it elsewhere or marks it
failed (docs/migration.md).

Model calls run on the instance's one model thread, :meth:`InferenceEngine.run`, shared with
``generate`` (torch releases the GIL; the event loop keeps serving HTTP, checkpoints and
deliveries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ...kvsp.blockkeys import ZERO_KEY, BlockKeyChain
from ...kvsp.records import Sampler as SamplerRecord
from ...sinks import LayerFailed
from ...storage import RecordKey
from ..common.errors import SessionRefused, Superseded
from ..common.session_records import SessionOrder
from ..engine.loader import HTTP, MOQT, PrefixPlan
from .sessions import SessionOutput

if TYPE_CHECKING:  # pragma: no cover
    from ...model import KVCache, Sampler
    from ..engine.engine import InferenceEngine

__all__ = ["ModelSessionEngine", "SessionCounters", "SessionNotServable"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class SessionNotServable(SessionRefused):
    """The session cannot run on this instance's model (see the module notes)."""


@dataclass
class SessionCounters:
    """What the session engine did since the instance started (logged, and for embedding)."""

    started: int = 0
    resumed: int = 0
    loaded_blocks: int = 0  # context blocks loaded (§6.8 step 1)
    loaded_octets: int = 0
    recomputed_tokens: int = 0  # context tokens computed before the first new token (step 2)
    ttft_ms: list[float] = field(default_factory=list)  # per run: prefetch waited for -> first token
    published_blocks: int = 0  # context blocks completed here and published
    output_tokens: int = 0


@dataclass
class _Restored:
    """What restoring a context did: blocks loaded ((source, KV octets) each), blocks the IS
    lookup matched, tokens computed, and the blocks the computation completed (to publish)."""

    loaded: list[tuple[str, int]]
    matched: int
    prefilled: int
    completed: list[int] = field(default_factory=list)


@dataclass
class _Context:
    """One run's context: tokens known, Block Keys, and the model-side state."""

    compat_id: bytes
    scope_id: bytes
    known_from: int  # tokens [0, known_from) are the prompt blocks (KV only)
    tokens: list[int]  # the tokens from known_from on: prompt_tail + generated
    prompt_end: int  # the prompt's length (the generated tokens follow)
    keys: list[RecordKey]  # Block Keys of the complete blocks so far (only the prompt's without a scope key)
    chain: BlockKeyChain | None

    @property
    def length(self) -> int:
        return self.known_from + len(self.tokens)

    def token(self, position: int) -> int:
        return self.tokens[position - self.known_from]


class ModelSessionEngine:
    """:class:`~.instance.sessions.SessionEngine` on the instance's model (module notes).

    ``engine`` may be bound later with :meth:`bind` (``serve_model_instance`` builds the
    session engine before the instance has loaded its model); orders wait for it.
    """

    def __init__(self, engine: InferenceEngine | None = None, *, url: Callable[[], str] | None = None,
                 load_timeout_s: float = 10.0) -> None:
        self._engine = engine
        self._url = url
        self.load_timeout_s = load_timeout_s
        self._bound: asyncio.Event | None = None
        self.counters = SessionCounters()

    def bind(self, engine: InferenceEngine, url: Callable[[], str] | None = None) -> None:
        """The instance's inference engine, once loaded; ``url`` is the instance URL (so that
        the loader skips the instance's own records and reads its store instead)."""
        self._engine = engine
        if url is not None:
            self._url = url
        if self._bound is not None:
            self._bound.set()

    async def _engine_ready(self) -> InferenceEngine:
        if self._engine is None:
            if self._bound is None:
                self._bound = asyncio.Event()
            await self._bound.wait()
        assert self._engine is not None
        return self._engine

    def close(self) -> None:
        """Nothing to release: model calls run on the engine's thread, which the engine owns."""

    # -- the seam (instance.sessions.SessionEngine) ------------------------------------------------

    async def start(self, order: SessionOrder, output: SessionOutput) -> None:
        self.counters.started += 1
        await self._serve(order, output)

    async def resume(self, order: SessionOrder, output: SessionOutput) -> None:
        self.counters.resumed += 1
        await self._serve(order, output)

    # -- one run -----------------------------------------------------------------------------------

    async def _serve(self, order: SessionOrder, output: SessionOutput) -> None:
        engine = await self._engine_ready()
        engine.counters.sessions += 1
        try:
            await self._generate(engine, order, output)
        except Superseded:
            raise
        except Exception:
            engine.counters.failed_sessions += 1
            raise

    async def _generate(self, engine: InferenceEngine, order: SessionOrder, output: SessionOutput) -> None:
        cp = order.checkpoint
        if cp.compat_id != engine.compat_id:
            raise SessionNotServable(f"session {cp.session} is for compat_id {cp.compat_id.hex()}, "
                                     f"this instance's model has {engine.compat_id.hex()}")
        if not cp.prompt_tail and not cp.generated:
            raise SessionNotServable("the context's last token must be known: prompt_tail is empty and nothing "
                                     "was generated (keep at least the last prompt token in prompt_tail)")
        from ...model import EOS_ID, ModelError

        # §6.5: the directives the PC sent with this order (request_ref = the session id) first.
        await engine.wait_for_prefetch(str(cp.session))
        serving = time.perf_counter()
        try:
            context = self._context(engine, order)
        except ModelError as exc:
            raise SessionNotServable(f"context: {exc}") from None
        sampler = self._sampler(cp.sampler)
        blocks = len(context.keys)
        cache, logits, restored = await self._restore(engine, context)
        limit = order.max_tokens if order.max_tokens is not None else engine.config.max_tokens
        B = engine.bundle.block_tokens
        model = engine.bundle.model
        first = True
        while output.next_index < limit:
            token = await self._call(sampler.sample, logits)
            if first:
                ttft_ms = (time.perf_counter() - serving) * 1e3
                self.counters.ttft_ms.append(ttft_ms)
                engine.count_prefix(loaded=restored.loaded, matched=restored.matched, tokens=context.length,
                                    blocks=blocks, prefilled=restored.prefilled, ttft_ms=round(ttft_ms, 3))
            await output.token(token)
            self.counters.output_tokens += 1
            engine.counters.output_tokens += 1
            if first:  # the blocks the recomputation completed, published off the first token's path
                first = False
                for index in restored.completed:
                    await self._publish(engine, context, cache, index)
            if token == EOS_ID or output.next_index >= limit:
                break
            logits = await self._call(model.decode, token, cache)
            self._append(context, token)
            if cache.length % B == 0:  # a block of the context completed (§6.8)
                await self._publish(engine, context, cache, cache.length // B - 1)
                await output.checkpoint(sampler=self._record(cp.sampler, sampler))

    def _context(self, engine: InferenceEngine, order: SessionOrder) -> _Context:
        cp = order.checkpoint
        B = engine.bundle.block_tokens
        prompt = [RecordKey(cp.compat_id, cp.scope_id, k) for k in cp.prompt_blocks]
        tokens = list(cp.prompt_tail) + list(cp.generated)
        engine.bundle.model.token_tensor(tokens)  # ModelError for an id outside the vocabulary
        scope_key = engine.config.scope_key(cp.scope_id)
        chain = None
        keys = list(prompt)
        if scope_key is not None:
            previous = cp.prompt_blocks[-1] if cp.prompt_blocks else ZERO_KEY
            chain = BlockKeyChain(scope_key, cp.compat_id, B, previous=previous, index=len(prompt))
            keys += [RecordKey(cp.compat_id, cp.scope_id, k) for k in chain.extend(tokens)]
        known_from = len(prompt) * B
        return _Context(compat_id=cp.compat_id, scope_id=cp.scope_id, known_from=known_from, tokens=tokens,
                        prompt_end=known_from + len(cp.prompt_tail), keys=keys, chain=chain)

    def _append(self, context: _Context, token: int) -> None:
        context.tokens.append(token)
        if context.chain is not None:
            for key in context.chain.extend([token]):
                context.keys.append(RecordKey(context.compat_id, context.scope_id, key))

    async def _restore(self, engine: InferenceEngine, context: _Context) -> tuple[KVCache, Any, _Restored]:
        """§6.8 steps 1-2: the KV cache of the context but its last token, the logits after
        the last token, and what was loaded and computed."""
        B = engine.bundle.block_tokens
        model = engine.bundle.model
        usable = min(len(context.keys), (context.length - 1) // B)
        prompt_blocks = context.known_from // B
        if usable < prompt_blocks:
            raise SessionNotServable("the context's last token is inside a prompt block")
        plan = await self._load(engine, context.keys, usable)
        try:
            if len(plan.blocks) < prompt_blocks:
                raise SessionNotServable(
                    f"only {len(plan.blocks)} of the {prompt_blocks} prompt blocks could be loaded (their tokens are "
                    "not in the checkpoint, so they cannot be recomputed)")
            from ...model import KVCache

            cache: KVCache | None = None
            if plan.blocks:
                layers_of = [[b.layer(l) for l in range(engine.bundle.layers)] for b in plan.blocks]
                cache = await self._call(KVCache.from_blocks, model.config, layers_of, model.device)
            loaded = self._count_loads(plan)
            await self._keep(engine, plan)
        finally:
            await plan.close()
        restored = _Restored(loaded=loaded, matched=plan.matched, prefilled=context.length - len(plan.blocks) * B)
        loaded_tokens = len(plan.blocks) * B
        # The prompt tokens after the loaded blocks: one prefill, as the first instance did.
        prompt_end = context.prompt_end
        logits = None
        position = loaded_tokens
        if position < prompt_end:
            ids = [context.token(p) for p in range(position, prompt_end)]
            result = await self._call(model.prefill, ids, cache)
            cache, logits, position = result.cache, result.logits[-1], prompt_end
        if cache is None:
            fresh: KVCache = await self._call(model.new_cache, context.length + 64)  # the model is Any
            cache = fresh
        # The generated tokens after that: one decode step each (bit for bit the failed
        # instance's computation), the last one giving the logits of the next token.
        while position < context.length:
            logits = await self._call(model.decode, context.token(position), cache)
            position += 1
        assert logits is not None
        self.counters.recomputed_tokens += restored.prefilled
        # Blocks completed by the recomputation are published like any computed block (by
        # ``_generate``, once the first token is out).
        restored.completed = list(range(len(plan.blocks), min(len(context.keys), cache.length // B)))
        return cache, logits, restored

    async def _load(self, engine: InferenceEngine, keys: Sequence[RecordKey], usable: int) -> PrefixPlan:
        """The prefix plan of ``keys`` (at most ``usable`` blocks), every block loaded. A load
        that outlasts ``load_timeout_s`` (a replica whose holder hangs — the paused instance
        the session is moving away from may be one) is given up: nothing is loaded and the
        context is recomputed, which works unless it has prompt blocks."""
        loader = engine.loader
        if self._url is not None:
            loader.self_url = self._url()
        try:
            return await asyncio.wait_for(self._plan(engine, keys, usable), self.load_timeout_s)
        except asyncio.TimeoutError:
            log.warning("loading %d context blocks took more than %.1f s: recomputing them", usable, self.load_timeout_s)
            return PrefixPlan(engine.bundle.block_tokens)

    async def _plan(self, engine: InferenceEngine, keys: Sequence[RecordKey], usable: int) -> PrefixPlan:
        loader = engine.loader
        plan = await loader.plan(list(keys), usable)
        if plan.streaming:  # MOQT loads: wait for every layer; a failed one falls back (HTTP)
            try:
                for layer in range(engine.bundle.layers):
                    await plan.wait_layer(layer)
            except LayerFailed as exc:
                log.info("a context block failed over MOQT (%s): falling back", exc)
            try:
                await plan.settle(loader)
            except BaseException:
                await plan.close()
                raise
        return plan

    def _count_loads(self, plan: PrefixPlan) -> list[tuple[str, int]]:
        """(source, KV octets) of each loaded block (``InferenceEngine.count_prefix`` counts them)."""
        for block in plan.blocks:
            self.counters.loaded_blocks += 1
            self.counters.loaded_octets += block.octets
        return [(block.source, block.octets) for block in plan.blocks]

    async def _keep(self, engine: InferenceEngine, plan: PrefixPlan) -> None:
        """Blocks loaded from elsewhere are kept here and published (§6.5 behaviour)."""
        for block in plan.blocks:
            if block.source in (MOQT, HTTP):
                layers = [tuple(t.detach().to("cpu").contiguous() for t in block.layer(l))
                          for l in range(engine.bundle.layers)]
                await engine.publisher.keep(block.key, layers, engine.bundle.block_tokens)

    async def _publish(self, engine: InferenceEngine, context: _Context, cache: KVCache, index: int) -> None:
        """Encode block ``index`` of the context (KVB1, raw) and publish it (store + IS, HTTP
        holder, MOQT), so that its KV survives this instance (§6.8)."""
        if index >= len(context.keys) or index < context.known_from // engine.bundle.block_tokens:
            return  # no key (no scope key here), or a prompt block (loaded, published already)
        from ...model import encode_block

        B = engine.bundle.block_tokens
        container = await self._call(encode_block, cache, index * B, (index + 1) * B)
        reached = await engine.publisher.publish(context.keys[index], container)
        if reached:
            self.counters.published_blocks += 1

    # -- sampler (§6.8 step 3) ---------------------------------------------------------------------

    @staticmethod
    def _sampler(record: SamplerRecord) -> Sampler:
        from ...model import Sampler, SamplerError

        try:
            return Sampler.restore(record.method, dict(record.params), record.seed, record.step)
        except SamplerError as exc:
            raise SessionNotServable(f"sampler: {exc}") from None

    @staticmethod
    def _record(base: SamplerRecord, sampler: Sampler) -> SamplerRecord:
        state = sampler.state
        return SamplerRecord(method=state.method, params=dict(state.params), seed=state.seed, step=state.step,
                             deterministic=base.deterministic)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """On the instance's one model thread (shared with ``generate``)."""
        engine = await self._engine_ready()
        return await engine.run(fn, *args)
