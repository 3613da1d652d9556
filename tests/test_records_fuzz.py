"""Property tests of the KVSP records: generated valid records round-trip through JSON text,
and arbitrary input (bytes, text, JSON values, mutated valid records) gives a record or a
RecordError, never another exception."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvsp_moq.kvsp.errors import RecordError
from kvsp_moq.kvsp.naming import BlockName
from kvsp_moq.kvsp.records import (
    INSTANCE_STATES,
    PREFETCH_STATES,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    Link,
    LookupRequest,
    LookupResponse,
    MatchedBlock,
    PrefetchBlock,
    PrefetchDirective,
    PrefetchStatus,
    Problem,
    RangeFetch,
    Record,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    Residency,
    Sampler,
    SessionCheckpoint,
    SessionResume,
    Shard,
    ShardMap,
    StateChange,
    TargetEstimate,
    parse_json,
    parse_reshard_message,
    reshard_message_from_json,
)
from kvsp_moq.kvsp.records.members import MAX_SAFE_INT, JsonObject

#: Examples per property; raise it (``KVSP_FUZZ_EXAMPLES=2000``) for a longer fuzzing run.
EXAMPLES = int(os.environ.get("KVSP_FUZZ_EXAMPLES", "30"))
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = FAST

# --- building blocks ---------------------------------------------------------------------------

hex32 = st.binary(min_size=32, max_size=32)
hex16 = st.binary(min_size=16, max_size=16)
uints = st.integers(0, MAX_SAFE_INT)
positive = st.integers(1, MAX_SAFE_INT)
non_negative = st.integers(0, MAX_SAFE_INT) | st.floats(min_value=0, max_value=1e300)
rates = st.integers(1, MAX_SAFE_INT) | st.floats(min_value=0, max_value=1e300, exclude_min=True)
tokens = st.integers(0, 2**32 - 1)
short_text = st.text(max_size=12)
non_empty_text = st.text(min_size=1, max_size=12)
tiers = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,10}", fullmatch=True)
hosts = st.from_regex(r"[a-z][a-z0-9-]{0,8}(\.[a-z]{2,4}){0,2}", fullmatch=True)
paths = st.from_regex(r"(/[a-z0-9._~-]{0,6}){0,3}/?", fullmatch=True)
ports = st.sampled_from(["", ":1", ":443", ":65535"])


def urls(*schemes: str) -> st.SearchStrategy[str]:
    return st.builds(lambda s, h, p, q: f"{s}://{h}{p}{q}", st.sampled_from(schemes), hosts, ports, paths)


http_urls = urls("http", "https")
holder_urls = urls("http", "https", "moqt")
uuids = st.uuids()

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=4)


def disjoint_ranges(draw: Callable[..., Any], limit: int, *, inclusive: bool) -> list[tuple[int, int]]:
    """Non-overlapping ranges within [0, limit), in random order."""
    cuts = sorted(draw(st.sets(st.integers(1, limit - 1), max_size=6))) if limit > 1 else []
    bounds = [0, *cuts, limit]
    ranges = [(a, b - 1 if inclusive else b) for a, b in zip(bounds, bounds[1:])]
    kept = [r for r in ranges if draw(st.booleans())]
    return draw(st.permutations(kept))


# --- record strategies -------------------------------------------------------------------------


@st.composite
def replicas(draw: Callable[..., Any], block_key: bytes | None = None) -> ReplicaRecord:
    key = block_key if block_key is not None else draw(hex32)
    compat, scope = draw(hex32), draw(hex16)
    layers = draw(st.integers(1, 12))
    layer_digests = tuple(draw(hex32) for _ in range(layers)) if draw(st.booleans()) else None
    digest = hashlib.sha256(b"".join(layer_digests)).digest() if layer_digests else draw(hex32)
    ranges = disjoint_ranges(draw, layers, inclusive=True) or [(0, layers - 1)]
    residency = tuple(Residency(tier=draw(tiers), layers=r, read_mbit_per_s=draw(st.none() | rates)) for r in ranges)
    if draw(st.booleans()):
        holder = draw(urls("moqt"))
        namespace: str | None = BlockName(compat, scope, key, draw(hex16)).moqt_namespace()
    else:
        holder, namespace = draw(urls("http", "https")), None
    return ReplicaRecord(
        block_key=key, compat_id=compat, scope_id=scope, holder=holder, codec=draw(st.integers(0, 0xFFFF)),
        size=draw(uints), digest=digest, layer_digests=layer_digests, residency=residency,
        ttl_ms=draw(positive), moqt_namespace=namespace,
    )


links = st.builds(Link, holder=holder_urls, mbit_per_s=rates, rtt_us=non_negative)

statuses = st.builds(
    InstanceStatusRecord,
    instance=http_urls, epoch=uints, state=st.sampled_from(INSTANCE_STATES), running=uints, queued=uints,
    batch_size=uints, kv_utilization=st.floats(0, 1) | st.sampled_from([0, 1]),
    prefill_tokens_per_s=non_negative, decode_tokens_per_s=non_negative,
    links=st.lists(links, max_size=4, unique_by=lambda link: link.holder).map(tuple),
    requested_state=st.sampled_from([None, "sleeping"]), ttl_ms=positive,
)

samplers = st.builds(
    Sampler,
    method=st.text(min_size=1, max_size=20), params=json_objects.map(lambda d: JsonObject().read(d, "params")),
    seed=st.integers(-(2**63), 2**64 - 1), step=uints, deterministic=st.booleans(),
)


@st.composite
def checkpoints(draw: Callable[..., Any]) -> SessionCheckpoint:
    generated = tuple(draw(st.lists(tokens, max_size=8)))
    return SessionCheckpoint(
        session=draw(uuids), epoch=draw(uints), compat_id=draw(hex32), scope_id=draw(hex16),
        prompt_blocks=tuple(draw(st.lists(hex32, max_size=4))), prompt_tail=tuple(draw(st.lists(tokens, max_size=8))),
        generated=generated, output_offset=len(generated), sampler=draw(samplers),
    )


@st.composite
def resumes(draw: Callable[..., Any]) -> SessionResume:
    checkpoint = draw(checkpoints())
    checkpoint = dataclasses.replace(checkpoint, epoch=min(checkpoint.epoch, MAX_SAFE_INT - 1))
    return SessionResume(epoch=draw(st.integers(checkpoint.epoch + 1, MAX_SAFE_INT)), checkpoint=checkpoint)


@st.composite
def shard_maps(draw: Callable[..., Any]) -> ShardMap:
    start = draw(st.integers(0, 2**40))
    widths = draw(st.lists(st.integers(1, 2**20), min_size=1, max_size=6))
    shards = []
    for width in widths:
        shards.append(Shard(tokens=(start, start + width), instance=draw(http_urls)))
        start += width
    return ShardMap(map=draw(non_empty_text), version=draw(uints), shards=tuple(shards))


@st.composite
def reshard_plans(draw: Callable[..., Any]) -> ReshardPlan:
    ranges = disjoint_ranges(draw, draw(st.integers(1, 2**20)), inclusive=False)
    lists: tuple[list[tuple[int, int]], ...] = ([], [], [])
    for r in ranges:
        lists[draw(st.integers(0, 2))].append(r)
    version = draw(st.integers(0, MAX_SAFE_INT - 1))
    return ReshardPlan(
        map=draw(non_empty_text), from_version=version, to_version=version + 1, deadline_ms=draw(positive),
        retain=tuple(lists[0]), fetch=tuple(RangeFetch(tokens=r, source=draw(holder_urls)) for r in lists[1]),
        release=tuple(lists[2]),
    )


prefetch_blocks = st.builds(PrefetchBlock, block_key=hex32, sources=st.lists(holder_urls, min_size=1, max_size=3).map(tuple))
directives = st.builds(
    PrefetchDirective,
    directive=uuids, request_ref=st.none() | short_text, scope_id=hex16, compat_id=hex32,
    blocks=st.lists(prefetch_blocks, min_size=1, max_size=3).map(tuple), deadline_ms=positive, lease_ms=positive,
)
prefetch_statuses = st.builds(
    PrefetchStatus, directive=uuids, state=st.sampled_from(PREFETCH_STATES),
    loaded=st.lists(hex32, max_size=3).map(tuple), error=st.none() | short_text,
)
lookups = st.builds(
    LookupRequest, scope_id=hex16, compat_id=hex32, block_keys=st.lists(hex32, min_size=1, max_size=5).map(tuple),
    targets=st.none() | st.lists(http_urls, max_size=3).map(tuple),
)


@st.composite
def matched_blocks(draw: Callable[..., Any]) -> MatchedBlock:
    key = draw(hex32)
    return MatchedBlock(block_key=key, replicas=tuple(draw(st.lists(replicas(block_key=key), min_size=1, max_size=2))))


targets = st.builds(TargetEstimate, instance=http_urls, fetch_us=non_negative, recompute_us=non_negative)


@st.composite
def lookup_responses(draw: Callable[..., Any]) -> LookupResponse:
    blocks = tuple(draw(st.lists(matched_blocks(), max_size=2)))
    found = draw(st.none() | st.lists(targets, max_size=2).map(tuple))
    return LookupResponse(matched=len(blocks), blocks=blocks, targets=found)


lease_requests = st.builds(LeaseRequest, block_keys=st.lists(hex32, min_size=1, max_size=4).map(tuple), compat_id=hex32, scope_id=hex16, ttl_ms=positive)
lease_grants = st.builds(LeaseGrant, lease=st.from_regex(r"[A-Za-z0-9._~-]{1,20}", fullmatch=True), ttl_ms=positive, expires_ms=st.none() | uints)
problem_records = st.builds(
    Problem, type=short_text, title=st.none() | short_text, status=st.none() | st.integers(100, 599),
    detail=st.none() | short_text, instance=st.none() | short_text,
)

STRATEGIES: dict[type[Record], st.SearchStrategy[Any]] = {
    ReplicaRecord: replicas(),
    InstanceStatusRecord: statuses,
    StateChange: st.builds(StateChange, state=st.sampled_from(["active", "draining", "sleeping"])),
    SessionCheckpoint: checkpoints(),
    SessionResume: resumes(),
    ShardMap: shard_maps(),
    ReshardPlan: reshard_plans(),
    ReshardCommit: st.builds(ReshardCommit, map=non_empty_text, commit=uints),
    ReshardAbort: st.builds(ReshardAbort, map=non_empty_text, abort=uints),
    PrefetchDirective: directives,
    PrefetchStatus: prefetch_statuses,
    LookupRequest: lookups,
    LookupResponse: lookup_responses(),
    LeaseRequest: lease_requests,
    LeaseGrant: lease_grants,
    LeaseRenewal: st.builds(LeaseRenewal, ttl_ms=positive),
    Problem: problem_records,
}
NESTED: list[type[Record]] = [Residency, Link, Sampler, Shard, RangeFetch, PrefetchBlock, MatchedBlock, TargetEstimate]
ALL_TYPES = [*STRATEGIES, *NESTED]


def _ids(t: type) -> str:
    return t.__name__


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("record_type", list(STRATEGIES), ids=_ids)
def test_round_trip(record_type: type[Record]) -> None:
    @ROUND_TRIP
    @given(STRATEGIES[record_type])
    def check(record: Record) -> None:
        text = json.dumps(record.to_json(), allow_nan=False, ensure_ascii=False)
        again = parse_json(text.encode("utf-8"), record_type)
        assert again == record
        assert again.to_json() == record.to_json()

    check()


@ROUND_TRIP
@given(st.one_of(STRATEGIES[ReshardPlan], STRATEGIES[ReshardCommit], STRATEGIES[ReshardAbort]))
def test_reshard_message_round_trip(message: Record) -> None:
    assert parse_reshard_message(json.dumps(message.to_json())) == message


# --- fuzzing: only RecordError escapes ---------------------------------------------------------

_MEMBER_NAMES = sorted(
    {(f.metadata["kvsp_member"].name or f.name) for t in ALL_TYPES for f in dataclasses.fields(t)}  # type: ignore[arg-type]
)
#: Python values, JSON or not, with member names that the records know.
wild_values = st.recursive(
    json_scalars | st.floats() | st.binary(max_size=4) | st.sampled_from(["sha-256:" + "0" * 64, "0" * 64, "0" * 32, "https://h.example/", "moqt://r.example/"]),
    lambda inner: st.lists(inner, max_size=4)
    | st.tuples(inner)
    | st.dictionaries(st.sampled_from(_MEMBER_NAMES) | st.text(max_size=4), inner, max_size=6),
    max_leaves=24,
)


def only_record_errors(call: Callable[[], object]) -> None:
    try:
        call()
    except RecordError as exc:
        assert isinstance(exc.member, str) and exc.member


@pytest.mark.parametrize("record_type", ALL_TYPES, ids=_ids)
def test_fuzz_from_json(record_type: type[Record]) -> None:
    @FAST
    @given(wild_values)
    def check(value: object) -> None:
        only_record_errors(lambda: record_type.from_json(value))

    check()


@pytest.mark.parametrize("record_type", ALL_TYPES, ids=_ids)
def test_fuzz_parse_json(record_type: type[Record]) -> None:
    @FAST
    @given(st.binary(max_size=200) | st.text(max_size=100) | json_values.map(json.dumps) | json_values.map(lambda v: json.dumps(v).encode()[:-1]))
    def check(data: bytes | str) -> None:
        only_record_errors(lambda: parse_json(data, record_type))

    check()


@FAST
@given(wild_values | st.binary(max_size=100))
def test_fuzz_reshard_message(value: Any) -> None:
    only_record_errors(lambda: reshard_message_from_json(value))
    if isinstance(value, (bytes, str)):
        only_record_errors(lambda: parse_reshard_message(value))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, (*prefix, index))
    return out


_DELETE = object()


@pytest.mark.parametrize("record_type", list(STRATEGIES), ids=_ids)
def test_fuzz_mutated_records(record_type: type[Record]) -> None:
    """Replace or delete one member deep inside a valid record: a record or a RecordError."""

    @FAST
    @given(STRATEGIES[record_type], st.data())
    def check(record: Record, data: st.DataObject) -> None:
        doc = record.to_json()
        paths = _paths(doc)
        assume(paths)
        path = data.draw(st.sampled_from(paths))
        value = data.draw(st.just(_DELETE) | wild_values)
        node: Any = doc
        for step in path[:-1]:
            node = node[step]
        if value is _DELETE and isinstance(node, dict):
            del node[path[-1]]
        elif value is not _DELETE:
            node[path[-1]] = value
        try:
            mutated = record_type.from_json(doc)
        except RecordError:
            return
        assert record_type.from_json(mutated.to_json()) == mutated

    check()


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@FAST
@given(json_values, st.booleans())
def test_depth_limit_is_exact(value: object, pretty: bool) -> None:
    body = {"state": "active", "x": value}
    depth = _depth(body)
    text = json.dumps(body, indent=1 if pretty else None, ensure_ascii=False)
    assert parse_json(text, StateChange, max_depth=depth).state == "active"
    with pytest.raises(RecordError):
        parse_json(text, StateChange, max_depth=depth - 1)
