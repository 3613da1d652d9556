"""The worker side of the connector: loads into and publications out of vLLM's paged cache.

vLLM calls these on its forward path (one worker per device); they only copy between the
paged cache and host arrays (:mod:`.layout`) and hand work to the client loop
(:mod:`.transfers`), every wait bounded by ``deadline_ms`` from the step's start:

- :meth:`WorkerSide.start_load_kv` — starts the loads of the step's external blocks (one
  :func:`~.transfers.load` task per block, in the codec the request's ``codec_policy`` names:
  decoded to the KV cache's dtype before it is placed); vLLM calls it before the forward pass
  of a step with synchronous loads, after it otherwise;
- :meth:`WorkerSide.get_finished` — asynchronous loads (the default): after each step, the
  requests whose blocks have all arrived verified (or failed, or passed ``deadline_ms``) have
  their layers copied into the paged cache at the block ids vLLM allocated, on vLLM's thread
  while the request is outside the batch, and are reported loaded; their failed blocks are
  reported by :meth:`get_block_ids_with_load_errors` in the same step (vLLM recomputes from
  the first one). A step never waits for a transfer;
- :meth:`WorkerSide.wait_for_layer_load` — layer l of every loading block, once verified,
  copied into the paged cache at the block ids vLLM allocated; a block that failed (or is not
  in by the deadline) is reported by :meth:`get_block_ids_with_load_errors` and nothing of its
  layer is written (vLLM's ``kv_load_failure_policy="recompute"`` recomputes it);
- :meth:`WorkerSide.save_kv_layer` — at the step's first layer a writer is opened for each
  block completed in this step; layer l of each, copied out of the paged cache, is written to
  its writer (published over MOQT as computed);
- :meth:`WorkerSide.wait_for_save` — seals the step's blocks (whole in the worker's store,
  served over MOQT: ``blocks_published``) and hands them to the background publications
  (:class:`~.transfers.Publications`: HTTP holder and IS record, ``max_saves_in_flight`` at a
  time; a block sealed while all are taken is ``publish_dropped``: served over MOQT, its record
  published by the refresh, no HTTP copy), and settles the step's layer-wise loads. The step
  waits for none of the publications (:meth:`WorkerSide.flush` does, for tests and benches);
  one that fails later is counted for its request (``publish_errors``) if it still runs.

Prefill→decode streams (:mod:`.stream`): a streamed block of a load is SUBSCRIBEd to through
the relay (:func:`~.transfers.stream`) rather than FETCHed; the time each of its layers was
verified is marked (``layer_ns``). A producer's saves begin their replicas under the stream's
replica ids; the end of each forward pass of a producing request is marked
(``forward_end_ns``). The marks go back to the scheduler with the counters (CLOCK_MONOTONIC
ns: comparable between the engines of a host); vLLM hands a step's to the scheduler after it
finished the requests that end in that step, so a prefill's last pass is never among them.

A KVSP block is m of vLLM's blocks (pages, ``block_tokens``): a load fills the pages the plan
names (``plan.BlockLoad.pages``), a save reads the block's m pages in order.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...kvsp.layout import Geometry
from ...storage import BlockWriter, RecordKey
from .layout import PagedLayout, layout_for
from .loop import ClientLoop
from .plan import StepPlan, merge_counts, merge_marks
from .settings import ConnectorSettings
from .stream import stream_replica_id
from .transfers import Incoming, Peers, Publications, begin_block, load, seal, stream, write_layer

__all__ = ["WorkerSide", "layer_index"]

log = logging.getLogger(__name__)

_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    found = _LAYER_NUMBER.findall(name)
    if not found:
        raise ValueError(f"no layer number in the layer name {name!r}")
    return int(found[-1])


@dataclass
class _AsyncLoad:
    """One request's asynchronous load: its blocks and when the worker stops waiting."""

    req_id: str
    blocks: list[Incoming]
    deadline: float


@dataclass
class _Saving:
    req_id: str
    block_ids: tuple[int, ...]  # its pages, in order
    writer: BlockWriter


class WorkerSide:
    """The worker role's state (module notes). vLLM-free: :mod:`.connector` forwards to it."""

    def __init__(self, settings: ConnectorSettings, descriptor: Mapping[str, Any], rank: int = 0,
                 page_tokens: int | None = None) -> None:
        """``descriptor``: this rank's (its shard's geometry); ``rank``: its tensor-parallel rank,
        which picks its Compatibility IDs, Block Keys and records out of each step's plan;
        ``page_tokens``: vLLM's block size (default: the descriptor's ``block_tokens``)."""
        self.settings = settings
        self.rank = rank
        self.layers = int(descriptor["layers"])
        self.block_tokens = int(descriptor["block_tokens"])
        self.page_tokens = page_tokens or self.block_tokens
        self.geometry = Geometry.from_descriptor_fields(int(descriptor["kv_heads"]), int(descriptor["head_dim"]),
                                                        str(descriptor["kv_dtype"]))
        self.loop = ClientLoop("kvsp-worker")
        self.peers: Peers | None = None
        self.publications: Publications | None = None
        if settings.enabled:
            self.peers = self.loop.run(Peers.open(settings), max(30.0, 2 * settings.deadline_s))
            if self.peers.publisher is not None:
                self.publications = Publications(self.peers.publisher, settings.max_saves_in_flight)
        self.caches: dict[str, Any] = {}
        self.layout: PagedLayout | None = None
        self._incoming: list[Incoming] = []  # this step's layer-wise (synchronous) loads
        self._loading: dict[str, _AsyncLoad] = {}  # asynchronous loads in flight, by request
        #: Set (on the client loop) when a load task ends: until then, and until a deadline,
        #: ``get_finished`` answers without a round trip to the loop. vLLM calls it every
        #: millisecond while a request waits for its KV, and each round trip would take the
        #: GIL from the transfers it waits for.
        self._settled_any = threading.Event()
        self._layer_names: dict[int, str] = {}
        self._saving: list[_Saving] = []
        self._saves_begun = False
        self._deadline = 0.0
        self._errors: set[int] = set()
        self._counts: dict[str, dict[str, int]] = {}
        #: Per-request time marks (module notes), reported with the counters.
        self._marks: dict[str, dict[str, list[int]]] = {}
        #: Counters the client loop adds later (publications that failed in the background).
        self._late: dict[str, dict[str, int]] = {}
        self._late_lock = threading.Lock()

    # -- registration ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any], backend: str,
                           kv_scales: tuple[str | None, str | None] = (None, None)) -> None:
        """``kv_scales``: (the fp8 scales this worker's layers run with, those its descriptor
        states) as ``kv_scales`` digests (:mod:`.descriptor`); when they differ the worker
        shares nothing: every load is reported failed (recomputed), nothing is published."""
        self.caches = dict(kv_caches)
        if not self.caches:
            return
        actual, stated = kv_scales
        if actual != stated:
            log.error("KVSP: this worker's fp8 KV scales (%s) are not the checkpoint's its descriptor states (%s): "
                      "it shares nothing (docs/vllm.md \"Dtypes\")", actual, stated)
            self.caches = {}
            return
        self._layer_names = {layer_index(name): name for name in self.caches}
        shape = tuple(next(iter(self.caches.values())).shape)
        self.layout = layout_for(backend, shape, kv_heads=self.geometry.kv_heads,
                                 head_dim=self.geometry.head_dim, block_tokens=self.page_tokens)
        log.info("KVSP: %d layers of %s, backend %s: layout %s", len(self.caches), shape, backend, self.layout.kind)

    # -- loads ------------------------------------------------------------------------------------
    def start_load_kv(self, plan: StepPlan) -> None:
        self._deadline = time.monotonic() + self.settings.deadline_s
        if self.peers is None or self.layout is None:
            for req in plan.loads:
                for b in req.blocks:
                    self._errors.update(b.block_ids)
            return
        if plan.loads:
            try:
                started = self.loop.run(self._start_loads(plan), self.settings.deadline_s)
            except Exception as exc:  # never into vLLM's step: the blocks are recomputed
                log.warning("KVSP: loads of this step not started (%s): recomputing", exc)
                for req in plan.loads:
                    for b in req.blocks:
                        self._errors.update(b.block_ids)
                    if req.asynchronous:
                        self._loading[req.req_id] = _AsyncLoad(req.req_id, [], 0.0)  # reported at once
                return
            deadline = time.monotonic() + self.settings.deadline_s
            for req in plan.loads:
                blocks = [b for b in started if b.req_id == req.req_id]
                if req.asynchronous:
                    self._loading[req.req_id] = _AsyncLoad(req.req_id, blocks, deadline)
                else:
                    self._incoming.extend(blocks)

    async def _start_loads(self, plan: StepPlan) -> list[Incoming]:
        assert self.peers is not None
        out = []
        r = self.rank
        for req in plan.loads:
            for block in req.blocks:
                incoming = Incoming(req.req_id, block.pages, self.layers, streamed=block.streamed)
                key = RecordKey(req.compat_ids[r], req.scope_id, block.block_keys[r])
                if block.streamed and req.stream_id is not None:
                    work = stream(self.peers, incoming, key, req.stream_id, self.geometry, self.block_tokens,
                                  codec=req.codec)
                else:
                    work = load(self.peers, incoming, key, block.records[r], self.geometry, self.block_tokens,
                                codec=req.codec)
                incoming.task = asyncio.get_running_loop().create_task(work)
                incoming.task.add_done_callback(lambda _task: self._settled_any.set())
                out.append(incoming)
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._incoming or layer_name not in self.caches:
            return
        layer = layer_index(layer_name)
        pending = []
        for block in self._incoming:
            if block.failed_from is not None and block.failed_from <= layer:
                self._errors.update(block.block_ids)  # failed before vLLM reached this layer
            else:
                pending.append(block)
        if not pending:
            return
        remaining = self._deadline - time.monotonic()
        try:
            got = self.loop.run(self._layer_of(pending, layer), max(remaining, 0.001))
        except TimeoutError:
            log.warning("KVSP: layer %d not in within the deadline (%d ms): recomputing", layer,
                        self.settings.deadline_ms)
            self.loop.call(self._give_up, pending, layer)
            got = [None] * len(pending)
        assert self.layout is not None
        cache = self.caches[layer_name]
        for block, kv in zip(pending, got):
            if kv is not None:
                try:
                    self._write(cache, block, kv[0], kv[1])
                    continue
                except Exception as exc:  # never into vLLM's step: this block is recomputed
                    log.warning("KVSP: layer %d of blocks %s not placed (%s): recomputing", layer, block.block_ids, exc)
                    self.loop.call(self._give_up, [block], layer)
            self._errors.update(block.block_ids)
            block.failed_from = layer if block.failed_from is None else min(layer, block.failed_from)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The asynchronous loads that are over (module notes): (None, request ids)."""
        if not self._loading:
            return None, None
        loads = list(self._loading.values())
        if not self._settled_any.is_set() and not finished_req_ids.intersection(self._loading) \
                and time.monotonic() < min(load.deadline for load in loads):
            return None, None  # nothing can have changed (module notes)
        self._settled_any.clear()
        try:
            over = set(self.loop.run(self._settled(loads, set(finished_req_ids)), self.settings.deadline_s))
        except Exception as exc:  # the client loop is gone or stuck: give every load up
            log.warning("KVSP: asynchronous loads not settled (%s): recomputing them", exc)
            for load in loads:
                for block in load.blocks:
                    block.failed_from = 0  # not placed, reported failed (the loop is not touched)
            over = {load.req_id for load in loads}
        done: set[str] = set()
        counts: dict[str, dict[str, int]] = {}
        for req_id in over:
            load = self._loading.pop(req_id)
            for block in load.blocks:
                self._place(block)
            self._count(counts, load.blocks)
            arrivals = [t for block in load.blocks if block.streamed for t in block.arrived_ns if t]
            if arrivals:
                merge_marks(self._marks, {req_id: {"layer_ns": arrivals}})
            done.add(req_id)
        merge_counts(self._counts, counts)
        return None, done

    async def _settled(self, loads: list[_AsyncLoad], aborted: set[str]) -> list[str]:
        """On the loop: the requests whose every block has arrived or failed; a request past its
        deadline, or aborted by vLLM, is given up (what has not arrived fails)."""
        now = time.monotonic()
        out = []
        for load in loads:
            pending = [b for b in load.blocks if not all(e.is_set() for e in b.ready)]
            if pending and (now >= load.deadline or load.req_id in aborted):
                if load.req_id not in aborted:
                    log.warning("KVSP: request %s not loaded within %d ms: recomputing what is missing",
                                load.req_id, self.settings.deadline_ms)
                for block in pending:
                    first = next(i for i, e in enumerate(block.ready) if not e.is_set())
                    block.fail(first)
                    if block.task is not None:
                        block.task.cancel()
                pending = []
            if not pending:
                out.append(load.req_id)
        return out

    def _place(self, block: Incoming) -> None:
        """Every layer of a block that arrived whole into the paged cache; a block that did not
        (or cannot be placed) is reported failed."""
        if block.failed_from is None and self.layout is not None:
            try:
                for layer, kv in enumerate(block.kv):
                    assert kv is not None
                    self._write(self.caches[self._layer_names[layer]], block, kv[0], kv[1])
                return
            except Exception as exc:  # never into vLLM's step: this block is recomputed
                log.warning("KVSP: blocks %s not placed (%s): recomputing", block.block_ids, exc)
                block.failed_from = 0
        self._errors.update(block.block_ids)

    def _write(self, cache: Any, block: Incoming, k: Any, v: Any) -> None:
        """One layer of a KVSP block (kvsp-layout-1, ``block_tokens`` tokens) into the pages
        of the paged cache it fills (consecutive pages of the block: one indexed copy)."""
        assert self.layout is not None
        n, first = self.page_tokens, block.pages[0][0]
        end = first + len(block.pages)
        self.layout.write_pages(cache, list(block.block_ids), k[first * n:end * n], v[first * n:end * n])

    def _read(self, cache: Any, block_ids: tuple[int, ...]) -> tuple[Any, Any]:
        """One layer of a KVSP block out of its pages (kvsp-layout-1 host arrays)."""
        assert self.layout is not None
        return self.layout.read_pages(cache, list(block_ids))

    @staticmethod
    def _count(counts: dict[str, dict[str, int]], blocks: list[Incoming]) -> set[str]:
        """Add loaded blocks' counters; the requests with a failed block."""
        failed = set()
        for block in blocks:
            c = counts.setdefault(block.req_id, {})
            if block.failed_from is not None:
                failed.add(block.req_id)
                c["blocks_failed"] = c.get("blocks_failed", 0) + 1
            elif block.source is not None:
                name = {"moqt": "blocks_moqt", "stream": "blocks_streamed"}.get(block.source, "blocks_http")
                c[name] = c.get(name, 0) + 1
            for via, octets in block.octets.items():
                c[f"bytes_{via}"] = c.get(f"bytes_{via}", 0) + octets
            if block.coded:  # received in the codec of the request's codec_policy
                c["blocks_coded"] = c.get("blocks_coded", 0) + 1
            for via, octets in block.coded.items():
                c[f"coded_bytes_{via}"] = c.get(f"coded_bytes_{via}", 0) + octets
        return failed

    @staticmethod
    async def _layer_of(blocks: list[Incoming], layer: int) -> list[Any]:
        return list(await asyncio.gather(*(b.layer(layer) for b in blocks)))

    @staticmethod
    def _give_up(blocks: list[Incoming], layer: int) -> None:
        for block in blocks:
            if not block.ready[layer].is_set():
                block.fail(layer)
                if block.task is not None:
                    block.task.cancel()

    # -- saves ------------------------------------------------------------------------------------
    async def _begin_saves(self, plan: StepPlan) -> list[_Saving]:
        assert self.peers is not None
        out = []
        r = self.rank
        for req in plan.saves:
            for block in req.blocks:
                key = RecordKey(req.compat_ids[r], req.scope_id, block.block_keys[r])
                replica = stream_replica_id(req.stream_id, key) if req.stream_id is not None else None
                writer = begin_block(self.peers, key, self.geometry, self.layers, self.block_tokens,
                                     replica_id=replica)
                if writer is not None:
                    out.append(_Saving(req.req_id, block.block_ids, writer))
        return out

    def save_kv_layer(self, layer_name: str, kv_layer: Any, plan: StepPlan) -> None:
        if not plan.saves or self.peers is None or self.layout is None or layer_name not in self.caches:
            return
        if not self._saves_begun:
            # vLLM starts a step without sync loads *after* its forward (start_load_kv), so the
            # writers are opened here, at the step's first layer.
            self._saves_begun = True
            try:
                self._saving = self.loop.run(self._begin_saves(plan), self.settings.deadline_s)
            except Exception as exc:  # never into vLLM's step: these blocks are not published
                log.warning("KVSP: publications of this step not begun: %s", exc)
                self._saving = []
        layer = layer_index(layer_name)
        kept = []
        for saving in self._saving:
            try:
                k, v = self._read(kv_layer, saving.block_ids)
            except Exception as exc:  # never into vLLM's step: this block is not published
                log.warning("KVSP: layer %d of blocks %s not copied out (%s): not publishing it", layer,
                            saving.block_ids, exc)
                self.loop.call(saving.writer.abort)
                continue
            self.loop.call(write_layer, saving.writer, layer, k, v)
            kept.append(saving)
        self._saving = kept

    def wait_for_save(self, plan: StepPlan | None = None) -> None:
        if plan is not None and plan.producing:  # the end of a forward pass of streams' producers
            now = time.monotonic_ns()
            merge_marks(self._marks, {req_id: {"forward_end_ns": [now]} for req_id in plan.producing})
        self._saves_begun = False
        saving, self._saving = self._saving, []
        incoming, self._incoming = self._incoming, []
        if not saving and not incoming:
            return
        try:
            self.loop.run(self._settle(saving, incoming), max(self._deadline - time.monotonic(), 0.001))
        except TimeoutError:
            log.warning("KVSP: the client loop did not seal this step's blocks within the deadline")

    async def _settle(self, saving: list[_Saving], incoming: list[Incoming]) -> None:
        """On the loop: the step's layer-wise loads counted, its blocks sealed and handed to the
        background publications (module notes); nothing here waits on a peer."""
        counts: dict[str, dict[str, int]] = {}
        for block in incoming:
            if block.task is not None and not block.task.done():
                block.task.cancel()  # vLLM is past this step: what did not arrive is recomputed
            if block.failed_from is not None:
                self._errors.update(block.block_ids)
        failed_requests = self._count(counts, incoming)
        # Blocks computed over a context that failed to load are wrong: never published
        # (vLLM recomputes the request from its first failed block; the scheduler plans the
        # saves again).
        for s in saving:
            if s.req_id in failed_requests and s.writer.open:
                s.writer.abort()
        for s in saving:
            if s.req_id in failed_requests:
                continue
            c = counts.setdefault(s.req_id, {})
            if not seal(s.writer):
                c["publish_errors"] = c.get("publish_errors", 0) + 1
                continue
            c["blocks_published"] = c.get("blocks_published", 0) + 1
            if self.publications is None or not self.publications.submit(s.writer.key, self._outcome(s.req_id)):
                c["publish_dropped"] = c.get("publish_dropped", 0) + 1
        merge_counts(self._counts, counts)

    def _outcome(self, req_id: str) -> Any:
        """The callback of one background publication: a failure is counted for ``req_id``."""
        wanted = {"holder"} if self.settings.holder_url else set()
        if self.peers is not None and self.peers.publisher is not None and self.peers.publisher.moqt_records is not None:
            wanted.add("moqt")

        def outcome(result: list[str] | BaseException) -> None:
            if isinstance(result, BaseException) or not wanted <= set(result):
                with self._late_lock:
                    c = self._late.setdefault(req_id, {})
                    c["publish_errors"] = c.get("publish_errors", 0) + 1

        return outcome

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) for the background publications; True when none is left.
        Never called by vLLM: tests and benches call it (``EngineProcess.flush``) before asking
        another engine for what this one computed."""
        if self.publications is None:
            return True
        publications = self.publications
        try:
            return self.loop.run(publications.flush(timeout), timeout + 1)
        except TimeoutError:
            return False

    # -- reporting --------------------------------------------------------------------------------
    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        if errors:
            log.warning("KVSP: blocks %s failed to load: vLLM recomputes them", sorted(errors))
        return errors

    def take_marks(self) -> dict[str, dict[str, list[int]]]:
        marks, self._marks = self._marks, {}
        return marks

    def take_counts(self) -> dict[str, dict[str, int]]:
        counts, self._counts = self._counts, {}
        with self._late_lock:
            late, self._late = self._late, {}
        return merge_counts(counts, late)

    def close(self) -> None:
        for load in self._loading.values():
            for block in load.blocks:
                if block.task is not None:
                    self.loop.call(block.task.cancel)
        if self.peers is not None:
            try:
                if self.publications is not None:
                    self.loop.run(self.publications.close(), 10)
                self.loop.run(self.peers.close(), 10)
            except Exception as exc:
                log.debug("closing the KVSP peers: %s", exc)
        self.loop.close()
