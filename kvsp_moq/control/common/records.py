"""JSON bodies of the PC and instance endpoints that the draft leaves to implementations
(shapes ours; docs/http-api.md "Inference Instance" and "Placement Controller").

Built on the core's record machinery, so they validate, name the member at fault and ignore
unknown members exactly like the draft's records (§4.4).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ...kvsp.records import INSTANCE_STATES, Record
from ...kvsp.records.members import HEX16, HEX32, HTTP_URL, UUID, Bool, Enum, Int, ListOf, Num, Str
from ...kvsp.records.record import Nested, member
from ...kvsp.records.instance import ACTIVE, DRAINING, SLEEPING


@dataclass(frozen=True, kw_only=True)
class StatusAnswer(Record):
    """The PC's answer to a status PUT (§6.3): ``{"state": ...}``, the state the PC holds the
    instance in. For a request to sleep it is ``draining`` (accepted) or ``active`` (refused)."""

    RECORD_NAME = "status answer"

    state: str = member(Enum(*INSTANCE_STATES))


@dataclass(frozen=True, kw_only=True)
class InstanceStateRequest(Record):
    """Body of ``PUT {pc}instance-state``: have the PC change an instance's state (§6.3)."""

    RECORD_NAME = "instance state request"

    instance: str = member(HTTP_URL)
    state: str = member(Enum(ACTIVE, DRAINING, SLEEPING))


@dataclass(frozen=True, kw_only=True)
class InstanceView(Record):
    """One instance as the PC sees it (``GET {pc}instances``): ``state`` is the effective
    state (``failed`` once the status expired), ``reported`` the one in the last record and
    ``assigned`` the last one the PC set."""

    RECORD_NAME = "instance view"

    instance: str = member(HTTP_URL)
    epoch: int | None = member(Int(0), optional=True)
    state: str = member(Enum(*INSTANCE_STATES))
    reported: str | None = member(Enum(*INSTANCE_STATES), optional=True)
    assigned: str | None = member(Enum(ACTIVE, DRAINING, SLEEPING), optional=True)
    #: Load from the last status record (§4.4): requests running and queued, KV use.
    running: int | None = member(Int(0), optional=True)
    queued: int | None = member(Int(0), optional=True)
    kv_utilization: float | None = member(Num(0, 1), optional=True)


@dataclass(frozen=True, kw_only=True)
class InstanceList(Record):
    RECORD_NAME = "instance list"

    instances: tuple[InstanceView, ...] = member(ListOf(Nested(InstanceView)))


@dataclass(frozen=True, kw_only=True)
class PlacementRequest(Record):
    """Body of ``POST {pc}placements``: where should this request run (§6.4)? ``tokens`` is the
    prompt's length; ``block_keys`` its Block Keys in prefix order (§6.2)."""

    RECORD_NAME = "placement request"

    scope_id: bytes = member(HEX16)
    compat_id: bytes = member(HEX32)
    block_keys: tuple[bytes, ...] = member(ListOf(HEX32))
    tokens: int = member(Int(1))
    request_ref: str | None = member(Str(min_len=0, max_len=1024), optional=True)
    prefetch: bool = member(Bool(), optional=True, default=True)


@dataclass(frozen=True, kw_only=True)
class Candidate(Record):
    """The §6.4 terms of one active instance. ``fetch_us`` is absent when the IS could not
    estimate it (the instance then recomputes everything)."""

    RECORD_NAME = "placement candidate"

    instance: str = member(HTTP_URL)
    wait_us: float = member(Num(0))
    fetch_us: float | None = member(Num(0), optional=True)
    recompute_unmatched_us: float = member(Num(0))
    recompute_all_us: float = member(Num(0))
    cost_us: float = member(Num(0))
    acceptable: bool = member(Bool())


@dataclass(frozen=True, kw_only=True)
class Placement(Record):
    """The PC's answer: the chosen instance, whether the PC started it, and the prefetch
    directive it sent (its id and status URL), if any."""

    RECORD_NAME = "placement"

    instance: str = member(HTTP_URL)
    cost_us: float | None = member(Num(0), optional=True)
    matched: int = member(Int(0))
    started: bool = member(Bool())
    directive: uuid.UUID | None = member(UUID, optional=True)
    directive_status: str | None = member(HTTP_URL, optional=True)
    candidates: tuple[Candidate, ...] = member(ListOf(Nested(Candidate)))


@dataclass(frozen=True, kw_only=True)
class SessionRequest(Record):
    """Body of ``POST {ii}sessions``: admit a request (a session) on the instance. The keys
    are its prompt's Block Keys; the answer says how many leading ones are resident."""

    RECORD_NAME = "session request"

    session: uuid.UUID = member(UUID)
    scope_id: bytes = member(HEX16)
    compat_id: bytes = member(HEX32)
    block_keys: tuple[bytes, ...] = member(ListOf(HEX32))
    request_ref: str | None = member(Str(min_len=0, max_len=1024), optional=True)


@dataclass(frozen=True, kw_only=True)
class SessionAdmitted(Record):
    """Answer to ``POST {ii}sessions``: ``resident`` leading blocks are loaded; the rest of
    the prompt is recomputed (§6.5 "served with the loaded prefix")."""

    RECORD_NAME = "session admitted"

    session: uuid.UUID = member(UUID)
    resident: int = member(Int(0))
