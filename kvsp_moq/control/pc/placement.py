"""Placement by cost (kvsp-draft §6.4), as pure functions over the PC's inputs.

    wait_us(i)  = queued(i) * mean service time at i
    cost(i)     = wait_us(i) + min( fetch_us(i) + recompute_us_of_unmatched(i),
                                    recompute_us_of_all(i) )

``fetch_us`` comes from the IS's lookup with targets (§6.2; :mod:`.common.estimates` computes it), which
also gives ``recompute_us`` of the *matched* tokens. With ``tokens`` the prompt's length and
``prefill_tokens_per_s`` the instance's rate (§6.4 ``recompute_us = 1e6 * tokens / rate``):

- ``recompute_us_of_all = 1e6 * tokens / rate``;
- ``recompute_us_of_unmatched = recompute_us_of_all - recompute_us(matched)`` (both from the
  same status record: the PC feeds the IS the records it receives), never below 0.

A target the IS could not estimate (no links to the sources, unknown descriptor) has no
``fetch_us``: its cost is ``wait_us + recompute_us_of_all``. An instance reporting no prefill
rate cannot recompute: its recompute terms are infinite and it is never acceptable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...kvsp.records import InstanceStatusRecord, TargetEstimate
from ..common.records import Candidate

#: ``mean service time at i`` in µs, per instance (§6.4 leaves it to the PC).
ServiceTime = Callable[[InstanceStatusRecord], float]


@dataclass(frozen=True)
class Limits:
    """What makes a candidate acceptable (§6.4 "acceptable cost or capacity")."""

    max_cost_us: float = math.inf
    max_queued: int = 1_000_000
    max_kv_utilization: float = 1.0


def candidate(
    status: InstanceStatusRecord,
    estimate: TargetEstimate | None,
    *,
    tokens: int,
    service_time_us: ServiceTime,
    limits: Limits = Limits(),
) -> Candidate:
    """The §6.4 terms and cost of one instance."""
    wait = status.queued * service_time_us(status)
    rate = status.prefill_tokens_per_s
    recompute_all = 1e6 * tokens / rate if rate > 0 else math.inf
    fetch = estimate.fetch_us if estimate is not None else None
    matched_recompute = estimate.recompute_us if estimate is not None else 0.0
    unmatched = max(0.0, recompute_all - matched_recompute)
    load = recompute_all if fetch is None else min(fetch + unmatched, recompute_all)
    cost = wait + load
    acceptable = (
        math.isfinite(cost)
        and cost <= limits.max_cost_us
        and status.queued <= limits.max_queued
        and status.kv_utilization <= limits.max_kv_utilization
    )
    finite = cost if math.isfinite(cost) else 1.7976931348623157e308
    return Candidate(
        instance=status.instance,
        wait_us=wait,
        fetch_us=fetch,
        recompute_unmatched_us=unmatched if math.isfinite(unmatched) else finite,
        recompute_all_us=recompute_all if math.isfinite(recompute_all) else finite,
        cost_us=finite,
        acceptable=acceptable,
    )


def best(candidates: Sequence[Candidate], *, acceptable_only: bool = True) -> Candidate | None:
    """The lowest cost (§6.4 SHOULD), ties to the smaller URL; ``None`` if there is none."""
    pool = [c for c in candidates if c.acceptable or not acceptable_only]
    return min(pool, key=lambda c: (c.cost_us, c.instance), default=None)


def loads_cache(c: Candidate) -> bool:
    """Whether the chosen plan loads cached blocks rather than recomputing all (§6.4 min)."""
    return c.fetch_us is not None and c.fetch_us + c.recompute_unmatched_us < c.recompute_all_us
