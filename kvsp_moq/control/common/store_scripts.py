"""Lua scripts of the Redis stores, run in one round trip and acknowledged once replicated
(DESIGN.md §8; docs/deploy.md "Redis Cluster" and "Durability").

:func:`run_scripts` sends a list of script calls at once: on one Redis, one pipeline (one
round trip); on a cluster, one pipeline per primary the calls touch, on one connection each,
sent in parallel. Each call's keys must share one hash slot (each store's keys carry a hash
tag).

A write is acknowledged only when ``spec.wait_replicas`` replicas have it: each pipeline ends
with ``WAIT n timeout`` (half the store timeout) on the connection that wrote (``WAIT`` counts
the writes of its own connection, so it must follow them there: redis-py's cluster pipeline may
send a retried ``WAIT`` to another node, which is why a cluster's pipelines are sent node by
node here), and fewer replicas than asked is :class:`~.errors.StoreUnavailable`. On a cluster, a call that met
a slot being moved (``MOVED``/``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``) did not run: the slot map
is refreshed and those calls are sent once more; a connection error refreshes the map and is
:class:`~.errors.StoreUnavailable` (whether the write ran is unknown; every write of the stores
is safe to repeat). Scripts travel as ``EVAL`` (Redis caches them by their SHA1): a primary
promoted or restarted since the last call never answers ``NOSCRIPT``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.exceptions import AskError, ClusterDownError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import StoreUnavailable
from .store import StoreClient, StoreSpec

__all__ = ["ScriptCall", "run_scripts"]

#: Errors of a connection: the node may be gone.
_LOST = (RedisConnectionError, RedisTimeoutError, OSError)
#: Errors after which a call did not run and is sent again (once) on a refreshed slot map.
_NOT_RUN = (AskError, TryAgainError, ClusterDownError)  # AskError: MOVED too


@dataclass(frozen=True)
class ScriptCall:
    """One script call: its body, its keys (one slot), its arguments."""

    script: str
    keys: Sequence[str | bytes]
    args: Sequence[str | bytes | int]

    def command(self) -> tuple[Any, ...]:
        return ("EVAL", self.script, len(self.keys), *self.keys, *self.args)


def _wait_ms(spec: StoreSpec) -> int:
    """``WAIT``'s own timeout: half the store timeout, so its answer (fewer replicas than
    asked) comes before the socket's timeout does."""
    return max(1, spec.timeout_ms // 2)


def _check_waits(spec: StoreSpec, waits: Sequence[Any]) -> None:
    for reached in waits:
        if isinstance(reached, BaseException):
            raise reached
        if int(reached) < spec.wait_replicas:
            raise StoreUnavailable(f"the store {spec.redacted}: a write reached {int(reached)} of "
                                   f"{spec.wait_replicas} replicas within {_wait_ms(spec)} ms")


async def run_scripts(client: StoreClient, spec: StoreSpec, calls: Sequence[ScriptCall], *,
                      write: bool = True) -> list[Any]:
    """The answers of ``calls``, in order; a ``write`` waits for the replicas as the module
    notes say. Raises the first error a call met."""
    if not calls:
        return []
    wait = write and spec.wait_replicas > 0
    if isinstance(client, RedisCluster):
        return await _run_on_cluster(client, spec, calls, wait)
    pipe = client.pipeline(transaction=False)
    for call in calls:
        pipe.execute_command(*call.command())
    if wait:
        pipe.execute_command("WAIT", spec.wait_replicas, _wait_ms(spec))
    answers = list(await pipe.execute())
    _check_waits(spec, answers[len(calls):])
    return answers[:len(calls)]


def _primary(client: RedisCluster, key: str | bytes) -> ClusterNode:
    """The node that serves ``key``'s slot, per the client's slot map."""
    served = client.nodes_manager.slots_cache.get(client.keyslot(key))
    if not served:
        raise SlotNotCoveredError(f"slot {client.keyslot(key)} is not served by the cluster")
    return served[0]


async def _run_on_cluster(client: RedisCluster, spec: StoreSpec, calls: Sequence[ScriptCall],
                          wait: bool) -> list[Any]:
    await client.initialize()  # the slot map, on the first call (idempotent after)
    answers: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i in todo:
            node = _primary(client, calls[i].keys[0])
            by_node.setdefault(node.name, (node, []))[1].append(i)

        async def send(node: ClusterNode, members: list[int]) -> None:
            commands = [PipelineCommand(n, *calls[i].command()) for n, i in enumerate(members)]
            if wait:
                commands.append(PipelineCommand(len(members), "WAIT", spec.wait_replicas, _wait_ms(spec)))
            await node.execute_pipeline(commands)
            for i, command in zip(members, commands):
                answers[i] = command.result
            if wait and not any(isinstance(answers[i], _NOT_RUN) for i in members):
                _check_waits(spec, [commands[-1].result])

        try:
            await asyncio.gather(*(send(node, members) for node, members in by_node.values()))
        except _LOST:
            await client.nodes_manager.initialize()  # a node is gone: ask the cluster again
            raise
        todo = [i for i in todo if isinstance(answers[i], _NOT_RUN)]
        if not todo:
            break
        if attempt == 0:
            await client.nodes_manager.initialize()
    for answer in answers:
        if isinstance(answer, BaseException):
            if isinstance(answer, _LOST):
                await client.nodes_manager.initialize()
            raise answer
    return answers
