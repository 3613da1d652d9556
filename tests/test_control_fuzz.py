"""Fuzzing the control plane's pure parsers (DESIGN.md §7: "any input gives events or the named
protocol error, never another exception"): the session, front-end, engine and resharding
records (kvsp-draft §6.8, §6.9; ``session_records.py``, ``engine_records.py``,
``kvsp/records/shard.py``), the ``POST reshard`` message, token batches, and the query
parameters ``tokens=a-b``, ``layers=a-b`` and ``codec=n``.

Each either parses or raises :class:`RecordError`; whatever parses writes back to JSON that
parses to the same record. Inputs: arbitrary octets, arbitrary JSON, and valid bodies with one
member replaced by an arbitrary JSON value (which reaches the cross-member rules).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp_moq.control.common.session_records import (
    CheckpointAck,
    ClientSessionRequest,
    DeliveryAnswer,
    FailureReport,
    OutputTokens,
    ReshardAck,
    ReshardOutcome,
    SessionDone,
    SessionFailed,
    SessionList,
    SessionOpen,
    SessionOrder,
    SessionView,
)
from kvsp_moq.control.engine.records import GenerateRequest
from kvsp_moq.control.holder.routes import parse_codec, parse_layers
from kvsp_moq.control.instance.routes import parse_token_range
from kvsp_moq.kvsp.errors import RecordError
from kvsp_moq.kvsp.records import (
    Record,
    SessionCheckpoint,
    ShardMap,
    dump_json,
    parse_json,
    parse_reshard_message,
)

#: More examples for a deeper run: KVSP_FUZZ_EXAMPLES=5000 pytest tests/test_control_fuzz.py
FUZZ = settings(max_examples=int(os.environ.get("KVSP_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow])

SID = str(uuid.UUID(int=7))
HEX32 = "ab" * 32
HEX16 = "cd" * 16
URL = "http://ii.example/kvsp/"
SAMPLER = {"method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": 0, "deterministic": False}
CHECKPOINT = {"session": SID, "epoch": 1, "compat_id": HEX32, "scope_id": HEX16, "prompt_blocks": [HEX32],
              "prompt_tail": [1, 2], "generated": [3, 4], "output_offset": 2, "sampler": SAMPLER | {"step": 2}}
PLAN = {"map": "m1", "from": 4, "to": 5, "deadline_ms": 200, "retain": [[0, 8]],
        "fetch": [{"tokens": [8, 16], "from": URL}], "release": [[16, 24]]}

#: A valid body of every record (type, body).
VALID: list[tuple[type[Record], dict[str, Any]]] = [
    (SessionOrder, {"epoch": 2, "checkpoint": CHECKPOINT, "front_end": URL, "max_tokens": 8}),
    (SessionOpen, {"session": SID, "compat_id": HEX32, "scope_id": HEX16, "prompt_blocks": [HEX32], "prompt_tail": [1],
                   "tokens": 17, "sampler": SAMPLER, "max_tokens": 4, "front_end": URL}),
    (ClientSessionRequest, {"compat_id": HEX32, "scope_id": HEX16, "prompt_tail": [1, 2], "tokens": 2, "sampler": SAMPLER,
                            "max_tokens": 4}),
    (SessionCheckpoint, CHECKPOINT),
    (CheckpointAck, {"session": SID, "epoch": 1, "output_offset": 2}),
    (SessionView, {"session": SID, "instance": URL, "epoch": 3, "output_offset": 2, "failed": "why"}),
    (SessionList, {"sessions": [{"session": SID, "epoch": 1, "output_offset": 0}]}),
    (SessionDone, {"epoch": 2, "output_offset": 9}),
    (SessionFailed, {"epoch": 2, "reason": "another model"}),
    (FailureReport, {"instance": URL, "epoch": 3}),
    (OutputTokens, {"session": SID, "epoch": 2, "tokens": [{"index": 0, "token": 5}, {"index": 1, "token": 6}], "end": 2}),
    (DeliveryAnswer, {"accepted": 1, "duplicates": 0, "next": 1}),
    (GenerateRequest, {"scope_id": HEX16, "prompt_ids": [1, 2], "max_tokens": 3, "sampler": SAMPLER | {"step": 0},
                       "request_ref": "r"}),
    (ShardMap, {"map": "m1", "version": 4, "shards": [{"tokens": [0, 8], "instance": URL},
                                                     {"tokens": [8, 16], "instance": URL}]}),
    (ReshardAck, {"map": "m1", "to": 5, "fetched_octets": 10}),
    (ReshardOutcome, {"map": "m1", "state": "committed", "version": 5,
                      "members": [{"instance": URL, "result": "acknowledged", "fetched_octets": 3}]}),
]
RECORDS = [record_type for record_type, _ in VALID]

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
                | st.sampled_from([SID, HEX32, HEX16, URL, "", "\ud800", "m1", 0, 1, 2, 2**53, -1]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) inside a JSON value, the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for key, v in value.items():
            out += paths(v, prefix + (key,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, prefix + (i,))
    return out


def replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = json.loads(json.dumps(value))
    target = copy
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return copy


@st.composite
def mutated(draw: st.DrawFn) -> tuple[type[Record], Any]:
    """A valid body of some record with one value (or one member's absence) changed."""
    record_type, body = draw(st.sampled_from(VALID))
    path = draw(st.sampled_from(paths(body)))
    if path and draw(st.booleans()) and isinstance(path[-1], str):
        body = json.loads(json.dumps(body))
        target = body
        for step in path[:-1]:
            target = target[step]
        del target[path[-1]]
        return record_type, body
    return record_type, replace(body, path, draw(json_values))


def parses_or_refuses(record_type: type[Record], data: Any) -> None:
    """``data`` (octets or a JSON value) parses to a record that round-trips, or is refused
    with RecordError (any other exception fails the test)."""
    try:
        record = parse_json(data, record_type) if isinstance(data, (bytes, str)) else record_type.from_json(data)
    except RecordError as exc:
        assert isinstance(exc.member, str) and exc.member
        return
    assert parse_json(dump_json(record), record_type) == record


def test_every_valid_body_parses() -> None:
    for record_type, body in VALID:
        parses_or_refuses(record_type, body)
        assert record_type.from_json(body).to_json() is not None
    for body in (PLAN, {"map": "m1", "commit": 5}, {"map": "m1", "abort": 5}):
        message = parse_reshard_message(json.dumps(body))
        assert parse_reshard_message(dump_json(message)) == message


@FUZZ
@given(st.sampled_from(RECORDS), st.binary(max_size=200))
def test_records_from_arbitrary_octets(record_type: type[Record], data: bytes) -> None:
    parses_or_refuses(record_type, data)


@FUZZ
@given(st.sampled_from(RECORDS), json_values)
def test_records_from_arbitrary_json(record_type: type[Record], value: Any) -> None:
    parses_or_refuses(record_type, value)
    parses_or_refuses(record_type, json.dumps(value))


@FUZZ
@given(mutated())
def test_records_from_mutated_valid_bodies(case: tuple[type[Record], Any]) -> None:
    record_type, body = case
    parses_or_refuses(record_type, body)


@st.composite
def reshard_bodies(draw: st.DrawFn) -> Any:
    body = draw(st.sampled_from([PLAN, {"map": "m1", "commit": 5}, {"map": "m1", "abort": 5},
                                 {"map": "m1", "commit": 5, "abort": 5}]))
    return replace(body, draw(st.sampled_from(paths(body))), draw(json_values))


@FUZZ
@given(st.one_of(st.binary(max_size=120), reshard_bodies().map(lambda b: json.dumps(b).encode()),
                 json_values.map(lambda v: json.dumps(v).encode())))
def test_reshard_messages_parse_or_refuse(data: bytes) -> None:
    try:
        message = parse_reshard_message(data)
    except RecordError:
        return
    assert parse_reshard_message(dump_json(message)) == message


@FUZZ
@given(st.lists(st.tuples(st.integers(min_value=-5, max_value=2**33), st.integers(min_value=-5, max_value=2**33)),
                max_size=6), st.one_of(st.none(), st.integers(min_value=-2, max_value=2**33)),
       st.integers(min_value=-1, max_value=2**54))
def test_token_batches(tokens: list[tuple[int, int]], end: int | None, epoch: int) -> None:
    body: dict[str, Any] = {"session": SID, "epoch": epoch, "tokens": [{"index": i, "token": t} for i, t in tokens]}
    if end is not None:
        body["end"] = end
    try:
        batch = OutputTokens.from_json(body)
    except RecordError:
        return
    assert batch.epoch >= 1 and all(0 <= t.index < 2**32 and 0 <= t.token < 2**32 for t in batch.tokens)
    assert batch.end is None or all(t.index < batch.end for t in batch.tokens)


def test_a_batch_of_more_than_4096_tokens_is_refused() -> None:
    body = {"session": SID, "epoch": 1, "tokens": [{"index": i, "token": 0} for i in range(4097)]}
    try:
        OutputTokens.from_json(body)
    except RecordError as exc:
        assert exc.member == "tokens"
    else:
        raise AssertionError("4097 tokens were accepted")


query_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="0123456789-", max_size=40),
    st.tuples(st.integers(min_value=0, max_value=10**20), st.integers(min_value=0, max_value=10**20)).map(
        lambda ab: f"{ab[0]}-{ab[1]}"),
    st.sampled_from(["1" * 5000 + "-1", "1-" + "1" * 5000, "²-³", "١-٢", "0-0", "-", ""]),
)


@FUZZ
@given(query_text)
def test_token_ranges(value: str) -> None:
    try:
        a, b = parse_token_range(value)
    except RecordError as exc:
        assert exc.member == "tokens"
        return
    assert 0 <= a < b and parse_token_range(f"{a}-{b}") == (a, b)


@FUZZ
@given(query_text)
def test_layer_ranges(value: str) -> None:
    try:
        layers = parse_layers(value)
    except RecordError as exc:
        assert exc.member == "layers"
        return
    assert layers is not None and 0 <= layers[0] <= layers[1] <= 2**32 - 1


@FUZZ
@given(st.one_of(st.text(max_size=12), st.integers(min_value=0, max_value=10**9).map(str),
                 st.sampled_from(["9" * 5000, "²", "٣", "65535", "65536"])))
def test_codecs(value: str) -> None:
    try:
        codec = parse_codec(value)
    except RecordError as exc:
        assert exc.member == "codec"
        return
    assert codec is not None and 0 <= codec <= 0xFFFF and int(value) == codec
