"""The Instance Status Record (kvsp-draft §4.4, §6.3) and the state-change body (§6.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ..errors import RecordError
from .members import HOLDER_URL, HTTP_URL, Enum, Int, ListOf, Nullable, Num, child, item
from .record import Nested, Record, member

#: The instance lifecycle states (§6.3).
ACTIVE: Final = "active"
DRAINING: Final = "draining"
SLEEPING: Final = "sleeping"
FAILED: Final = "failed"
INSTANCE_STATES: Final = (ACTIVE, DRAINING, SLEEPING, FAILED)


@dataclass(frozen=True, kw_only=True)
class Link(Record):
    """A measured link from the instance to a holder (§4.4), used by fetch_us (§6.4)."""

    RECORD_NAME = "link"

    holder: str = member(HOLDER_URL)
    mbit_per_s: float = member(Num(0, exclusive_min=True))
    rtt_us: float = member(Num(0))


@dataclass(frozen=True, kw_only=True)
class InstanceStatusRecord(Record):
    """What an inference instance reports to the PC at least every ttl_ms / 3 (§6.3).

    ``requested_state`` is ``null`` or ``"sleeping"``, the only request §6.3 defines; an absent
    member reads as ``null`` and it is always written (as in the §4.4 example). Each holder
    appears at most once in ``links``.
    """

    RECORD_NAME = "instance status record"

    instance: str = member(HTTP_URL)
    epoch: int = member(Int(0))
    state: str = member(Enum(*INSTANCE_STATES))
    running: int = member(Int(0))
    queued: int = member(Int(0))
    batch_size: int = member(Int(0))
    kv_utilization: float = member(Num(0, 1))
    prefill_tokens_per_s: float = member(Num(0))
    decode_tokens_per_s: float = member(Num(0))
    links: tuple[Link, ...] = member(ListOf(Nested(Link)))
    requested_state: str | None = member(Nullable(Enum(SLEEPING)), optional=True, emit_null=True)
    ttl_ms: int = member(Int(1))

    def _check(self, path: str) -> None:
        seen: dict[str, int] = {}
        for i, link in enumerate(self.links):
            if link.holder in seen:
                raise RecordError(
                    child(item(child(path, "links"), i), "holder"),
                    f"duplicates links[{seen[link.holder]}].holder",
                )
            seen[link.holder] = i

    def link_to(self, holder: str) -> Link | None:
        """The link to ``holder``, or ``None`` if the instance reports none."""
        return next((link for link in self.links if link.holder == holder), None)


@dataclass(frozen=True, kw_only=True)
class StateChange(Record):
    """``{"state": ...}``: the PC's answer to a status PUT (``draining`` accepts a request to
    sleep, ``active`` refuses it) and the body of ``PUT state`` on an instance (§6.3).

    Any state but ``failed`` may be set: the PC can wake (``active``), drain (``draining``) or,
    for an idle instance, put to sleep (``sleeping``); failure is never assigned.
    """

    RECORD_NAME = "state change"

    state: str = member(Enum(ACTIVE, DRAINING, SLEEPING))
