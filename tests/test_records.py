"""KVSP JSON records (kvsp-draft §4.4, §6): the spec's examples, member errors, cross-member
rules, unknown members and safe JSON decoding. Hypothesis round trips and fuzzing are in
test_records_fuzz.py."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import uuid
from typing import Any

import pytest

from kvsp_moq.kvsp import problems
from kvsp_moq.kvsp.errors import KvspError, RecordError
from kvsp_moq.kvsp.records import (
    DEFAULT_MAX_SIZE,
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRenewal,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    PrefetchStatus,
    Problem,
    Record,
    ReplicaRecord,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    SessionCheckpoint,
    SessionResume,
    ShardMap,
    StateChange,
    decode_json,
    dump_json,
    parse_json,
    parse_reshard_message,
)


def h32(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


COMPAT = h32("compat")
SCOPE = h32("scope")[:32]
KEYS = [h32(f"key{i}") for i in range(4)]
LAYER_DIGESTS = [h32(f"layer{i}") for i in range(32)]
REPLICA_DIGEST = "sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in LAYER_DIGESTS)).hexdigest()


def spec_example(text: str, hex32: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON example copied from the draft, its ``<hex32>`` placeholders replaced in order by
    ``hex32`` and ``<hex16>`` by the scope id."""
    for value in hex32:
        text = text.replace("<hex32>", value, 1)
    assert "<hex32>" not in text
    return json.loads(text.replace("<hex16>", SCOPE))


# --- the examples of kvsp-draft §4.4 and §6, verbatim but for the placeholders -----------------

REPLICA_TEXT = """{
  "block_key": "<hex32>",
  "compat_id": "<hex32>",
  "scope_id": "<hex16>",
  "holder": "https://h1.example/kvsp/",
  "codec": 1,
  "size": 2097152,
  "digest": "sha-256:<hex32>",
  "layer_digests": ["<hex32>", "<hex32>", "..."],
  "residency": [
    { "tier": "device", "layers": [0, 15] },
    { "tier": "host",   "layers": [16, 31],
      "read_mbit_per_s": 400000 }
  ],
  "ttl_ms": 600000
}"""

STATUS_TEXT = """{
  "instance": "https://ii7.example/kvsp/",
  "epoch": 12,
  "state": "active",
  "running": 18, "queued": 3, "batch_size": 32,
  "kv_utilization": 0.71,
  "prefill_tokens_per_s": 42000,
  "decode_tokens_per_s": 3100,
  "links": [
    { "holder": "https://h1.example/kvsp/",
      "mbit_per_s": 200000, "rtt_us": 12 }
  ],
  "requested_state": null,
  "ttl_ms": 3000
}"""

CHECKPOINT_TEXT = """{
  "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
  "epoch": 1,
  "compat_id": "<hex32>",
  "scope_id": "<hex16>",
  "prompt_blocks": ["<hex32>", "<hex32>"],
  "prompt_tail": [374, 264],
  "generated": [1296, 315, 279],
  "output_offset": 3,
  "sampler": { "method": "top-p", "params": {"p": 0.9},
               "seed": 7, "step": 3, "deterministic": false }
}"""

LOOKUP_TEXT = """{
  "scope_id": "<hex16>",
  "compat_id": "<hex32>",
  "block_keys": ["<hex32>", "<hex32>", "<hex32>"],
  "targets": ["https://ii7.example/kvsp/",
              "https://ii9.example/kvsp/"]
}"""

PREFETCH_TEXT = """{
  "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10",
  "request_ref": "opaque-value-from-PC",
  "scope_id": "<hex16>",
  "compat_id": "<hex32>",
  "blocks": [
    { "block_key": "<hex32>",
      "sources": ["https://h1.example/kvsp/"] }
  ],
  "layer_order": "ascending",
  "deadline_ms": 50,
  "lease_ms": 2000
}"""

SHARD_MAP_TEXT = """{
  "map": "c3f8...e1", "version": 4,
  "shards": [
    { "tokens": [0, 32768],
      "instance": "https://ii1.example/kvsp/" },
    { "tokens": [32768, 65536],
      "instance": "https://ii2.example/kvsp/" },
    { "tokens": [65536, 98304],
      "instance": "https://ii3.example/kvsp/" }
  ]
}"""

RESHARD_TEXT = """{
  "map": "c3f8...e1", "from": 4, "to": 5,
  "deadline_ms": 200,
  "retain":  [[0, 32768]],
  "fetch":   [{ "tokens": [32768, 49152],
                "from": "https://ii2.example/kvsp/" }],
  "release": []
}"""


def replica_doc() -> dict[str, Any]:
    text = REPLICA_TEXT.replace('"<hex32>", "<hex32>", "..."', ", ".join(f'"{d}"' for d in LAYER_DIGESTS))
    text = text.replace("sha-256:<hex32>", REPLICA_DIGEST)
    return spec_example(text, (KEYS[0], COMPAT))


def status_doc() -> dict[str, Any]:
    return spec_example(STATUS_TEXT)


def checkpoint_doc() -> dict[str, Any]:
    return spec_example(CHECKPOINT_TEXT, (COMPAT, KEYS[0], KEYS[1]))


def lookup_doc() -> dict[str, Any]:
    return spec_example(LOOKUP_TEXT, (COMPAT, KEYS[0], KEYS[1], KEYS[2]))


def prefetch_doc() -> dict[str, Any]:
    return spec_example(PREFETCH_TEXT, (COMPAT, KEYS[0]))


def shard_map_doc() -> dict[str, Any]:
    return json.loads(SHARD_MAP_TEXT)


def reshard_doc() -> dict[str, Any]:
    return json.loads(RESHARD_TEXT)


def lookup_response_doc() -> dict[str, Any]:
    return {
        "matched": 1,
        "blocks": [{"block_key": KEYS[0], "replicas": [replica_doc()]}],
        "targets": [{"instance": "https://ii7.example/kvsp/", "fetch_us": 1250.5, "recompute_us": 90000}],
    }


def prefetch_status_doc() -> dict[str, Any]:
    return {"directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10", "state": "partial", "loaded": [KEYS[0]], "error": "deadline expired"}


def lease_request_doc() -> dict[str, Any]:
    return {"block_keys": [KEYS[0], KEYS[1]], "compat_id": COMPAT, "scope_id": SCOPE, "ttl_ms": 2000}


def lease_grant_doc() -> dict[str, Any]:
    return {"lease": "l-7f3a", "ttl_ms": 2000, "expires_ms": 1767225600000}


def resume_doc() -> dict[str, Any]:
    return {"epoch": 2, "checkpoint": checkpoint_doc()}


EXAMPLES: dict[str, tuple[type[Record], Any]] = {
    "replica": (ReplicaRecord, replica_doc),
    "status": (InstanceStatusRecord, status_doc),
    "state": (StateChange, lambda: {"state": "draining"}),
    "checkpoint": (SessionCheckpoint, checkpoint_doc),
    "resume": (SessionResume, resume_doc),
    "lookup": (LookupRequest, lookup_doc),
    "lookup_response": (LookupResponse, lookup_response_doc),
    "prefetch": (PrefetchDirective, prefetch_doc),
    "prefetch_status": (PrefetchStatus, prefetch_status_doc),
    "shard_map": (ShardMap, shard_map_doc),
    "reshard": (ReshardPlan, reshard_doc),
    "commit": (ReshardCommit, lambda: {"map": "c3f8...e1", "commit": 5}),
    "abort": (ReshardAbort, lambda: {"map": "c3f8...e1", "abort": 5}),
    "lease_request": (LeaseRequest, lease_request_doc),
    "lease_grant": (LeaseGrant, lease_grant_doc),
    "lease_renewal": (LeaseRenewal, lambda: {"ttl_ms": 1000}),
    "problem": (Problem, lambda: {"type": "urn:kvsp:problem:kvsp-stale-epoch", "title": "Stale epoch", "status": 409, "detail": "epoch 1 < 2", "instance": "/sessions/x"}),
}


# --- path helpers ------------------------------------------------------------------------------

MISSING = object()
_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _steps(path: str) -> list[str | int]:
    return [name if name else int(index) for name, index in _STEP.findall(path)]


def with_member(doc: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """A deep copy of ``doc`` with the member at ``path`` set to ``value`` (or removed)."""
    out = copy.deepcopy(doc)
    *parents, last = _steps(path)
    node: Any = out
    for step in parents:
        node = node[step]
    if value is MISSING:
        del node[last]
    else:
        node[last] = value
    return out


def assert_member_error(record_type: type[Record], doc: object, member: str) -> RecordError:
    with pytest.raises(RecordError) as info:
        record_type.from_json(doc)
    assert info.value.member == member, str(info.value)
    # and the same through the byte-level entry point
    with pytest.raises(RecordError) as info2:
        parse_json(json.dumps(doc).encode(), record_type)
    assert info2.value.member == member
    return info.value


# --- the spec's examples -----------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_parses_and_round_trips(name: str) -> None:
    record_type, make = EXAMPLES[name]
    doc = make()
    record = parse_json(json.dumps(doc).encode(), record_type)
    assert record.to_json() == doc
    assert record_type.from_json(json.loads(json.dumps(record.to_json()))) == record


@pytest.mark.parametrize("name", EXAMPLES)
def test_unknown_members_are_ignored(name: str) -> None:
    record_type, make = EXAMPLES[name]
    doc = make()
    extended = dict(doc, x_unknown={"deep": [1, {"z": None}]}, **{"": 0})
    assert record_type.from_json(extended) == record_type.from_json(doc)
    assert "x_unknown" not in record_type.from_json(extended).to_json()


def test_unknown_members_in_nested_objects_are_ignored() -> None:
    doc = replica_doc()
    doc["residency"][0]["future_member"] = [1, 2]
    record = ReplicaRecord.from_json(doc)
    assert record.to_json() == replica_doc()
    cp = checkpoint_doc()
    cp["sampler"]["temperature_schedule"] = "x"
    assert SessionCheckpoint.from_json(cp).to_json() == checkpoint_doc()


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("bad", [None, [], "x", 1, True])
def test_record_must_be_an_object(name: str, bad: object) -> None:
    record_type, _ = EXAMPLES[name]
    with pytest.raises(RecordError) as info:
        record_type.from_json(bad)
    assert info.value.member == "$"


def test_replica_typed_values() -> None:
    record = ReplicaRecord.from_json(replica_doc())
    assert record.block_key == bytes.fromhex(KEYS[0])
    assert record.compat_id == bytes.fromhex(COMPAT)
    assert record.scope_id == bytes.fromhex(SCOPE)
    assert record.digest == bytes.fromhex(REPLICA_DIGEST.removeprefix("sha-256:"))
    assert record.layer_digests is not None and len(record.layer_digests) == 32
    assert record.residency[1].read_mbit_per_s == 400000
    assert record.residency[0].read_mbit_per_s is None
    assert "read_mbit_per_s" not in record.to_json()["residency"][0]
    assert record.moqt_namespace is None and not record.is_moqt


def test_replica_layer_helpers() -> None:
    doc = replica_doc()
    doc["residency"] = [
        {"tier": "host", "layers": [20, 31]},
        {"tier": "device", "layers": [0, 9]},
        {"tier": "device", "layers": [10, 15]},
    ]
    record = ReplicaRecord.from_json(doc)
    assert record.layers_in("device") == (range(0, 16),)
    assert record.layers_in("host") == (range(20, 32),)
    assert record.layers_in("disk") == ()
    assert record.resident_layers() == (range(0, 16), range(20, 32))
    assert record.residency_of(12) == record.residency[2]
    assert record.residency_of(17) is None
    assert record.holds_layers(0, 15) and record.holds_layers(21, 31)
    assert not record.holds_layers(10, 20) and not record.holds_layers(5, 4)
    assert record.serves_layer_ranges


def test_replica_without_layer_digests() -> None:
    doc = with_member(replica_doc(), "layer_digests", MISSING)
    doc["residency"][1]["layers"] = [16, 79]  # no layer count to check against
    record = ReplicaRecord.from_json(doc)
    assert record.layer_digests is None and not record.serves_layer_ranges
    assert "layer_digests" not in record.to_json()


def test_status_typed_values() -> None:
    record = InstanceStatusRecord.from_json(status_doc())
    assert record.requested_state is None
    assert record.to_json()["requested_state"] is None  # written as in the §4.4 example
    link = record.link_to("https://h1.example/kvsp/")
    assert link is not None and link.mbit_per_s == 200000 and link.rtt_us == 12
    assert record.link_to("https://h2.example/kvsp/") is None
    absent = InstanceStatusRecord.from_json(with_member(status_doc(), "requested_state", MISSING))
    assert absent == record
    sleepy = InstanceStatusRecord.from_json(with_member(status_doc(), "requested_state", "sleeping"))
    assert sleepy.requested_state == "sleeping"


def test_checkpoint_typed_values() -> None:
    record = SessionCheckpoint.from_json(checkpoint_doc())
    assert record.session == uuid.UUID("6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11")
    assert record.prompt_blocks == (bytes.fromhex(KEYS[0]), bytes.fromhex(KEYS[1]))
    assert record.generated == (1296, 315, 279)
    assert record.sampler.params == {"p": 0.9}
    with pytest.raises(TypeError):
        record.sampler.params["p"] = 1.0  # type: ignore[index]
    nested = with_member(checkpoint_doc(), "sampler.params", {"a": [1, {"b": None}], "c": "d"})
    rec = SessionCheckpoint.from_json(nested)
    assert rec.to_json()["sampler"]["params"] == {"a": [1, {"b": None}], "c": "d"}


def test_checkpoint_without_output_yet() -> None:
    doc = checkpoint_doc()
    doc.update(generated=[], output_offset=0, prompt_blocks=[])
    assert SessionCheckpoint.from_json(doc).output_offset == 0


def test_prefetch_layer_order_defaults_to_ascending() -> None:
    record = PrefetchDirective.from_json(with_member(prefetch_doc(), "layer_order", MISSING))
    assert record.layer_order == "ascending"
    assert record == PrefetchDirective.from_json(prefetch_doc())
    no_ref = PrefetchDirective.from_json(with_member(prefetch_doc(), "request_ref", MISSING))
    assert no_ref.request_ref is None and "request_ref" not in no_ref.to_json()


def test_shard_map_helpers() -> None:
    record = ShardMap.from_json(shard_map_doc())
    assert record.instance_of(0) == "https://ii1.example/kvsp/"
    assert record.instance_of(32768) == "https://ii2.example/kvsp/"
    assert record.instance_of(98304) is None


def test_shard_map_need_not_start_at_zero() -> None:
    doc = shard_map_doc()
    doc["shards"] = doc["shards"][1:]
    assert ShardMap.from_json(doc).shards[0].tokens == (32768, 65536)


def test_reshard_lists_default_to_empty() -> None:
    doc = {"map": "m", "from": 0, "to": 1, "deadline_ms": 10}
    plan = ReshardPlan.from_json(doc)
    assert plan.retain == plan.fetch == plan.release == ()
    assert plan.to_json() == dict(doc, retain=[], fetch=[], release=[])


def test_parse_reshard_message() -> None:
    plan = parse_reshard_message(json.dumps(reshard_doc()))
    assert isinstance(plan, ReshardPlan) and plan.fetch[0].source == "https://ii2.example/kvsp/"
    assert plan.from_version == 4 and plan.to_version == 5
    commit = parse_reshard_message(b'{"map": "c3f8...e1", "commit": 5}')
    assert commit == ReshardCommit(map="c3f8...e1", commit=5)
    abort = parse_reshard_message(b'{"map": "c3f8...e1", "abort": 5}')
    assert abort == ReshardAbort(map="c3f8...e1", abort=5)
    for body, member in [
        (b'{"map": "m", "commit": 5, "abort": 5}', "$"),
        (b'{"map": "m", "commit": "5"}', "commit"),
        (b'{"abort": 5}', "map"),
        (b'{"map": "m"}', "from"),
        (b"[]", "$"),
        (b"{", "$"),
    ]:
        with pytest.raises(RecordError) as info:
            parse_reshard_message(body)
        assert info.value.member == member


def test_lookup_max_block_keys() -> None:
    doc = lookup_doc()
    assert len(LookupRequest.from_json(doc, max_block_keys=3).block_keys) == 3
    with pytest.raises(RecordError) as info:
        LookupRequest.from_json(doc, max_block_keys=2)
    assert info.value.member == "block_keys"
    many = dict(doc, block_keys=[KEYS[0]] * 65537)
    with pytest.raises(RecordError) as info:
        LookupRequest.from_json(many)
    assert info.value.member == "block_keys"
    assert LookupRequest.from_json(with_member(doc, "targets", MISSING)).targets is None


def test_lookup_response_answers() -> None:
    request = LookupRequest.from_json(lookup_doc())
    response = LookupResponse.from_json(lookup_response_doc())
    assert response.answers(request)
    other = LookupRequest.from_json(with_member(lookup_doc(), "block_keys", [KEYS[1]]))
    assert not response.answers(other)
    other_scope = LookupRequest.from_json(with_member(lookup_doc(), "scope_id", "0" * 32))
    assert not response.answers(other_scope)
    empty = LookupResponse.from_json({"matched": 0, "blocks": []})
    assert empty.answers(request) and empty.targets is None and empty.to_json() == {"matched": 0, "blocks": []}


def test_problem_of_and_name() -> None:
    problem = Problem.of(problems.STALE_EPOCH, "epoch 1 is older than 2")
    assert problem.to_json() == {
        "type": "urn:kvsp:problem:kvsp-stale-epoch",
        "title": "Stale epoch",
        "status": 409,
        "detail": "epoch 1 is older than 2",
    }
    assert problem.name == problems.STALE_EPOCH
    assert Problem.of(problems.LAYERS_UNAVAILABLE).status == 404  # §6.7
    assert Problem.from_json({"type": "https://peer.example/problems/kvsp-lease-quota"}).name == "kvsp-lease-quota"
    assert Problem.from_json({}).type == "about:blank" and Problem.from_json({}).name is None
    with pytest.raises(ValueError):
        Problem.of("kvsp-no-such-problem")


def test_problem_ignores_mistyped_members() -> None:
    """RFC 9457 §3.1: a member of the wrong type is ignored, not an error."""
    problem = Problem.from_json({"type": 5, "title": ["x"], "status": "404", "detail": None, "instance": {}})
    assert problem == Problem()
    assert Problem.from_json({"status": 700}).status is None
    assert Problem.from_json({"status": 404.0}).status == 404


def test_problem_registry() -> None:
    assert problems.PROBLEM_BASE == "urn:kvsp:problem:"
    assert set(problems.PROBLEM_NAMES) == set(problems.DEFAULT_STATUS) == set(problems.TITLES)
    assert {"kvsp-lease-quota", "kvsp-layers-unavailable", "kvsp-stale-epoch"} == set(problems.SPEC_PROBLEMS)
    for name in problems.PROBLEM_NAMES:
        assert problems.problem_name(problems.problem_type(name)) == name
    assert problems.problem_name("about:blank") is None


# --- every member: missing, mistyped, out of range ---------------------------------------------

REQUIRED: dict[str, list[str]] = {
    "replica": ["block_key", "compat_id", "scope_id", "holder", "codec", "size", "digest", "residency", "ttl_ms",
                "residency[0].tier", "residency[1].layers"],
    "status": ["instance", "epoch", "state", "running", "queued", "batch_size", "kv_utilization",
               "prefill_tokens_per_s", "decode_tokens_per_s", "links", "ttl_ms",
               "links[0].holder", "links[0].mbit_per_s", "links[0].rtt_us"],
    "state": ["state"],
    "checkpoint": ["session", "epoch", "compat_id", "scope_id", "prompt_blocks", "prompt_tail", "generated",
                   "output_offset", "sampler", "sampler.method", "sampler.params", "sampler.seed", "sampler.step",
                   "sampler.deterministic"],
    "resume": ["epoch", "checkpoint", "checkpoint.session"],
    "lookup": ["scope_id", "compat_id", "block_keys"],
    "lookup_response": ["matched", "blocks", "blocks[0].block_key", "blocks[0].replicas",
                        "blocks[0].replicas[0].digest", "targets[0].instance", "targets[0].fetch_us",
                        "targets[0].recompute_us"],
    "prefetch": ["directive", "scope_id", "compat_id", "blocks", "deadline_ms", "lease_ms",
                 "blocks[0].block_key", "blocks[0].sources"],
    "prefetch_status": ["directive", "state", "loaded"],
    "shard_map": ["map", "version", "shards", "shards[1].tokens", "shards[2].instance"],
    "reshard": ["map", "from", "to", "deadline_ms", "fetch[0].tokens", "fetch[0].from"],
    "commit": ["map", "commit"],
    "abort": ["map", "abort"],
    "lease_request": ["block_keys", "compat_id", "scope_id", "ttl_ms"],
    "lease_grant": ["lease", "ttl_ms"],
    "lease_renewal": ["ttl_ms"],
}


@pytest.mark.parametrize(("name", "member"), [(n, m) for n, ms in REQUIRED.items() for m in ms])
def test_missing_member(name: str, member: str) -> None:
    record_type, make = EXAMPLES[name]
    error = assert_member_error(record_type, with_member(make(), member, MISSING), member)
    assert "missing" in str(error)


BAD_HEX32 = ["", "AB" * 32, "ab" * 31, "ab" * 33, "zz" * 32, 5, None, ["ab" * 32]]
BAD_HEX16 = ["", "AB" * 16, "ab" * 15, "ab" * 32, 1, None]
BAD_UINT = [-1, 1.5, "1", True, None, [], {}, 2**53]
BAD_POS = [0, -1, 1.5, "1", False, None]
BAD_URL = ["", "h1.example/kvsp/", "/kvsp/", "ftp://h1.example/", "https:///kvsp/", "https://h1.example:99999/",
           "https://h1 example/", "https://h\u00e9.example/", "HTTPS://h1.example/", 7, None]

INVALID: list[tuple[str, str, list[object]]] = [
    # ReplicaRecord (§4.4)
    ("replica", "block_key", BAD_HEX32),
    ("replica", "compat_id", BAD_HEX32),
    ("replica", "scope_id", BAD_HEX16),
    ("replica", "holder", BAD_URL),
    ("replica", "codec", [-1, 65536, 1.5, "1", True, None]),
    ("replica", "size", [-1, 0.5, "2097152", None, True]),
    ("replica", "digest", ["", COMPAT, "sha-1:" + COMPAT, "sha-256:" + COMPAT.upper(), "sha-256:", 3, None]),
    ("replica", "layer_digests", [[], "x", None, {}, 3]),
    ("replica", "layer_digests[3]", BAD_HEX32),
    ("replica", "residency", [[], "device", None, {}]),
    ("replica", "residency[1]", ["host", None, [16, 31], 3]),
    ("replica", "residency[0].tier", ["", "Device", "-x", "a b", "x" * 65, 3, None]),
    ("replica", "residency[1].layers", [[31, 16], [16], [16, 31, 32], [16, "31"], [-1, 31], [16, 31.5],
                                        [16, True], "16-31", None, [16, 2**32]]),
    ("replica", "residency[1].read_mbit_per_s", [0, -1, "fast", True, None, []]),
    ("replica", "ttl_ms", BAD_POS),
    ("replica", "moqt_namespace", ["a2Z2c3AtMQ", None, 3]),
    # InstanceStatusRecord (§4.4, §6.3)
    ("status", "instance", BAD_URL + ["moqt://ii7.example/"]),
    ("status", "epoch", BAD_UINT),
    ("status", "state", ["asleep", "Active", "", None, 1]),
    ("status", "running", BAD_UINT),
    ("status", "queued", BAD_UINT),
    ("status", "batch_size", BAD_UINT),
    ("status", "kv_utilization", [-0.01, 1.01, 2, "0.5", None, True]),
    ("status", "prefill_tokens_per_s", [-1, "1", None, True]),
    ("status", "decode_tokens_per_s", [-0.5, "1", None, False]),
    ("status", "links", ["x", None, {}]),
    ("status", "links[0]", ["x", None, []]),
    ("status", "links[0].holder", BAD_URL),
    ("status", "links[0].mbit_per_s", [0, -1, "1", None]),
    ("status", "links[0].rtt_us", [-1, "1", None, True]),
    ("status", "requested_state", ["draining", "active", "failed", "", 0, False]),
    ("status", "ttl_ms", BAD_POS),
    ("state", "state", ["failed", "asleep", None, 1]),
    # SessionCheckpoint (§4.4, §6.8)
    ("checkpoint", "session", ["", "6f1d0a9e2c554d7e9a0e5b7f2f9f6a11", "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a1",
                               "{6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11}", "urn:uuid:6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
                               "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a1g", 5, None]),
    ("checkpoint", "epoch", BAD_UINT),
    ("checkpoint", "compat_id", BAD_HEX32),
    ("checkpoint", "scope_id", BAD_HEX16),
    ("checkpoint", "prompt_blocks", ["x", None, {}]),
    ("checkpoint", "prompt_blocks[1]", BAD_HEX32),
    ("checkpoint", "prompt_tail", ["x", None, 374]),
    ("checkpoint", "prompt_tail[0]", [-1, 2**32, 1.5, "374", None, True]),
    ("checkpoint", "generated", ["x", None, {}]),
    ("checkpoint", "generated[2]", [-1, 2**32, 1.5, "279", None, False]),
    ("checkpoint", "output_offset", [2, 4, 0, -1, 1.5, "3", None]),
    ("checkpoint", "sampler", ["top-p", None, []]),
    ("checkpoint", "sampler.method", ["", None, 1, "x" * 257]),
    ("checkpoint", "sampler.params", [None, [], "p=0.9", 1]),
    ("checkpoint", "sampler.seed", [1.5, "7", None, True, 2**64, -(2**63) - 1]),
    ("checkpoint", "sampler.step", BAD_UINT),
    ("checkpoint", "sampler.deterministic", [0, 1, "false", None]),
    ("resume", "epoch", [1, 0, -1, None, "2"]),
    ("resume", "checkpoint", [None, [], "x"]),
    ("resume", "checkpoint.output_offset", [2]),
    # LookupRequest / LookupResponse (§6.2)
    ("lookup", "scope_id", BAD_HEX16),
    ("lookup", "compat_id", BAD_HEX32),
    ("lookup", "block_keys", [[], None, "x", {}]),
    ("lookup", "block_keys[2]", BAD_HEX32),
    ("lookup", "targets", [None, "x", {}]),
    ("lookup", "targets[1]", BAD_URL + ["moqt://ii9.example/"]),
    ("lookup_response", "matched", [-1, 1.5, "1", None]),
    ("lookup_response", "blocks", [None, {}, "x"]),
    ("lookup_response", "blocks[0].block_key", BAD_HEX32),
    ("lookup_response", "blocks[0].replicas", [[], None, {}]),
    ("lookup_response", "blocks[0].replicas[0].residency[0].layers", [[1, 0]]),
    ("lookup_response", "targets", [None, {}, "x"]),
    ("lookup_response", "targets[0].instance", BAD_URL),
    ("lookup_response", "targets[0].fetch_us", [-1, "1", None]),
    ("lookup_response", "targets[0].recompute_us", [-0.5, "1", None]),
    # PrefetchDirective / PrefetchStatus (§6.5)
    ("prefetch", "directive", ["", "not-a-uuid", 1, None]),
    ("prefetch", "request_ref", [1, None, [], "x" * 1025]),
    ("prefetch", "scope_id", BAD_HEX16),
    ("prefetch", "compat_id", BAD_HEX32),
    ("prefetch", "blocks", [[], None, {}]),
    ("prefetch", "blocks[0]", [None, KEYS[0]]),
    ("prefetch", "blocks[0].block_key", BAD_HEX32),
    ("prefetch", "blocks[0].sources", [[], None, "https://h1.example/kvsp/"]),
    ("prefetch", "blocks[0].sources[0]", BAD_URL),
    ("prefetch", "layer_order", ["descending", "Ascending", None, 1]),
    ("prefetch", "deadline_ms", BAD_POS),
    ("prefetch", "lease_ms", BAD_POS),
    ("prefetch_status", "directive", ["x", None]),
    ("prefetch_status", "state", ["done", "Pending", None]),
    ("prefetch_status", "loaded", [None, "x"]),
    ("prefetch_status", "loaded[0]", BAD_HEX32),
    ("prefetch_status", "error", [None, 1, []]),
    # ShardMap / ReshardPlan (§6.9)
    ("shard_map", "map", ["", None, 3]),
    ("shard_map", "version", BAD_UINT),
    ("shard_map", "shards", [[], None, {}]),
    ("shard_map", "shards[0].tokens", [[0, 0], [1, 0], [0], [-1, 32768], [0, "1"], None]),
    ("shard_map", "shards[1].tokens", [[32767, 65536], [32769, 65536], [0, 65536]]),
    ("shard_map", "shards[2].tokens", [[65536, 65536], [60000, 98304]]),
    ("shard_map", "shards[2].instance", BAD_URL),
    ("reshard", "map", ["", None]),
    ("reshard", "from", [-1, 1.5, "4", None]),
    ("reshard", "to", [4, 6, 3, "5", None]),
    ("reshard", "deadline_ms", BAD_POS),
    ("reshard", "retain", [None, "x", {}]),
    ("reshard", "retain[0]", [[5, 5], [10, 0], [0], None]),
    ("reshard", "fetch", [None, {}]),
    ("reshard", "fetch[0].tokens", [[0, 10], [32767, 49152], [32768, 32768], None]),
    ("reshard", "fetch[0].from", BAD_URL),
    ("reshard", "release", [None, "x"]),
    ("commit", "commit", [-1, "5", None]),
    ("commit", "map", ["", None]),
    ("abort", "abort", [-1, 1.5, None]),
    # Leases (§6.6)
    ("lease_request", "block_keys", [[], None]),
    ("lease_request", "block_keys[1]", BAD_HEX32),
    ("lease_request", "compat_id", BAD_HEX32),
    ("lease_request", "scope_id", BAD_HEX16),
    ("lease_request", "ttl_ms", BAD_POS),
    ("lease_grant", "lease", ["", "a/b", "a b", "x" * 129, 5, None]),
    ("lease_grant", "ttl_ms", BAD_POS),
    ("lease_grant", "expires_ms", [-1, 1.5, "1", None]),
    ("lease_renewal", "ttl_ms", BAD_POS),
]


@pytest.mark.parametrize(
    ("name", "member", "value"),
    [(n, m, v) for n, m, values in INVALID for v in values],
    ids=lambda x: repr(x)[:40] if not isinstance(x, str) else x[:40],
)
def test_invalid_member(name: str, member: str, value: object) -> None:
    record_type, make = EXAMPLES[name]
    assert_member_error(record_type, with_member(make(), member, value), member)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), b"x", "\ud800", {1, 2}, (1,), object()])
def test_values_json_cannot_carry(value: object) -> None:
    """from_json also guards against Python values that no JSON text decodes to."""
    for member, where in [("sampler.seed", "sampler.seed"), ("sampler.params", "sampler.params"),
                          ("sampler.params.p", "sampler.params.p"), ("sampler.params.p[0]", "sampler.params.p[0]")]:
        doc = checkpoint_doc()
        doc["sampler"]["params"]["p"] = [0]
        doc = with_member(doc, member, value)
        with pytest.raises(RecordError) as info:
            SessionCheckpoint.from_json(doc)
        assert info.value.member == where


def test_replica_of_another_key_in_lookup_response() -> None:
    doc = with_member(lookup_response_doc(), "blocks[0].block_key", KEYS[1])
    assert_member_error(LookupResponse, doc, "blocks[0].replicas[0].block_key")


@pytest.mark.parametrize("matched", [0, 2])
def test_lookup_response_matched_counts_blocks(matched: int) -> None:
    assert_member_error(LookupResponse, with_member(lookup_response_doc(), "matched", matched), "blocks")


# --- cross-member rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("residency", "member"),
    [
        ([[0, 15], [15, 31]], "residency[1].layers"),
        ([[0, 15], [10, 12]], "residency[1].layers"),
        ([[10, 20], [0, 10]], "residency[1].layers"),
        ([[0, 3], [8, 9], [4, 8]], "residency[2].layers"),
        ([[0, 31], [31, 31]], "residency[1].layers"),
        ([[5, 5], [0, 3], [5, 6]], "residency[2].layers"),
    ],
)
def test_residency_overlap(residency: list[list[int]], member: str) -> None:
    doc = replica_doc()
    doc["residency"] = [{"tier": f"t{i}", "layers": r} for i, r in enumerate(residency)]
    error = assert_member_error(ReplicaRecord, doc, member)
    assert "overlaps" in str(error)


def test_residency_adjacent_ranges_do_not_overlap() -> None:
    doc = replica_doc()
    doc["residency"] = [{"tier": "device", "layers": [5, 5]}, {"tier": "device", "layers": [0, 4]}, {"tier": "host", "layers": [6, 31]}]
    assert ReplicaRecord.from_json(doc).resident_layers() == (range(0, 32),)


def test_residency_within_layer_digests() -> None:
    doc = with_member(replica_doc(), "residency[1].layers", [16, 32])
    error = assert_member_error(ReplicaRecord, doc, "residency[1].layers")
    assert "32 layers" in str(error)


def test_digest_must_cover_layer_digests() -> None:
    doc = with_member(replica_doc(), "digest", "sha-256:" + COMPAT)
    assert_member_error(ReplicaRecord, doc, "digest")
    doc = with_member(replica_doc(), "layer_digests[0]", LAYER_DIGESTS[1])
    assert_member_error(ReplicaRecord, doc, "digest")


def test_duplicate_link_holder() -> None:
    doc = status_doc()
    doc["links"].append({"holder": "https://h2.example/kvsp/", "mbit_per_s": 1, "rtt_us": 0})
    doc["links"].append(dict(doc["links"][0]))
    assert_member_error(InstanceStatusRecord, doc, "links[2].holder")


@pytest.mark.parametrize(
    ("plan", "member"),
    [
        ({"retain": [[0, 100], [50, 200]]}, "retain[1]"),
        ({"retain": [[0, 100]], "release": [[99, 200]]}, "release[0]"),
        ({"retain": [[0, 100]], "fetch": [{"tokens": [100, 200], "from": "https://a.example/"}],
          "release": [[150, 160]]}, "release[0]"),
        ({"fetch": [{"tokens": [0, 10], "from": "https://a.example/"}, {"tokens": [5, 6], "from": "https://b.example/"}]},
         "fetch[1].tokens"),
        ({"release": [[0, 10], [20, 30], [9, 21]]}, "release[2]"),
    ],
)
def test_reshard_ranges_must_not_overlap(plan: dict[str, Any], member: str) -> None:
    doc = dict({"map": "m", "from": 1, "to": 2, "deadline_ms": 100}, **plan)
    error = assert_member_error(ReshardPlan, doc, member)
    assert "overlaps" in str(error)


def test_reshard_touching_ranges_are_fine() -> None:
    doc = {"map": "m", "from": 1, "to": 2, "deadline_ms": 100, "retain": [[0, 10]],
           "fetch": [{"tokens": [10, 20], "from": "https://a.example/"}], "release": [[20, 30]]}
    assert len(ReshardPlan.from_json(doc).fetch) == 1


# --- moqt holders (§4.4, binding v1) -----------------------------------------------------------


def moqt_replica_doc(replica_id: bytes = b"\x07" * 16, **overrides: bytes) -> dict[str, Any]:
    from kvsp_moq.kvsp.naming import BlockName

    fields = {"compat_id": bytes.fromhex(COMPAT), "scope_id": bytes.fromhex(SCOPE), "block_key": bytes.fromhex(KEYS[0])}
    fields.update(overrides)
    name = BlockName(replica_id=replica_id, **fields)
    return dict(replica_doc(), holder="moqt://relay.example:4443/kvsp", moqt_namespace=name.moqt_namespace())


def test_moqt_replica() -> None:
    doc = moqt_replica_doc()
    record = parse_json(json.dumps(doc), ReplicaRecord)
    assert record.is_moqt and record.moqt_namespace == doc["moqt_namespace"]
    assert record.to_json() == doc
    name = record.block_name()
    assert name is not None and name.replica_id == b"\x07" * 16 and name.block_key == record.block_key
    assert ReplicaRecord.from_json(replica_doc()).block_name() is None


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        (with_member(moqt_replica_doc(), "moqt_namespace", MISSING), "required"),
        (with_member(moqt_replica_doc(), "moqt_namespace", "!!"), "base64url"),
        (with_member(moqt_replica_doc(), "moqt_namespace", "AAAA"), ""),
        (with_member(moqt_replica_doc(), "moqt_namespace", 5), "string"),
        (moqt_replica_doc(block_key=bytes.fromhex(KEYS[1])), "block_key"),
        (moqt_replica_doc(scope_id=b"\x00" * 16), "scope_id"),
        (moqt_replica_doc(compat_id=b"\x00" * 32), "compat_id"),
        (with_member(replica_doc(), "moqt_namespace", moqt_replica_doc()["moqt_namespace"]), "only allowed"),
    ],
)
def test_moqt_namespace_rules(doc: dict[str, Any], fragment: str) -> None:
    error = assert_member_error(ReplicaRecord, doc, "moqt_namespace")
    assert fragment in str(error)


# --- safe JSON decoding ------------------------------------------------------------------------


def _decode_error(data: bytes | str, **kwargs: int) -> RecordError:
    with pytest.raises(RecordError) as info:
        parse_json(data, StateChange, **kwargs)
    assert info.value.member == "$"
    assert isinstance(info.value, KvspError)
    return info.value


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"   ",
        b"{",
        b'{"state": "active"',
        b'{"state": "active"} x',
        b'{"state": "active"}{}',
        b"[]",
        b'"state"',
        b"null",
        b"42",
        b'{"state": NaN}',
        b'{"state": "active", "x": NaN}',
        b'{"state": "active", "x": Infinity}',
        b'{"state": "active", "x": -Infinity}',
        b'{"state": "active", "x": 1e400}',
        b'{"state": "active", "x": -1e400}',
        b'{"state": "active", "x": ' + b"1" * 5000 + b"}",
        b'{"state": "active", "state": "active"}',
        b'{"state": "active", "x": {"a": 1, "a": 2}}',
        b'{"state": "active", "x": [{"": 1, "": 1}]}',
        b'{"state": "active\xff"}',
        b'{"state": "\xc3\x28"}',
        b"\xef\xbb\xbf{\"state\": \"active\"}",
        b'{"state": "active\x01"}',
        b"{'state': 'active'}",
        b'{"state": "active",}',
        b"\x00",
        "\ud800",
        b'{"state": "active"}\x0b',
    ],
)
def test_decode_rejects(data: bytes | str) -> None:
    _decode_error(data)


def test_decode_accepts_whitespace_and_bytes_likes() -> None:
    body = b' \r\n\t{"state": "sleeping"} \n'
    for data in (body, bytearray(body), memoryview(body), body.decode()):
        assert parse_json(data, StateChange) == StateChange(state="sleeping")


def test_decode_size_cap() -> None:
    body = b'{"state": "active", "pad": "' + b"x" * (DEFAULT_MAX_SIZE - 40) + b'"}'
    assert len(body) <= DEFAULT_MAX_SIZE
    assert parse_json(body, StateChange).state == "active"
    error = _decode_error(body + b" " * (DEFAULT_MAX_SIZE - len(body) + 1))
    assert "exceeds" in str(error)
    _decode_error(b'{"state": "active"}', max_size=10)
    assert parse_json(b'{"state": "active"}', StateChange, max_size=19).state == "active"
    # str bodies are measured in UTF-8 octets
    _decode_error('{"state": "active", "x": "' + "\u00e9" * 10 + '"}', max_size=40)


def nested(depth: int) -> bytes:
    """A body whose nesting depth is exactly ``depth`` (the top-level object counts as 1)."""
    return b'{"state": "active", "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_decode_depth_limit() -> None:
    assert parse_json(nested(64), StateChange).state == "active"
    assert "deeper" in str(_decode_error(nested(65)))
    assert parse_json(nested(10), StateChange, max_depth=10).state == "active"
    _decode_error(nested(11), max_depth=10)
    objects = b'{"state": "active", "x": ' + b'{"a": ' * 64 + b"1" + b"}" * 64 + b"}"
    _decode_error(objects)
    _decode_error(b'{"x": ' + b"[" * 200_000)  # far deeper than the interpreter's recursion limit
    _decode_error(b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    # brackets inside strings do not count
    assert parse_json(b'{"state": "active", "x": "' + b"[" * 100 + b'"}', StateChange).state == "active"


def test_dump_json() -> None:
    record = ReplicaRecord.from_json(replica_doc())
    body = dump_json(record)
    assert isinstance(body, bytes) and b" " not in body
    assert parse_json(body, ReplicaRecord) == record
    problem = Problem(detail="caf\u00e9")
    assert dump_json(problem) == '{"type":"about:blank","detail":"caf\u00e9"}'.encode()


def test_decode_json_returns_plain_objects() -> None:
    assert decode_json(b'{"a": [1, 2.5, "x", null, true]}') == {"a": [1, 2.5, "x", None, True]}


def test_lone_surrogate_escape_rejected_in_members() -> None:
    with pytest.raises(RecordError) as info:
        parse_json(b'{"map": "\\ud800", "commit": 1}', ReshardCommit)
    assert info.value.member == "map"
    # in an unknown member it is ignored like everything else there
    assert parse_json(b'{"map": "m", "commit": 1, "x": "\\ud800"}', ReshardCommit).commit == 1


def test_integral_floats_read_as_integers() -> None:
    record = ReshardCommit.from_json({"map": "m", "commit": 5.0})
    assert record.commit == 5 and isinstance(record.commit, int)
    assert parse_json(b'{"map": "m", "commit": 5e0}', ReshardCommit).to_json() == {"map": "m", "commit": 5}
