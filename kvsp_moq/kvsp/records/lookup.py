"""Lookup (kvsp-draft §6.2): the request the PC sends to the IS and the IS's answer (shape ours)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from ..errors import RecordError
from .members import HEX16, HEX32, HTTP_URL, ROOT, Int, ListOf, Num, child, item
from .record import Nested, Record, member
from .replica import ReplicaRecord

#: Default cap on ``block_keys`` in one lookup (≈ 4.4 MB of keys; raise ``max_size`` with it).
DEFAULT_MAX_BLOCK_KEYS = 65536


@dataclass(frozen=True, kw_only=True)
class LookupRequest(Record):
    """Body of ``POST {is-base}lookup`` (§6.2): the Block Keys of a prompt in prefix order and,
    optionally, the instances to estimate fetch and recompute times for."""

    RECORD_NAME = "lookup request"

    scope_id: bytes = member(HEX16)
    compat_id: bytes = member(HEX32)
    block_keys: tuple[bytes, ...] = member(ListOf(HEX32, min_len=1))
    targets: tuple[str, ...] | None = member(ListOf(HTTP_URL), optional=True)

    @classmethod
    def from_json(cls, obj: object, *, max_block_keys: int = DEFAULT_MAX_BLOCK_KEYS) -> Self:
        """As :meth:`Record.from_json`, with at most ``max_block_keys`` keys."""
        keys = obj.get("block_keys") if isinstance(obj, dict) else None
        if isinstance(keys, list) and len(keys) > max_block_keys:
            raise RecordError("block_keys", f"at most {max_block_keys} keys per lookup, got {len(keys)}")
        return cls.read_at(obj, ROOT)


@dataclass(frozen=True, kw_only=True)
class MatchedBlock(Record):
    """A matched key and its unexpired replicas (at least one, each for this key)."""

    RECORD_NAME = "matched block"

    block_key: bytes = member(HEX32)
    replicas: tuple[ReplicaRecord, ...] = member(ListOf(Nested(ReplicaRecord), min_len=1))

    def _check(self, path: str) -> None:
        for i, replica in enumerate(self.replicas):
            if replica.block_key != self.block_key:
                raise RecordError(child(item(child(path, "replicas"), i), "block_key"), "is not the block_key of its entry")


@dataclass(frozen=True, kw_only=True)
class TargetEstimate(Record):
    """The IS's estimates for one target instance (§6.2, formulas in §6.4)."""

    RECORD_NAME = "target estimate"

    instance: str = member(HTTP_URL)
    fetch_us: float = member(Num(0))
    recompute_us: float = member(Num(0))


@dataclass(frozen=True, kw_only=True)
class LookupResponse(Record):
    """The IS's answer to a lookup (shape ours, §6.2).

    ``matched`` is the number of leading keys with at least one unexpired replica and
    ``blocks`` has exactly that many entries, in prefix order. ``targets`` is present when the
    request had targets and the IS could estimate; it may list fewer instances than asked.
    """

    RECORD_NAME = "lookup response"

    matched: int = member(Int(0))
    blocks: tuple[MatchedBlock, ...] = member(ListOf(Nested(MatchedBlock)))
    targets: tuple[TargetEstimate, ...] | None = member(ListOf(Nested(TargetEstimate)), optional=True)

    def _check(self, path: str) -> None:
        if len(self.blocks) != self.matched:
            raise RecordError(child(path, "blocks"), f"must have matched = {self.matched} entries, got {len(self.blocks)}")

    def answers(self, request: LookupRequest) -> bool:
        """Whether this is a consistent answer to ``request``: the blocks are its leading keys,
        and every replica is of its compat_id and scope_id (§6.2)."""
        if self.matched > len(request.block_keys):
            return False
        return all(
            block.block_key == key
            and all(r.compat_id == request.compat_id and r.scope_id == request.scope_id for r in block.replicas)
            for block, key in zip(self.blocks, request.block_keys)
        )
