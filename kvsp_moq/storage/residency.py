"""Residency: which layers of a replica live in which tier (kvsp-draft §4.4), and where the
layers of a new replica go (placement).

Placement policy (ours; the draft leaves it to the holder): the layers of a new replica are
assigned in ascending order, the fastest tier first. A tier takes the lowest remaining layers
as long as they fit in the octets it can offer (free space plus what eviction can reclaim);
the first layer that does not fit, and every later one, spills to the next slower tier. The
lowest layers end up in the fastest tier because a consumer loads layers in ascending order
(§4.3) and starts computing on layer 0 while the later ones arrive, so the slow tail is
hidden behind computation; this is the device/host split §4.4 says a holder reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..kvsp.records import Residency
from .tiers import Tier

__all__ = ["plan_placement", "ranges_of", "residency_entries"]


def plan_placement(sizes: Sequence[int], room: Sequence[int]) -> list[int] | None:
    """The tier index (into ``room``, fastest first) of each layer, in ascending layer order,
    or ``None`` when the layers do not fit. The result is non-decreasing."""
    if not room:
        return None if sizes else []
    plan: list[int] = []
    tier = 0
    left = room[0]
    for size in sizes:
        while size > left:
            tier += 1
            if tier == len(room):
                return None
            left = room[tier]
        plan.append(tier)
        left -= size
    return plan


def ranges_of(layers: Iterable[int]) -> list[tuple[int, int]]:
    """Ascending layer indices grouped into inclusive ranges of consecutive layers."""
    out: list[tuple[int, int]] = []
    for layer in layers:
        if out and out[-1][1] + 1 == layer:
            out[-1] = (out[-1][0], layer)
        else:
            out.append((layer, layer))
    return out


def residency_entries(placement: Iterable[tuple[int, Tier]]) -> tuple[Residency, ...]:
    """Residency entries (§4.4) of ``(layer, tier)`` pairs given in ascending layer order.

    Consecutive layers in the same tier form one entry; ranges are inclusive and never
    overlap (§4.4 "Layer ranges are inclusive and MUST NOT overlap"); each entry carries the
    tier's ``read_mbit_per_s`` when configured (§6.4 uses it to reduce the link rate).
    """
    runs: list[tuple[Tier, int, int]] = []
    for layer, tier in placement:
        if runs and runs[-1][0] is tier and runs[-1][2] + 1 == layer:
            runs[-1] = (tier, runs[-1][1], layer)
        else:
            runs.append((tier, layer, layer))
    return tuple(
        Residency(tier=tier.name, layers=(first, last), read_mbit_per_s=tier.read_mbit_per_s)
        for tier, first, last in runs
    )
