"""An instance's side of resharding (kvsp-draft §6.9).

``POST reshard`` carries one of three messages (:func:`~kvsp_moq.kvsp.records.parse_reshard_message`):

- a **plan** from version v to v+1: the instance checks that it holds every ``retain`` range
  of v (retained memory stays in place, never transferred), loads every ``fetch`` range from
  the named instance (``GET {from}shards/{map}/{v}?tokens=a-b``) into staging, and answers 200
  (:class:`~.common.session_records.ReshardAck`) once all are loaded ("acknowledges the plan with
  200 after it has loaded all ranges listed in fetch"). The same plan again awaits the same
  work. Version v stays authoritative: it keeps serving v's ranges to its peers;
- **commit** v+1: the staged ranges become held, the ``release`` ranges are dropped, and v+1 is
  the instance's version of the map;
- **abort** v+1: the fetches in flight are cancelled and the staged ranges discarded; v stays.
  A plan arriving after an abort that found nothing to cancel (the abort overtook it) is
  refused once (409), so that it cannot stage ranges nobody will commit. An abort overtook
  its plan only if no plan to v+1 reached this member yet: an abort after a plan it refused
  (404, 409, 412), or after the same abort (the PC sends its decision again after a
  takeover), finds nothing to cancel too, and is no reason to refuse the PC's next plan to
  v+1 (each refused plan would cause another abort, and every retry of v+1 would fail here).
  The price: if the abort of a *retry* overtakes its plan, that late plan stages its ranges;
  the next plan to v+1 awaits them (the same plan) or gets 412 and the abort that follows
  discards them.

A plan whose ``from`` is not the version the instance holds is refused with
``kvsp-stale-epoch`` (409; versions order maps as epochs order sessions); a retain range not
held, with 404. Counters: ``fetched_octets`` and ``served_octets`` (KV octets, no framing).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from ...kvsp.container import decode_container
from ...kvsp.errors import KvspError, RecordError
from ...kvsp.records import ReshardAbort, ReshardCommit, ReshardPlan
from ..common.errors import NotFound, PreconditionFailed, ShardFetchFailed, StaleEpoch
from ..common.session_records import ReshardAck
from ..common.shard_store import RangeNotHeld, ShardSlice, ShardStore, TokenRange, subtract

__all__ = ["ReshardParticipant", "ShardFetcher"]

log = logging.getLogger(__name__)

#: Aborts remembered for plans not seen yet (§6.9: an abort can overtake its plan), and plans
#: remembered as seen (so that their aborts are not taken for such ones): each at most this many.
MAX_ABORTED = 1024


class ShardFetcher(Protocol):
    """Loads a token range from a peer instance (``client.http.HttpShardFetcher``)."""

    async def fetch(self, source: str, map_id: str, version: int, tokens: TokenRange) -> ShardSlice:
        """``GET {source}shards/{map}/{version}?tokens=a-b``; :class:`ShardFetchFailed` otherwise."""
        ...


@dataclass
class _Pending:
    plan: ReshardPlan
    task: asyncio.Task[int]


class ReshardParticipant:
    """One instance's resharding state (see the module notes)."""

    def __init__(self, store: ShardStore, fetcher: ShardFetcher | None) -> None:
        self.store = store
        self.fetcher = fetcher
        self.versions: dict[str, int] = {}  # the authoritative version held per map
        self._pending: dict[str, _Pending] = {}
        # aborts that found no plan, oldest first; bounded, since any abort message adds one
        self._aborted: dict[tuple[str, int], None] = {}
        # (map, to) of the plans that reached this member, whatever the answer; bounded likewise
        self._planned: dict[tuple[str, int], None] = {}
        self.fetched_octets = 0
        self.served_octets = 0

    def install(self, map_id: str, version: int, data: ShardSlice) -> None:
        """Hold ``data`` as part of ``version`` of the map (the engine computed it)."""
        current = self.versions.get(map_id)
        if current is not None and current != version:
            raise ValueError(f"map {map_id!r} is at version {current} here, not {version}")
        self.versions[map_id] = version
        self.store.install(map_id, data)

    def install_container(self, map_id: str, version: int, tokens: TokenRange, body: bytes | memoryview) -> ShardSlice:
        """``PUT {ii}shards/{map}/{version}?tokens=a-b`` (ours): hold the KV of [a, b) that a
        producer computed (a KVB1 container: codec raw, layers from 0, Token Count b - a).
        400 for another container; 409 ``kvsp-stale-epoch`` when the map is at another version
        here (install a version before resharding it; a reshard moves ranges afterwards)."""
        try:
            box = decode_container(body)
        except KvspError as exc:
            raise RecordError("body", f"not a KVB1 container: {exc}") from None
        header = box.header
        if header.codec != 1 or header.first_layer != 0:
            raise RecordError("body", "the container must be codec raw (1) with layers from 0")
        if header.token_count != tokens[1] - tokens[0]:
            raise RecordError("tokens", f"the container holds {header.token_count} tokens, not [{tokens[0]}, {tokens[1]})")
        current = self.versions.get(map_id)
        if current is not None and current != version:
            raise StaleEpoch(f"map {map_id!r} is at version {current} here, not {version}")
        try:
            data = ShardSlice(tokens, tuple((bytes(layer.k), bytes(layer.v)) for layer in box.layers()))
        except ValueError as exc:
            raise RecordError("body", str(exc)) from None
        self.install(map_id, version, data)
        return data

    # -- serving peers -----------------------------------------------------------------------------

    async def serve(self, map_id: str, version: int, tokens: TokenRange) -> ShardSlice:
        """A peer's fetch: the held KV of ``tokens`` in ``version`` (404 for another version)."""
        if self.versions.get(map_id) != version:
            raise NotFound(f"map {map_id!r} version {version} is not held here")
        data = await self.store.read(map_id, tokens)
        self.served_octets += data.nbytes
        return data

    # -- the three messages ------------------------------------------------------------------------

    async def plan(self, plan: ReshardPlan) -> ReshardAck:
        key = (plan.map, plan.to_version)
        _remember(self._planned, key)
        if key in self._aborted:  # its abort overtook it: refuse it once (a retry then works)
            del self._aborted[key]
            raise StaleEpoch(f"the reshard of {plan.map!r} to version {plan.to_version} was aborted")
        pending = self._pending.get(plan.map)
        if pending is not None:
            if pending.plan != plan:
                raise PreconditionFailed(f"another reshard of {plan.map!r} (to {pending.plan.to_version}) is in progress")
        else:
            current = self.versions.get(plan.map)
            if current is not None and current != plan.from_version:
                raise StaleEpoch(f"map {plan.map!r} is at version {current} here, the plan is from {plan.from_version}")
            missing = subtract(list(plan.retain), list(self.store.held(plan.map)))
            if missing:
                raise RangeNotHeld(f"map {plan.map!r}: retain ranges {missing} are not held here")
            if plan.fetch and self.fetcher is None:
                raise NotFound("this instance cannot fetch ranges (no fetcher)")
            self.versions.setdefault(plan.map, plan.from_version)
            pending = _Pending(plan, asyncio.get_running_loop().create_task(self._load(plan)))
            self._pending[plan.map] = pending
        await asyncio.wait([pending.task])  # raises only when this request itself is cancelled
        if pending.task.cancelled():
            raise StaleEpoch(f"the reshard of {plan.map!r} to version {plan.to_version} was aborted")
        return ReshardAck(map=plan.map, to=plan.to_version, fetched_octets=pending.task.result())

    async def _load(self, plan: ReshardPlan) -> int:
        assert self.fetcher is not None or not plan.fetch
        fetcher = self.fetcher

        async def one(source: str, tokens: TokenRange) -> int:
            assert fetcher is not None
            data = await fetcher.fetch(source, plan.map, plan.from_version, tokens)
            if data.tokens != tokens:
                raise ShardFetchFailed(f"{source} sent tokens {data.tokens}, not {tokens}")
            await self.store.stage(plan.map, plan.to_version, data)
            self.fetched_octets += data.nbytes
            return data.nbytes

        try:
            sizes = await asyncio.gather(*(one(f.source, f.tokens) for f in plan.fetch))
        except ShardFetchFailed as exc:
            raise NotFound(f"a fetch of the plan failed: {exc}") from None
        return sum(sizes)

    def commit(self, message: ReshardCommit) -> None:
        pending = self._pending.get(message.map)
        if pending is None or pending.plan.to_version != message.commit:
            if self.versions.get(message.map) == message.commit:
                return  # committed already
            raise NotFound(f"no plan of {message.map!r} to version {message.commit} here")
        if not pending.task.done() or pending.task.cancelled() or pending.task.exception() is not None:
            raise PreconditionFailed(f"the plan of {message.map!r} to {message.commit} has not loaded its ranges")
        del self._pending[message.map]
        self.store.commit(message.map, message.commit, pending.plan.release)
        self.versions[message.map] = message.commit

    def abort(self, message: ReshardAbort) -> None:
        if self.versions.get(message.map, -1) >= message.abort:
            raise RecordError("abort", f"version {message.abort} of {message.map!r} is committed here")
        pending = self._pending.get(message.map)
        if pending is not None and pending.plan.to_version == message.abort:
            del self._pending[message.map]
            pending.task.cancel()
            pending.task.add_done_callback(lambda _: self.store.discard(message.map, message.abort))
        elif (message.map, message.abort) not in self._planned:  # it overtook its plan (module notes)
            _remember(self._aborted, (message.map, message.abort))
        self.store.discard(message.map, message.abort)

    def staged_maps(self) -> list[str]:
        return sorted(self._pending)

    async def close(self) -> None:
        tasks = [p.task for p in self._pending.values()]
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _remember(keys: dict[tuple[str, int], None], key: tuple[str, int]) -> None:
    """Add ``key`` (as the newest); past :data:`MAX_ABORTED`, forget the oldest (its plan, or
    its abort, is long overdue)."""
    keys.pop(key, None)
    keys[key] = None
    if len(keys) > MAX_ABORTED:
        del keys[next(iter(keys))]
