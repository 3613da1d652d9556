"""KVSP JSON records (kvsp-draft §4.4 and the bodies of §6), with safe decoding.

Every record is a frozen dataclass with ``from_json(obj)`` (validate a decoded JSON value;
unknown members are ignored, §4.4) and ``to_json()`` (known members only, absent optional
members omitted). :func:`parse_json` decodes untrusted bytes and validates them in one step.
Every failure is a :class:`~kvsp_moq.kvsp.errors.RecordError` whose ``member`` is the dotted
path of the offending member (``residency[1].layers``), ``$`` for the body as a whole.
See docs/records.md.
"""

from ..errors import RecordError
from ._json import DEFAULT_MAX_DEPTH, DEFAULT_MAX_SIZE, decode_json, dump_json, parse_json
from .record import Record
from .instance import (
    ACTIVE,
    DRAINING,
    FAILED,
    INSTANCE_STATES,
    SLEEPING,
    InstanceStatusRecord,
    Link,
    StateChange,
)
from .lease import LeaseGrant, LeaseRenewal, LeaseRequest
from .lookup import DEFAULT_MAX_BLOCK_KEYS, LookupRequest, LookupResponse, MatchedBlock, TargetEstimate
from .prefetch import PREFETCH_STATES, PrefetchBlock, PrefetchDirective, PrefetchStatus
from .problem import Problem
from .replica import ReplicaRecord, Residency
from .session import Sampler, SessionCheckpoint, SessionResume
from .shard import (
    RangeFetch,
    ReshardAbort,
    ReshardCommit,
    ReshardMessage,
    ReshardPlan,
    Shard,
    ShardMap,
    parse_reshard_message,
    reshard_message_from_json,
)

__all__ = [
    "ACTIVE",
    "DEFAULT_MAX_BLOCK_KEYS",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_SIZE",
    "DRAINING",
    "FAILED",
    "INSTANCE_STATES",
    "PREFETCH_STATES",
    "SLEEPING",
    "InstanceStatusRecord",
    "LeaseGrant",
    "LeaseRenewal",
    "LeaseRequest",
    "Link",
    "LookupRequest",
    "LookupResponse",
    "MatchedBlock",
    "PrefetchBlock",
    "PrefetchDirective",
    "PrefetchStatus",
    "Problem",
    "RangeFetch",
    "Record",
    "RecordError",
    "ReplicaRecord",
    "ReshardAbort",
    "ReshardCommit",
    "ReshardMessage",
    "ReshardPlan",
    "Residency",
    "Sampler",
    "SessionCheckpoint",
    "SessionResume",
    "Shard",
    "ShardMap",
    "StateChange",
    "TargetEstimate",
    "decode_json",
    "dump_json",
    "parse_json",
    "parse_reshard_message",
    "reshard_message_from_json",
]
