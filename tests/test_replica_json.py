"""The Index Service's fast Replica Record path (``kvsp/records/replica_json.py``) against the
generic one (``ReplicaRecord.from_json`` / ``dump_json`` / ``parse_json``): it accepts only what
``from_json`` accepts and gives the same record, writes the same octets, and every bad record
of the record tests is left to ``from_json`` (so its error is the one it was, §4.4, §6.1)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvsp_moq.kvsp.errors import RecordError
from kvsp_moq.kvsp.records import ReplicaRecord, Residency, dump_json, parse_json
from kvsp_moq.kvsp.records.replica_json import dump_replica, load_replica, read_replica
from test_records import INVALID, MISSING, REQUIRED, replica_doc, with_member
from test_records_fuzz import _DELETE, FAST, _paths, replicas, wild_values

BAD_REPLICAS = [(m, v) for n, m, values in INVALID if n == "replica" for v in values] + \
    [(m, MISSING) for m in REQUIRED["replica"]] + [
        ("digest", "sha-256:" + "00" * 32),  # not the SHA-256 of the layer digests (§4.3)
        ("residency[1].layers", [16, 32]),  # beyond the 32 layer digests
        ("residency[1].layers", [15, 31]),  # overlaps residency[0]
        ("holder", "moqt://relay.example/"),  # moqt:// without moqt_namespace
        ("moqt_namespace", "a2Z2c3AtMQ"),  # only with a moqt:// holder
        ("residency[1].read_mbit_per_s", 1e400),  # decodes to infinity
        ("residency[1].read_mbit_per_s", 2**1100),  # overflows a double
    ]


@pytest.mark.parametrize(("member", "value"), BAD_REPLICAS,
                         ids=[f"{m}={'missing' if v is MISSING else repr(v)[:30]}" for m, v in BAD_REPLICAS])
def test_every_bad_record_is_left_to_from_json(member: str, value: object) -> None:
    doc = with_member(replica_doc(), member, value)
    assert read_replica(doc) is None
    with pytest.raises(RecordError):
        ReplicaRecord.from_json(doc)


def test_a_bad_record_in_a_batch_gets_the_generic_error() -> None:
    """The route's reader: the fast path, else ``from_json``'s error named in the batch."""
    from kvsp_moq.control.index.routes import _batch_record

    doc = with_member(replica_doc(), "residency[0].tier", "Device")
    with pytest.raises(RecordError) as info:
        _batch_record(3, doc)
    assert info.value.member == "records[3].residency[0].tier"
    assert _batch_record(0, replica_doc()) == ReplicaRecord.from_json(replica_doc())


def _same(doc: dict[str, Any]) -> ReplicaRecord:
    """``doc`` read both ways: the same record, written and read back the same."""
    expected = ReplicaRecord.from_json(doc)
    record = read_replica(doc)
    assert record == expected
    assert record is not None
    assert dump_replica(record) == dump_json(expected)
    assert load_replica(dump_replica(record)) == expected
    return record


def test_valid_records_read_write_and_load_alike() -> None:
    doc = replica_doc()
    _same(doc)
    _same(doc | {"unknown": {"x": [1, "\u00e9"]}})  # unknown members ignored (§4.4)
    _same({k: v for k, v in doc.items() if k != "layer_digests"})
    for rate in (1, 2**60, 0.5, 1e300):  # as Num reads them: a big integer becomes a float
        _same(with_member(doc, "residency[0].read_mbit_per_s", rate))


@FAST
@given(replicas())
def test_generated_records_read_write_and_load_alike(record: ReplicaRecord) -> None:
    _same(json.loads(dump_json(record)))


@FAST
@given(replicas(), st.data())
def test_mutated_records_fast_accepts_only_what_from_json_accepts(record: ReplicaRecord, data: st.DataObject) -> None:
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
    fast = read_replica(doc)
    if fast is not None:
        assert fast == ReplicaRecord.from_json(doc)


def test_load_checks_what_is_not_in_the_stored_form() -> None:
    """A stored value that is not a record the IS wrote is checked: a RecordError, not a
    record built from it."""
    good = dump_replica(ReplicaRecord.from_json(replica_doc()))
    for bad in (b"", b"{", good.replace(b'"codec":', b'"codec":"x","c":'), good[:-1] + b',"digest":"sha-256:00"}'):
        with pytest.raises(RecordError):
            load_replica(bad)
    record = dataclasses.replace(ReplicaRecord.from_json(replica_doc()),
                                 residency=(Residency(tier="host", layers=(0, 31), read_mbit_per_s=12.5),))
    assert load_replica(dump_replica(record)) == parse_json(dump_json(record), ReplicaRecord)
