"""What ``kvsp soak`` reads from the roles, and its one JSON report.

* :class:`EngineWatch`: every ``every_s`` the engine counters of each live instance
  (``GET {ii}engine``), kept per incarnation (a SIGKILLed instance's counters end with it: the
  last reading before the kill stands for it, so what an incarnation did in its last
  ``every_s`` may be missing — fallbacks are a lower bound, never the zero counts);
* :func:`check_digests`: at the end, every replica of every prompt block the IS lists whose
  holder serves blocks over HTTP (the holder; the instances' own store records only say where
  the KV is resident, §6.4, and are counted apart) is fetched and verified against
  its record (Repr-Digest, layer digests, replica digest, §6.7, ``retrieve_block``): a replica
  that fails is a **block served with a wrong digest**; one that is gone (404, its holder down)
  is counted apart;
* RSS of every role, from ``/proc``, when the cluster is up and at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

from ...control.client.http import HttpBlockFetcher, HttpIndexClient
from ...control.client.retrieval import BlockFetcher, RetrievalFailed, retrieve_block
from ...kvsp.records import LookupRequest
from ..demo.cluster import http_request
from .roles import SoakCluster

__all__ = ["EngineWatch", "check_digests", "percentile", "rss"]

#: Engine counters summed over every incarnation of every instance (``GET {ii}engine``).
_SUMMED = ("sessions", "failed_sessions", "requests", "failed_requests", "output_tokens", "moqt_fallbacks",
           "publish_errors")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 3)


def rss(cluster: SoakCluster) -> dict[str, float | None]:
    return {r.name: r.rss_mib() for r in cluster.roles}


@dataclass
class EngineWatch:
    cluster: SoakCluster
    every_s: float = 2.0
    last: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    async def poll(self) -> None:
        for role in self.cluster.instances:
            if not role.alive or role.stopped:
                continue
            with contextlib.suppress(Exception):
                reply = await http_request(f"{self.cluster.url(role)}engine", token=self.cluster.tokens["client"], timeout=5)
                if reply.status == 200:
                    self.last[(role.name, role.incarnation)] = reply.json()["counters"]

    async def run(self, until_event: asyncio.Event) -> None:
        while not until_event.is_set():
            await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until_event.wait(), self.every_s)

    def fallbacks(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for c in self.last.values():
            for key in _SUMMED:
                out[key] += int(c.get(key, 0))
            for source, value in c.get("request_blocks", {}).items():
                out[f"blocks_{source}"] += int(value.get("blocks", 0))
            for source, value in c.get("prefetch_blocks", {}).items():
                out[f"prefetched_{source}"] += int(value.get("blocks", 0))
        return dict(sorted(out.items()))


async def check_digests(cluster: SoakCluster, index: HttpIndexClient, block_keys: list[bytes], *,
                        scope_id: bytes, compat_id: bytes) -> dict[str, int]:
    """Every HTTP replica of ``block_keys`` the IS lists, fetched and verified (module notes)."""
    found = await index.lookup(LookupRequest(scope_id=scope_id, compat_id=compat_id, block_keys=tuple(block_keys)))
    out: dict[str, Any] = {"replicas_checked": 0, "verified": 0, "wrong_digest": 0, "gone": 0, "moqt_records": 0,
                           "instance_records": 0}
    instances = {cluster.url(r) for r in cluster.instances}
    reasons: Counter[str] = Counter()
    fetcher = HttpBlockFetcher(cluster.tokens["client"], timeout_s=20, read_timeout_s=5)
    try:
        for block in found.blocks:
            for record in block.replicas:
                if not record.holder.startswith(("http://", "https://")):
                    out["moqt_records"] += 1
                    continue
                if record.holder in instances:  # residency of an instance's own store (§6.4): not served
                    out["instance_records"] += 1
                    continue
                out["replicas_checked"] += 1
                try:
                    await retrieve_block(cast(BlockFetcher, fetcher), [record])
                    out["verified"] += 1
                except RetrievalFailed as exc:
                    outcomes = {a.outcome for a in exc.attempts}
                    if "rejected" in outcomes:
                        out["wrong_digest"] += 1
                    else:
                        out["gone"] += 1
                    reasons.update(f"{a.outcome}: {a.detail[:120]}" for a in exc.attempts)
    finally:
        await fetcher.close()
    out["reasons"] = dict(reasons.most_common(5))
    return out
