"""How the store addresses replicas (kvsp-draft §6.7, binding v1).

A block resource is ``blocks/{compat}/{scope}/{block_key}`` (§6.7): :class:`RecordKey` is
that triple. A store holds at most one replica per key (§6.7: a holder that already has a
replica keeps it). Each replica also has a 16-octet replica id, new for every replica the
producer creates (binding v1, DESIGN.md §4), so MOQT names never carry two byte strings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kvsp.naming import BlockName

if TYPE_CHECKING:
    from ..kvsp.records import ReplicaRecord

__all__ = ["REPLICA_ID_SIZE", "RecordKey", "check_replica_id", "new_replica_id"]

REPLICA_ID_SIZE = 16  # binding v1: the fifth namespace field


def _check(name: str, value: object, size: int) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise ValueError(f"{name} must be {size} octets")
    return value


@dataclass(frozen=True, slots=True)
class RecordKey:
    """(compat_id, scope_id, block_key): the block a replica is a copy of (§4.4, §6.7)."""

    compat_id: bytes  # 32 octets (§4.1)
    scope_id: bytes  # 16 octets (§4.2)
    block_key: bytes  # 32 octets (§4.2)

    def __post_init__(self) -> None:
        _check("compat_id", self.compat_id, 32)
        _check("scope_id", self.scope_id, 16)
        _check("block_key", self.block_key, 32)

    @classmethod
    def from_hex(cls, compat: str, scope: str, block_key: str) -> RecordKey:
        """From the three path segments of §6.7 (lowercase hex)."""
        return cls(bytes.fromhex(compat), bytes.fromhex(scope), bytes.fromhex(block_key))

    @classmethod
    def of(cls, record: ReplicaRecord) -> RecordKey:
        """The key a Replica Record describes."""
        return cls(record.compat_id, record.scope_id, record.block_key)

    def block_name(self, replica_id: bytes) -> BlockName:
        """The MOQT name of replica ``replica_id`` of this block (binding v1)."""
        return BlockName(self.compat_id, self.scope_id, self.block_key, replica_id)

    @property
    def path(self) -> str:
        """``{compat}/{scope}/{block_key}``, the tail of the block resource path (§6.7)."""
        return f"{self.compat_id.hex()}/{self.scope_id.hex()}/{self.block_key.hex()}"

    def __str__(self) -> str:
        return f"block {self.block_key.hex()[:16]}… (scope {self.scope_id.hex()[:8]}…)"


def new_replica_id() -> bytes:
    """A fresh random replica id (binding v1: new for every replica a producer creates)."""
    return os.urandom(REPLICA_ID_SIZE)


def check_replica_id(value: object) -> bytes:
    """``value`` if it is a 16-octet replica id; ``ValueError`` otherwise."""
    return _check("replica_id", value, REPLICA_ID_SIZE)
