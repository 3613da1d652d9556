"""The scheduler side of the connector: which prompt blocks come from KVSP, which are published.

Per request (vLLM's ``Request``, read duck-typed):

- **scope** — selected by the digest of the request's secret ``cache_salt``, else the
  default scope (:meth:`~.settings.ConnectorSettings.scope_of`); nothing the request names
  selects one. A request without a scope neither loads nor publishes.
- **what else makes its KV differ** — a LoRA adapter is part of the request's Compatibility
  Descriptor (§4.1 ``adapters``, the adapter's digest); multimodal inputs and prompt embeddings
  are not in the Block Keys (which cover token ids), so such requests share nothing.
- **codec** — the operator's ``codec_policy`` for the request's scope (and, where it adds no
  loss the scope does not allow, the class the request names:
  :meth:`~.settings.ConnectorSettings.codec_of`); the workers load in it, the output reports
  it. ``kv_transfer_params["kvsp_codec"]`` chooses nothing.
- **Block Keys** — over the prompt's complete blocks (kvsp-draft §4.2), under the scope's
  key and the request's Compatibility ID (:mod:`.descriptor`), B = vLLM's block size; one set
  per tensor-parallel rank (each rank's shard has its own Compatibility ID).
- **one IS lookup per rank** (``POST lookup``, §6.2, concurrently) for the blocks after vLLM's
  own prefix-cache hit, bounded by ``deadline_ms``; the matched prefix is the shortest of the
  ranks' (every rank must load the block); an IS that fails or is late means no external hit.
  The lookup never blocks vLLM's scheduler: it runs on the client loop, and until it answers
  (or its deadline passes) ``get_num_new_matched_tokens`` returns ``None`` — vLLM's "not yet":
  the request waits while the others are scheduled, and is asked again next step.
- **matched prefix** — at most ``(prompt_len - 1) // B`` blocks: vLLM must compute at least one
  prompt token to sample from, so a prompt that is all cached blocks reuses all but its last
  block (vLLM's ExampleConnector and LMCache apply the same rule). Loads are asynchronous
  (``load_kv_async=True``): the request waits outside the batch, the others run, and the
  workers report it loaded in ``get_finished``. With ``async_loads`` off they are layer-wise
  during the request's forward step, layer l waited for just before layer l is computed.
- **saves** — the prompt blocks that become complete in a step and were not loaded (nor
  already known to the IS) are planned for publication by the worker.
- **streams** (prefill→decode, :mod:`.stream`) — a request naming a stream in its
  ``kv_transfer_params``: as the stream's producer its saves are the replicas whose Replica ID
  is the stream id; as a consumer, the blocks the IS does not know (past the lookup's matched
  prefix, up to the full-hit rule's limit) are loaded from the stream (always asynchronously:
  the request waits outside the batch while the producer computes them).

The worker's per-request counters (summed over the ranks) come back through
``update_connector_output`` and are returned as ``kv_transfer_params["kvsp"]`` of the request's
output (``request_finished``); a request that shares nothing reports ``{"shared": false,
"reason": ...}`` there instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...control.client.http import HttpIndexClient
from ...kvsp.blockkeys import block_keys
from ...kvsp.compat import compat_id
from ...kvsp.errors import DescriptorError
from ...kvsp.records import LookupRequest, LookupResponse
from ...kvsp.scope import scope_id
from .descriptor import EngineModel, adapter_digest
from .loop import ClientLoop
from .plan import BlockLoad, BlockSave, RequestLoad, RequestSave, StepPlan, merge_counts, merge_marks
from .settings import ConnectorSettings
from .stream import StreamError, StreamParams

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)


@dataclass
class _Request:
    scope: str
    scope_id: bytes
    compat_ids: tuple[bytes, ...]  # per rank
    keys: tuple[list[bytes], ...]  # per rank: the Block Keys of the prompt's complete blocks
    looked_up: bool = False
    #: The lookup in flight on the client loop, and when the scheduler stops waiting for it.
    lookup: concurrent.futures.Future[list[LookupResponse]] | None = None
    lookup_deadline: float = 0.0
    local_tokens: int = 0  # vLLM's own prefix-cache hit (whole pages)
    matched: int = 0  # blocks the IS knows for every rank (a prefix of keys)
    #: per matched block, per rank: the records of its replicas
    records: list[tuple[tuple[Mapping[str, object], ...], ...]] = field(default_factory=list)
    external: int = 0  # tokens to load, from local_tokens on (to the end of a KVSP block)
    load_pending: list[BlockLoad] | None = None
    #: A load was handed to the workers: vLLM asking again (it rescheduled the request after a
    #: failed load, or after a preemption) is answered 0 — what failed is recomputed, never
    #: fetched in a loop.
    load_handed: bool = False
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int | None = None  # blocks below this are computed/loaded/known: not saved
    frontier: int = 0  # tokens computed once the last scheduled step is done
    counts: dict[str, int] = field(default_factory=dict)
    #: The request's stream (prefill→decode, :mod:`.stream`), and the workers' time marks of it.
    stream: StreamParams | None = None
    marks: dict[str, list[int]] = field(default_factory=dict)
    prompt_len: int = 0
    #: The codec its loads ask for (``codec_policy``; None: raw) and why (reported).
    codec: str | None = None
    codec_reason: str = ""


class SchedulerSide:
    """The scheduler role's state and decisions (module notes). vLLM-free: the connector
    (:mod:`.connector`) forwards vLLM's calls here."""

    def __init__(self, settings: ConnectorSettings, model: EngineModel, loop: ClientLoop | None = None,
                 kv_role: str = "kv_both") -> None:
        self.settings = settings
        self.kv_role = kv_role
        self.model = model
        self.block_tokens = model.block_tokens
        self._compat: dict[tuple[str, ...], tuple[bytes, ...]] = {}
        #: The engine's Compatibility ID per rank, without adapters.
        self.compat_ids = self._compat_ids(())
        self._requests: dict[str, _Request] = {}
        #: Requests that share nothing and why (reported by request_finished).
        self._unshared: dict[str, str] = {}
        self._warned_scope_param = False
        self._warned_codec_param = False
        self._loop = loop
        self._index: HttpIndexClient | None = None
        if settings.enabled and settings.load:
            self._loop = loop or ClientLoop("kvsp-scheduler")
            self._index = HttpIndexClient(settings.index_url or "", settings.index_token,
                                          timeout_s=settings.deadline_s)
        #: Totals over all requests (tests and the demo read them through kv_transfer_params).
        self.lookups = 0
        self.lookup_failures = 0

    # -- vLLM's scheduler calls -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None:
            return 0, False
        b = self.block_tokens
        prompt_len = len(request.prompt_token_ids or [])
        usable = min(len(state.keys[0]), max(0, prompt_len - 1) // b)  # the full-hit rule
        if not state.looked_up:
            if state.lookup is None:
                state.local_tokens = num_computed_tokens
                # a KVSP block vLLM holds only some pages of is still saved: all are in its cache
                state.saved_upto = num_computed_tokens // b
                if usable * b > num_computed_tokens and self._index is not None:
                    self._start_lookup(state)
            answer = None
            if state.lookup is not None:
                if not state.lookup.done() and time.monotonic() < state.lookup_deadline:
                    return None, False  # vLLM's "not yet": asked again next step (module notes)
                answer = self._lookup_result(state.lookup)
            state.looked_up = True
            if answer is not None:
                state.matched = min(a.matched for a in answer)
                state.records = [tuple(tuple(r.to_json() for r in a.blocks[i].replicas) for a in answer)
                                 for i in range(state.matched)]
                state.saved_upto = max(state.saved_upto or 0, min(state.matched, len(state.keys[0])))
            loaded = min(state.matched, usable)
            if state.stream is not None and state.stream.consumer:
                # the blocks past the IS's prefix come from the stream; none is published here
                loaded = usable
                state.saved_upto = max(state.saved_upto or 0, usable)
            state.external = max(0, loaded * b - state.local_tokens)
        if state.external == 0 or num_computed_tokens != state.local_tokens or state.load_handed:
            return 0, False
        return state.external, self._asynchronous(state)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        ids = list(blocks.get_block_ids()[0])
        page, m = self.model.page_tokens, self.block_tokens // self.model.page_tokens
        first, end = state.local_tokens // page, (state.local_tokens + num_external_tokens) // page  # pages
        state.load_handed = True
        nobody = tuple(() for _ in state.keys)
        state.load_pending = [
            BlockLoad(i, tuple((p, ids[i * m + p]) for p in range(m) if first <= i * m + p < end),
                      tuple(keys[i] for keys in state.keys),
                      state.records[i] if i < state.matched else nobody, streamed=i >= state.matched)
            for i in range(first // m, (end + m - 1) // m)
        ]

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        for req_id, state in self._requests.items():
            if state.load_pending:
                stream = state.stream.stream_id if state.stream is not None else None
                plan.loads.append(RequestLoad(req_id, state.scope_id, state.compat_ids, tuple(state.load_pending),
                                              asynchronous=self._asynchronous(state), stream_id=stream,
                                              codec=state.codec))
                state.load_pending = None
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            fresh = self._requests.get(new.req_id)
            if fresh is not None:
                fresh.block_ids = list(new.block_ids[0])
                self._plan_saves(plan, new.req_id, fresh, new.num_computed_tokens, scheduled.get(new.req_id, 0))
                self._mark_producing(plan, new.req_id, fresh, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._requests.get(req_id)
            if running is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    running.block_ids = list(new_ids[0])  # after preemption: the whole list
                else:
                    running.block_ids.extend(new_ids[0])
            self._plan_saves(plan, req_id, running, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
            self._mark_producing(plan, req_id, running, cached.num_computed_tokens[i])
        return plan

    def update_connector_output(self, counts: Mapping[str, Mapping[str, int]],
                                marks: Mapping[str, Mapping[str, list[int]]] | None = None) -> None:
        for req_id, c in counts.items():
            state = self._requests.get(req_id)
            if state is not None:
                merge_counts({req_id: state.counts}, {req_id: c})
        for req_id, m in (marks or {}).items():
            state = self._requests.get(req_id)
            if state is not None:
                merge_marks({req_id: state.marks}, {req_id: m})

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        state = self._requests.pop(request.request_id, None)
        reason = self._unshared.pop(request.request_id, None)
        if state is not None and state.lookup is not None:
            state.lookup.cancel()  # aborted while its lookup was in flight
        if state is None:
            return {"kvsp": {"shared": False, "reason": reason}} if reason else None
        ranks = {"compat_ids": [c.hex() for c in state.compat_ids]} if len(state.compat_ids) > 1 else {}
        stream: dict[str, Any] = {}
        if state.stream is not None:
            # time marks: CLOCK_MONOTONIC ns, comparable between the engines of one host
            stream = {"stream": state.stream.to_json(),
                      **{name: sorted(values) for name, values in state.marks.items()}}
        codec = {"codec": state.codec, "codec_reason": state.codec_reason} if state.codec is not None else {}
        return {"kvsp": {"scope": state.scope, "compat_id": state.compat_ids[0].hex(), **ranks, **codec,
                         "external_tokens": state.external, "matched_blocks": state.matched,
                         "local_tokens": state.local_tokens, **state.counts, **stream}}

    def close(self) -> None:
        if self._loop is not None and self._index is not None:
            try:
                self._loop.run(self._index.close(), 5)
            except Exception as exc:  # closing: nothing left to protect
                log.debug("closing the IS client: %s", exc)
            self._loop.close()

    # -- internals ----------------------------------------------------------------------------
    def _asynchronous(self, state: _Request) -> bool:
        """A streamed load is always asynchronous: it waits for the producer's forward pass."""
        return self.settings.async_loads or (state.stream is not None and state.stream.consumer)

    @staticmethod
    def _mark_producing(plan: StepPlan, req_id: str, state: _Request, computed: int) -> None:
        """A stream's producer still prefilling in this step: the workers mark the step's end."""
        if state.stream is not None and state.stream.producer and computed < state.prompt_len:
            plan.producing.append(req_id)

    def _compat_ids(self, adapters: tuple[str, ...]) -> tuple[bytes, ...]:
        """The Compatibility ID of every rank's blocks under ``adapters`` (computed once)."""
        ids = self._compat.get(adapters)
        if ids is None:
            ids = tuple(compat_id(self.model.descriptor(rank, adapters or None))
                        for rank in range(self.model.world_size))
            self._compat[adapters] = ids
        return ids

    def _unshare(self, request: Any, reason: str) -> None:
        if request.request_id not in self._unshared:
            self._unshared[request.request_id] = reason
            log.info("KVSP: request %s shares nothing: %s", request.request_id, reason)

    def _state(self, request: Any) -> _Request | None:
        state = self._requests.get(request.request_id)
        if state is not None or not self.settings.enabled or request.request_id in self._unshared:
            return state
        params = getattr(request, "kv_transfer_params", None) or {}
        if "kvsp_scope" in params and not self._warned_scope_param:
            self._warned_scope_param = True
            log.warning("KVSP: kv_transfer_params['kvsp_scope'] is ignored: a scope is selected only by the "
                        "secret cache_salt the operator configured (scope_salts, docs/vllm.md)")
        if "kvsp_codec" in params and not self._warned_codec_param:
            self._warned_codec_param = True
            log.warning("KVSP: kv_transfer_params['kvsp_codec'] is ignored: the codec a request loads in is the "
                        "operator's codec_policy (docs/vllm.md \"Codecs\")")
        choice = self.settings.scope_of(params, getattr(request, "cache_salt", None))
        if choice.scope is None:
            if params.get("kvsp") is not False:
                self._unshare(request, choice.reason or "no scope")
            return None
        try:
            stream = StreamParams.of(params, self.kv_role)
        except StreamError as exc:
            self._unshare(request, str(exc))
            return None
        if getattr(request, "mm_features", None):
            self._unshare(request, "multimodal inputs are not covered by Block Keys")
            return None
        if getattr(request, "prompt_embeds", None) is not None:
            self._unshare(request, "prompt embeddings are not covered by Block Keys")
            return None
        adapters: tuple[str, ...] = ()
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            try:
                adapters = (adapter_digest(lora.lora_path),)
            except DescriptorError as exc:
                self._unshare(request, f"LoRA adapter {lora.lora_name!r}: {exc}")
                return None
        compat_ids = self._compat_ids(adapters)
        key = self.settings.scopes[choice.scope]
        tokens: Sequence[int] = request.prompt_token_ids or []
        keys = tuple(block_keys(key, c, list(tokens), self.block_tokens) for c in compat_ids)
        state = _Request(choice.scope, scope_id(key), compat_ids, keys, stream=stream, prompt_len=len(tokens))
        codec = self.settings.codec_of(choice.scope, params)
        if codec.codec is not None:
            state.codec, state.codec_reason = codec.codec.name, codec.reason
        self._requests[request.request_id] = state
        return state

    def _start_lookup(self, state: _Request) -> None:
        """One lookup per rank of every complete block (also those the full-hit rule leaves to
        compute: a block the IS knows is not published again), concurrently, on the client loop;
        bounded there and here by ``deadline_ms``."""
        assert self._loop is not None and self._index is not None
        index, deadline = self._index, self.settings.deadline_s
        self.lookups += 1
        bodies = [LookupRequest(scope_id=state.scope_id, compat_id=c, block_keys=tuple(keys))
                  for c, keys in zip(state.compat_ids, state.keys)]

        async def all_ranks() -> list[LookupResponse]:
            lookups = asyncio.gather(*(index.lookup(body) for body in bodies))
            return list(await asyncio.wait_for(lookups, deadline))

        state.lookup = self._loop.submit(all_ranks())
        state.lookup_deadline = time.monotonic() + deadline

    def _lookup_result(self, lookup: concurrent.futures.Future[list[LookupResponse]]) -> list[LookupResponse] | None:
        """The lookup's answer; None (no hit: the IS is advisory, §6.1) if it failed or is late."""
        if not lookup.done():
            lookup.cancel()
            self.lookup_failures += 1
            log.warning("KVSP lookup not answered within %d ms: computing the prompt", self.settings.deadline_ms)
            return None
        try:
            return lookup.result()
        except (Exception, concurrent.futures.CancelledError) as exc:
            self.lookup_failures += 1
            log.warning("KVSP lookup failed (%s): computing the prompt", exc or type(exc).__name__)
            return None

    def _plan_saves(self, plan: StepPlan, req_id: str, state: _Request, computed: int, scheduled: int) -> None:
        if not self.settings.publish or state.saved_upto is None:
            return
        if computed < state.frontier:
            # vLLM rewound the request (a block failed to load): what it computes again is
            # saved again (the worker discarded the saves of the failed step).
            state.saved_upto = min(state.saved_upto, computed // self.block_tokens)
        state.frontier = computed + scheduled
        m = self.block_tokens // self.model.page_tokens
        complete = min((computed + scheduled) // self.block_tokens, len(state.keys[0]), len(state.block_ids) // m)
        if complete <= state.saved_upto:
            return
        blocks = tuple(BlockSave(i, tuple(state.block_ids[i * m:(i + 1) * m]), tuple(keys[i] for keys in state.keys))
                       for i in range(state.saved_upto, complete))
        state.saved_upto = complete
        stream = state.stream.stream_id if state.stream is not None and state.stream.producer else None
        plan.saves.append(RequestSave(req_id, state.scope_id, state.compat_ids, blocks, stream_id=stream))
