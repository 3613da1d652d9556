"""Reshard plans from Shard Map version v to v+1 (kvsp-draft §6.9), as pure functions.

For each instance in either version, with O its ranges in v and N its ranges in v+1:

- ``retain`` = O ∩ N: "A token range assigned to the same instance in both versions MUST
  appear in retain for that instance and MUST NOT be transferred";
- ``fetch``  = N − O, split by the instance holding each part in v (``from``);
- ``release`` = O − N, dropped after the commit.

Adjacent ranges are merged (fetches only when they have the same source). Both versions must
cover the same tokens: a token of v+1 outside v would have no source, and one of v outside v+1
nobody to hold it.
"""

from __future__ import annotations

from ...kvsp.errors import RecordError
from ...kvsp.records import RangeFetch, ReshardPlan, ShardMap
from ..common.shard_store import TokenRange, intersect, subtract

__all__ = ["member_ranges", "reshard_plans", "span"]


def member_ranges(shard_map: ShardMap) -> dict[str, list[TokenRange]]:
    """The ranges of each instance of a map."""
    out: dict[str, list[TokenRange]] = {}
    for shard in shard_map.shards:
        out.setdefault(shard.instance, []).append(shard.tokens)
    return out


def span(shard_map: ShardMap) -> TokenRange:
    """The tokens a map covers (its shards are contiguous)."""
    return shard_map.shards[0].tokens[0], shard_map.shards[-1].tokens[1]


def reshard_plans(old: ShardMap, new: ShardMap, deadline_ms: int) -> dict[str, ReshardPlan]:
    """The plan of every instance in ``old`` or ``new`` (``RecordError`` if the maps do not
    form a version step of one map over the same tokens)."""
    if new.map != old.map:
        raise RecordError("map", f"is {new.map!r}, not the map {old.map!r}")
    if new.version != old.version + 1:
        raise RecordError("version", f"must be {old.version + 1} (the authoritative version is {old.version})")
    if span(new) != span(old):
        raise RecordError("shards", f"must cover the tokens of version {old.version}, {list(span(old))}, got {list(span(new))}")
    before, after = member_ranges(old), member_ranges(new)
    plans = {}
    for instance in sorted(set(before) | set(after)):
        mine_then, mine_now = before.get(instance, []), after.get(instance, [])
        fetch: list[RangeFetch] = []
        for a, b in subtract(mine_now, mine_then):
            for shard in old.shards:
                lo, hi = max(a, shard.tokens[0]), min(b, shard.tokens[1])
                if lo >= hi:
                    continue
                if fetch and fetch[-1].source == shard.instance and fetch[-1].tokens[1] == lo:
                    fetch[-1] = RangeFetch(tokens=(fetch[-1].tokens[0], hi), source=shard.instance)
                else:
                    fetch.append(RangeFetch(tokens=(lo, hi), source=shard.instance))
        plans[instance] = ReshardPlan(
            map=new.map, from_version=old.version, to_version=new.version, deadline_ms=deadline_ms,
            retain=tuple(intersect(mine_then, mine_now)), fetch=tuple(fetch), release=tuple(subtract(mine_then, mine_now)),
        )
    return plans
