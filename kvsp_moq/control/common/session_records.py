"""JSON bodies of sessions, output tokens and resharding that the draft leaves to
implementations (kvsp-draft §6.8, §6.9; shapes ours, docs/http-api.md "Sessions",
"Front end" and "Resharding").

Built on the core's record machinery, so they validate, name the member at fault and ignore
unknown members exactly like the draft's records (§4.4).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ...kvsp.errors import RecordError
from ...kvsp.records import Record, Sampler, SessionCheckpoint
from ...kvsp.records.members import HEX16, HEX32, HTTP_URL, TOKEN, UUID, Enum, Int, ListOf, Str, child, item
from ...kvsp.records.record import Nested, member

#: Upper bound on ``max_tokens`` (output tokens of one session); I-JSON safe.
MAX_OUTPUT_TOKENS = 1 << 32
#: Upper bound on the ``reason`` of a session failure (characters).
MAX_REASON_CHARS = 1024


# ---------------------------------------------------------------------------------------------
# Sessions (§6.8)


@dataclass(frozen=True, kw_only=True)
class SessionOrder(Record):
    """Body of ``POST {ii}sessions/{id}/start`` (ours) and ``POST {ii}sessions/{id}/resume``
    (§6.8: "the latest checkpoint and the new epoch").

    The spec's resume body is ``epoch`` and ``checkpoint``; ``front_end`` (where the output
    tokens go) and ``max_tokens`` (when the output ends) are ours and optional, so that a
    resume from a peer that sends only the spec's members is read too. A start is a resume
    from the initial checkpoint: ``checkpoint.epoch`` 0, nothing generated, and ``epoch`` 1.
    """

    RECORD_NAME = "session order"

    epoch: int = member(Int(1))
    checkpoint: SessionCheckpoint = member(Nested(SessionCheckpoint))
    front_end: str | None = member(HTTP_URL, optional=True)
    max_tokens: int | None = member(Int(1, MAX_OUTPUT_TOKENS), optional=True)

    def _check(self, path: str) -> None:
        if self.epoch <= self.checkpoint.epoch:
            raise RecordError(
                child(path, "epoch"), f"the new epoch must be higher than the checkpoint's ({self.checkpoint.epoch})"
            )
        if self.max_tokens is not None and self.checkpoint.output_offset > self.max_tokens:
            raise RecordError(child(path, "max_tokens"), "is below the checkpoint's output_offset")

    @property
    def session(self) -> uuid.UUID:
        return self.checkpoint.session


@dataclass(frozen=True, kw_only=True)
class SessionAccepted(Record):
    """An instance's answer (202) to a start or a resume: it runs ``session`` at ``epoch``."""

    RECORD_NAME = "session accepted"

    session: uuid.UUID = member(UUID)
    epoch: int = member(Int(1))


@dataclass(frozen=True, kw_only=True)
class CheckpointAck(Record):
    """The PC's answer to ``PUT sessions/{id}/checkpoint`` (§6.8): the checkpoint it keeps for
    the session covers ``output_offset`` tokens at ``epoch``. A non-deterministic sampler's
    tokens with an index below ``output_offset`` may now be released to the front end."""

    RECORD_NAME = "checkpoint acknowledgement"

    session: uuid.UUID = member(UUID)
    epoch: int = member(Int(0))
    output_offset: int = member(Int(0))


@dataclass(frozen=True, kw_only=True)
class SessionOpen(Record):
    """Body of ``POST {pc}sessions`` (ours): place a new session (§6.4) and start it.

    ``prompt_blocks``/``prompt_tail`` are those of the Session Checkpoint (§4.4): the Block
    Keys of the complete prompt blocks and the tokens after them; ``tokens`` is the prompt's
    length (the §6.4 recompute estimate). ``front_end`` receives the output tokens.
    """

    RECORD_NAME = "session open"

    session: uuid.UUID = member(UUID)
    compat_id: bytes = member(HEX32)
    scope_id: bytes = member(HEX16)
    prompt_blocks: tuple[bytes, ...] = member(ListOf(HEX32))
    prompt_tail: tuple[int, ...] = member(ListOf(TOKEN))
    tokens: int = member(Int(1))
    sampler: Sampler = member(Nested(Sampler))
    max_tokens: int = member(Int(1, MAX_OUTPUT_TOKENS))
    front_end: str = member(HTTP_URL)

    def _check(self, path: str) -> None:
        if self.sampler.step != 0:
            raise RecordError(child(child(path, "sampler"), "step"), "a new session starts at step 0")
        if len(self.prompt_tail) > self.tokens:
            raise RecordError(child(path, "tokens"), "is shorter than prompt_tail")

    def initial_checkpoint(self) -> SessionCheckpoint:
        """The checkpoint before any instance ran: epoch 0, nothing generated."""
        return SessionCheckpoint(
            session=self.session, epoch=0, compat_id=self.compat_id, scope_id=self.scope_id,
            prompt_blocks=self.prompt_blocks, prompt_tail=self.prompt_tail, generated=(), output_offset=0,
            sampler=self.sampler,
        )


@dataclass(frozen=True, kw_only=True)
class SessionView(Record):
    """A session as the PC sees it: the instance serving it (absent while none could be
    placed), the current session epoch, the output its latest checkpoint covers, and
    ``failed`` (why) once the PC gave it up."""

    RECORD_NAME = "session view"

    session: uuid.UUID = member(UUID)
    instance: str | None = member(HTTP_URL, optional=True)
    epoch: int = member(Int(0))
    output_offset: int = member(Int(0))
    #: Present once the PC gave the session up: why (every instance refused it).
    failed: str | None = member(Str(max_len=MAX_REASON_CHARS), optional=True)


@dataclass(frozen=True, kw_only=True)
class SessionList(Record):
    RECORD_NAME = "session list"

    sessions: tuple[SessionView, ...] = member(ListOf(Nested(SessionView)))


@dataclass(frozen=True, kw_only=True)
class SessionSummary(Record):
    """One session in ``GET {pc}sessions`` (ours; the dashboard's listing): its view, plus what
    it was opened with that an operator looks at (prompt blocks by key, the output asked for)."""

    RECORD_NAME = "session summary"

    session: uuid.UUID = member(UUID)
    instance: str | None = member(HTTP_URL, optional=True)
    epoch: int = member(Int(0))
    output_offset: int = member(Int(0))
    failed: str | None = member(Str(max_len=MAX_REASON_CHARS), optional=True)
    compat_id: bytes = member(HEX32)
    scope_id: bytes = member(HEX16)
    prompt_blocks: tuple[bytes, ...] = member(ListOf(HEX32))
    tokens: int = member(Int(1))
    max_tokens: int = member(Int(1, MAX_OUTPUT_TOKENS))


@dataclass(frozen=True, kw_only=True)
class SessionSummaryList(Record):
    RECORD_NAME = "session summary list"

    sessions: tuple[SessionSummary, ...] = member(ListOf(Nested(SessionSummary)))
    #: Sessions tracked that the principal may see, including those past ``limit``.
    total: int = member(Int(0))


@dataclass(frozen=True, kw_only=True)
class FailureReport(Record):
    """Body of ``POST {pc}failures`` (ours): ``instance`` failed (§6.8 "When the instance
    fails"). With ``epoch``, the report is about that incarnation only (§6.3 epochs): a report
    about an older one than the PC knows is stale."""

    RECORD_NAME = "failure report"

    instance: str = member(HTTP_URL)
    epoch: int | None = member(Int(0), optional=True)


@dataclass(frozen=True, kw_only=True)
class SessionDone(Record):
    """Body of ``POST {pc}sessions/{id}/done`` (ours): the instance serving the session at
    ``epoch`` completed it, with ``output_offset`` output tokens in all."""

    RECORD_NAME = "session done"

    epoch: int = member(Int(1))
    output_offset: int = member(Int(0))


@dataclass(frozen=True, kw_only=True)
class SessionFailed(Record):
    """Body of ``POST {pc}sessions/{id}/failed`` (ours): the instance serving the session at
    ``epoch`` cannot serve it (another model, prompt blocks no replica delivers, an unknown
    sampler, ...; ``reason`` says which). The PC places it on another instance or, when every
    instance it knows refused it, marks it failed (docs/migration.md)."""

    RECORD_NAME = "session failed"

    epoch: int = member(Int(1))
    reason: str = member(Str(max_len=MAX_REASON_CHARS))


# ---------------------------------------------------------------------------------------------
# The front end (§6.8)


@dataclass(frozen=True, kw_only=True)
class OutputToken(Record):
    """One output token and its index in the session's output (§6.8 step 4)."""

    RECORD_NAME = "output token"

    index: int = member(Int(0, MAX_OUTPUT_TOKENS - 1))
    token: int = member(TOKEN)


#: Largest number of tokens in one delivery.
MAX_TOKENS_PER_BATCH = 4096


@dataclass(frozen=True, kw_only=True)
class OutputTokens(Record):
    """Body of ``POST {fe}sessions/{id}/tokens`` (ours): output tokens of ``session``, all
    labelled with the session ``epoch`` of the instance that produced them (§6.8 "Every output
    token carries its index and the session epoch"). ``end``, once known, is the number of
    output tokens of the session: no index at or above it exists."""

    RECORD_NAME = "output tokens"

    session: uuid.UUID = member(UUID)
    epoch: int = member(Int(1))
    tokens: tuple[OutputToken, ...] = member(ListOf(Nested(OutputToken), max_len=MAX_TOKENS_PER_BATCH))
    end: int | None = member(Int(0, MAX_OUTPUT_TOKENS), optional=True)

    def _check(self, path: str) -> None:
        if self.end is None:
            return
        for i, t in enumerate(self.tokens):
            if t.index >= self.end:
                raise RecordError(child(item(child(path, "tokens"), i), "index"), f"is at or beyond end ({self.end})")


@dataclass(frozen=True, kw_only=True)
class DeliveryAnswer(Record):
    """The front end's answer to a delivery: ``accepted`` new indices, ``duplicates`` dropped
    (already delivered or buffered), and ``next``, the first index not yet delivered."""

    RECORD_NAME = "delivery answer"

    accepted: int = member(Int(0))
    duplicates: int = member(Int(0))
    next: int = member(Int(0))


@dataclass(frozen=True, kw_only=True)
class ClientSessionRequest(Record):
    """Body of ``POST {fe}sessions`` (ours): a client starts a session. The front end names it
    (a random UUID) and asks the PC to place and start it (§6.4)."""

    RECORD_NAME = "client session request"

    compat_id: bytes = member(HEX32)
    scope_id: bytes = member(HEX16)
    prompt_blocks: tuple[bytes, ...] = member(ListOf(HEX32), optional=True, default=())
    prompt_tail: tuple[int, ...] = member(ListOf(TOKEN))
    tokens: int = member(Int(1))
    sampler: Sampler = member(Nested(Sampler))
    max_tokens: int = member(Int(1, MAX_OUTPUT_TOKENS))

    def _check(self, path: str) -> None:
        if self.sampler.step != 0:
            raise RecordError(child(child(path, "sampler"), "step"), "a new session starts at step 0")
        if len(self.prompt_tail) > self.tokens:
            raise RecordError(child(path, "tokens"), "is shorter than prompt_tail")


@dataclass(frozen=True, kw_only=True)
class ClientSession(Record):
    """The front end's answer (201): the session, the instance the PC placed it on, and the
    URL of its token stream."""

    RECORD_NAME = "client session"

    session: uuid.UUID = member(UUID)
    instance: str | None = member(HTTP_URL, optional=True)
    epoch: int = member(Int(0))
    tokens_url: str = member(Str(max_len=4096))


# ---------------------------------------------------------------------------------------------
# Resharding (§6.9)


@dataclass(frozen=True, kw_only=True)
class ReshardAck(Record):
    """An instance's 200 to a reshard plan (§6.9 "acknowledges the plan with 200 after it has
    loaded all ranges listed in fetch"); ``fetched_octets`` counts the KV octets it loaded."""

    RECORD_NAME = "reshard acknowledgement"

    map: str = member(Str(max_len=256))
    to: int = member(Int(0))
    fetched_octets: int = member(Int(0))


REFUSED = "refused"
TIMED_OUT = "deadline"
CANCELLED = "cancelled"


@dataclass(frozen=True, kw_only=True)
class MemberOutcome(Record):
    """What one member did with its plan: ``acknowledged``, ``refused`` (an error answer or
    unreachable), ``deadline`` (no answer within deadline_ms), or ``cancelled`` (the PC stopped
    waiting because another member refused)."""

    RECORD_NAME = "reshard member outcome"

    instance: str = member(HTTP_URL)
    result: str = member(Enum("acknowledged", REFUSED, TIMED_OUT, CANCELLED))
    fetched_octets: int | None = member(Int(0), optional=True)
    detail: str | None = member(Str(min_len=0, max_len=4096), optional=True)


@dataclass(frozen=True, kw_only=True)
class ReshardOutcome(Record):
    """The PC's answer to ``PUT {pc}shard-maps/{map}``: ``committed`` (version ``to`` is now
    authoritative) or ``aborted`` (``from`` still is), and what each member did. A new map
    (no previous version) is ``installed``."""

    RECORD_NAME = "reshard outcome"

    map: str = member(Str(max_len=256))
    state: str = member(Enum("installed", "committed", "aborted"))
    version: int = member(Int(0))
    members: tuple[MemberOutcome, ...] = member(ListOf(Nested(MemberOutcome)), optional=True, default=())


__all__ = [
    "CheckpointAck",
    "ClientSession",
    "ClientSessionRequest",
    "DeliveryAnswer",
    "FailureReport",
    "MemberOutcome",
    "OutputToken",
    "OutputTokens",
    "ReshardAck",
    "ReshardOutcome",
    "SessionAccepted",
    "SessionDone",
    "SessionList",
    "SessionOpen",
    "SessionOrder",
    "SessionView",
    "StreamEnd",
    "StreamFailed",
]


@dataclass(frozen=True)
class StreamEnd:
    """The last item of a stream: the output has ``end`` tokens."""

    end: int


@dataclass(frozen=True)
class StreamFailed:
    """The last item of the stream of a session the PC gave up: ``reason`` says why, and
    ``next`` is the first index that was never delivered (the stream carried ``0..next-1``)."""

    reason: str
    next: int
