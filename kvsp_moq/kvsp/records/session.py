"""The Session Checkpoint (kvsp-draft §4.4, §6.8) and the resume body (§6.8)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import RecordError
from .members import HEX16, HEX32, TOKEN, UUID, Bool, Int, JsonObject, JsonValue, ListOf, Str, child
from .record import Nested, Record, member

#: Sampler seeds are carried as given; int64 and uint64 seeds both fit.
SEED = Int(-(2**63), 2**64 - 1)


@dataclass(frozen=True, kw_only=True)
class Sampler(Record):
    """The sampler state to restore on resume (§6.8 step 3)."""

    RECORD_NAME = "sampler"

    method: str = member(Str(max_len=256))
    params: Mapping[str, JsonValue] = member(JsonObject())
    seed: int = member(SEED)
    step: int = member(Int(0))
    deterministic: bool = member(Bool())


@dataclass(frozen=True, kw_only=True)
class SessionCheckpoint(Record):
    """What an instance publishes with ``PUT sessions/{session}/checkpoint`` (§6.8).

    ``generated`` holds every output token of the session so far and ``output_offset``, the
    number of output tokens covered by the checkpoint (§4.4), equals its length: the next
    token gets index ``output_offset`` (§6.8 step 4). The resuming instance needs all of them,
    since the keys of generated blocks chain on from the prompt blocks (§4.2).
    """

    RECORD_NAME = "session checkpoint"

    session: uuid.UUID = member(UUID)
    epoch: int = member(Int(0))
    compat_id: bytes = member(HEX32)
    scope_id: bytes = member(HEX16)
    prompt_blocks: tuple[bytes, ...] = member(ListOf(HEX32))
    prompt_tail: tuple[int, ...] = member(ListOf(TOKEN))
    generated: tuple[int, ...] = member(ListOf(TOKEN))
    output_offset: int = member(Int(0))
    sampler: Sampler = member(Nested(Sampler))

    def _check(self, path: str) -> None:
        if self.output_offset != len(self.generated):
            raise RecordError(
                child(path, "output_offset"),
                f"must equal the number of generated tokens ({len(self.generated)}), got {self.output_offset}",
            )


@dataclass(frozen=True, kw_only=True)
class SessionResume(Record):
    """Body of ``POST sessions/{session}/resume`` (shape ours, §6.8): the latest checkpoint and
    the new session epoch, which must be higher than the checkpoint's."""

    RECORD_NAME = "session resume"

    epoch: int = member(Int(0))
    checkpoint: SessionCheckpoint = member(Nested(SessionCheckpoint))

    def _check(self, path: str) -> None:
        if self.epoch <= self.checkpoint.epoch:
            raise RecordError(
                child(path, "epoch"),
                f"the new epoch must be higher than the checkpoint's ({self.checkpoint.epoch})",
            )
