"""Placement estimates (kvsp-draft §6.4), as pure functions.

    fetch_us(i)     = max over sources s of
                        ( rtt_us(i,s) + 8 * bytes_from(s) / mbit_per_s(i,s) )
                      for blocks not already resident at i
    recompute_us(i) = 1e6 * tokens / prefill_tokens_per_s(i)

Units: 8 * octets / (Mbit/s) is microseconds (1 Mbit/s moves one bit per µs).

How the inputs are read (the draft leaves these open; docs/http-api.md "Estimates"):

- **Layers and octets.** A block has ``L`` layers: the descriptor's ``layers`` when the compat
  is known, else the length of a replica's ``layer_digests``, else one past the highest
  resident layer. A replica's ``size`` is the octets of the whole block in its codec, so a
  layer of it weighs ``size / L``.
- **Resident at i.** The layers of a block are resident at instance ``i`` when a replica of it
  has ``holder`` equal to ``i``'s instance URL (instances publish what they hold, §6.5); those
  layers cost nothing. Only the other layers are fetched.
- **Rates.** ``mbit_per_s(i,s)`` is the link rate ``i`` reports for holder ``s``; for the layers
  of a residency entry with ``read_mbit_per_s`` it is the smaller of the two ("reduced ... to
  the read_mbit_per_s of that tier"). A part of ``bytes_from(s)`` read at another rate takes
  its own time, so the term for ``s`` is ``rtt_us + Σ 8 * octets_part / rate_part``.
- **Sources.** Only holders ``i`` has a link to are usable (the formula needs their rtt and
  rate). Each block is fetched whole from one source that holds all its missing layers; if
  no linked source does, its layers are fetched one by one from sources that hold them. If a
  layer has no linked source at all, ``fetch_us`` cannot be estimated (``None``).
- **Choice of sources.** The formula takes the slowest source, so loading is assumed to run
  in parallel across sources. Sources are chosen greedily to keep that maximum small: blocks
  in decreasing order of their fastest transfer time, each to the source whose finish time
  (``rtt + load so far + this block``) would be smallest, ties to the lexically smaller URL.
  With one source per block this is the fastest replica of each block.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ...kvsp.records import InstanceStatusRecord, Link, ReplicaRecord, TargetEstimate

Ranges = tuple[range, ...]


@dataclass(frozen=True)
class Assignment:
    """Layers of one block to be loaded from one source, and the transfer time they take
    (without the rtt, which §6.4 counts once per source)."""

    block_key: bytes
    layers: Ranges
    holder: str
    transfer_us: float


@dataclass(frozen=True)
class FetchPlan:
    """The sources chosen to make the blocks resident at an instance, and ``fetch_us``."""

    fetch_us: float
    assignments: tuple[Assignment, ...]
    #: ``rtt_us + Σ transfer_us`` per source used: the terms of the max in §6.4.
    source_us: Mapping[str, float]


def transfer_us(octets: float, mbit_per_s: float) -> float:
    """Microseconds to move ``octets`` at ``mbit_per_s`` (§6.4: ``8 * bytes / mbit_per_s``)."""
    return 8.0 * octets / mbit_per_s


def recompute_us(tokens: int, prefill_tokens_per_s: float) -> float | None:
    """``1e6 * tokens / prefill_tokens_per_s`` (§6.4); 0 for no tokens, ``None`` when the
    instance reports no prefill rate (the time is unbounded)."""
    if tokens == 0:
        return 0.0
    if prefill_tokens_per_s <= 0:
        return None
    return 1e6 * tokens / prefill_tokens_per_s


def layer_count(replicas: Iterable[ReplicaRecord], layers: int | None = None) -> int:
    """``L`` of a block (see the module notes): ``layers`` if given, else from the replicas."""
    if layers is not None:
        return layers
    replicas = tuple(replicas)
    listed = [len(r.layer_digests) for r in replicas if r.layer_digests is not None]
    if listed:
        return max(listed)
    return max((entry.layers[1] + 1 for r in replicas for entry in r.residency), default=0)


def needed_layers(instance: str, replicas: Iterable[ReplicaRecord], count: int) -> Ranges:
    """The layers of ``[0, count)`` not resident at ``instance``."""
    resident = _merge(rng for r in replicas if r.holder == instance for rng in r.resident_layers())
    gaps: list[range] = []
    start = 0
    for rng in resident:
        if rng.start >= count:
            break
        if rng.start > start:
            gaps.append(range(start, rng.start))
        start = max(start, rng.stop)
    if start < count:
        gaps.append(range(start, count))
    return tuple(gaps)


def replica_transfer_us(replica: ReplicaRecord, link: Link, layers: Ranges, count: int) -> float | None:
    """Time to load ``layers`` of ``replica`` over ``link``, each residency entry at
    ``min(link rate, read_mbit_per_s)``; ``None`` if the replica lacks one of them."""
    wanted = sum(len(r) for r in layers)
    if wanted == 0:
        return 0.0
    octets_per_layer = replica.size / count
    covered = 0
    total = 0.0
    for entry in replica.residency:
        n = _overlap(entry.layer_range, layers)
        if n:
            rate = link.mbit_per_s
            if entry.read_mbit_per_s is not None:
                rate = min(rate, entry.read_mbit_per_s)
            total += transfer_us(n * octets_per_layer, rate)
            covered += n
    return total if covered == wanted else None  # residency ranges never overlap (§4.4)


def plan_fetch(
    instance: str,
    links: Mapping[str, Link] | Iterable[Link],
    blocks: Sequence[Sequence[ReplicaRecord]],
    *,
    layers: int | None = None,
) -> FetchPlan | None:
    """Choose sources for the blocks (each a non-empty list of replicas of one key) and
    compute ``fetch_us`` at ``instance`` (§6.4). ``None`` if a needed layer has no source
    that the instance reports a link to."""
    by_holder = links if isinstance(links, Mapping) else {link.holder: link for link in links}
    units: list[_Unit] = []
    for position, replicas in enumerate(blocks):
        block_units = _units_of_block(position, instance, by_holder, replicas, layers)
        if block_units is None:
            return None
        units.extend(block_units)

    load: dict[str, float] = {}
    chosen: list[tuple[int, str]] = []
    order = sorted(range(len(units)), key=lambda u: (-min(units[u].times.values()), u))
    for u in order:
        unit = units[u]

        def finish(holder: str, unit: _Unit = unit) -> tuple[float, str]:
            return (by_holder[holder].rtt_us + load.get(holder, 0.0) + unit.times[holder], holder)

        holder = min(unit.times, key=finish)
        load[holder] = load.get(holder, 0.0) + unit.times[holder]
        chosen.append((u, holder))

    source_us = {h: by_holder[h].rtt_us + t for h, t in sorted(load.items())}
    return FetchPlan(
        fetch_us=max(source_us.values(), default=0.0),
        assignments=_assignments(units, chosen),
        source_us=MappingProxyType(source_us),
    )


def estimate_target(
    status: InstanceStatusRecord,
    blocks: Sequence[Sequence[ReplicaRecord]],
    *,
    block_tokens: int,
    layers: int | None = None,
) -> TargetEstimate | None:
    """``fetch_us`` and ``recompute_us`` of the matched blocks at the instance that sent
    ``status`` (§6.2); ``None`` when either cannot be estimated."""
    plan = plan_fetch(status.instance, status.links, blocks, layers=layers)
    if plan is None:
        return None
    recompute = recompute_us(len(blocks) * block_tokens, status.prefill_tokens_per_s)
    if recompute is None or not math.isfinite(plan.fetch_us):
        return None
    return TargetEstimate(instance=status.instance, fetch_us=plan.fetch_us, recompute_us=recompute)


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Unit:
    """Layers of one block that must come from a single source, and the time from each
    candidate source."""

    block: int
    block_key: bytes
    layers: Ranges
    times: Mapping[str, float]


def _units_of_block(
    position: int,
    instance: str,
    links: Mapping[str, Link],
    replicas: Sequence[ReplicaRecord],
    layers: int | None,
) -> list[_Unit] | None:
    if not replicas:
        raise ValueError("every matched block has at least one replica")
    block_key = replicas[0].block_key
    count = layer_count(replicas, layers)
    needed = needed_layers(instance, replicas, count)
    if not needed:
        return []
    sources = [r for r in replicas if r.holder != instance and r.holder in links]
    whole = _times(sources, links, needed, count)
    if whole:
        return [_Unit(position, block_key, needed, whole)]
    units = []
    for rng in needed:  # no source has every missing layer: one unit per layer
        for layer in rng:
            one = (range(layer, layer + 1),)
            times = _times(sources, links, one, count)
            if not times:
                return None
            units.append(_Unit(position, block_key, one, times))
    return units


def _times(sources: Sequence[ReplicaRecord], links: Mapping[str, Link], layers: Ranges, count: int) -> dict[str, float]:
    """The fastest time per holder over the replicas that have all of ``layers``."""
    times: dict[str, float] = {}
    for replica in sources:
        t = replica_transfer_us(replica, links[replica.holder], layers, count)
        if t is not None and t < times.get(replica.holder, math.inf):
            times[replica.holder] = t
    return times


def _assignments(units: Sequence[_Unit], chosen: Iterable[tuple[int, str]]) -> tuple[Assignment, ...]:
    """One assignment per (block, source), in block order, with its layer ranges merged."""
    merged: dict[tuple[int, str], tuple[_Unit, list[range], float]] = {}
    for u, holder in sorted(chosen):
        unit = units[u]
        key = (unit.block, holder)
        first, ranges, total = merged.get(key, (unit, [], 0.0))
        merged[key] = (first, ranges + list(unit.layers), total + unit.times[holder])
    return tuple(
        Assignment(block_key=first.block_key, layers=_merge(ranges), holder=holder, transfer_us=total)
        for (_, holder), (first, ranges, total) in merged.items()
    )


def _overlap(a: range, ranges: Ranges) -> int:
    return sum(max(0, min(a.stop, b.stop) - max(a.start, b.start)) for b in ranges)


def _merge(ranges: Iterable[range]) -> Ranges:
    out: list[range] = []
    for r in sorted((r for r in ranges if r), key=lambda r: r.start):
        if out and r.start <= out[-1].stop:
            out[-1] = range(out[-1].start, max(out[-1].stop, r.stop))
        else:
            out.append(r)
    return tuple(out)
