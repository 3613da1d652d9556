"""Problem types of KVSP (RFC 9457 problem details; kvsp-draft §6.6–§6.8, DESIGN.md §5).

The draft names three problem types by a bare name; it gives them no URI. This implementation
sends ``type`` = :data:`PROBLEM_BASE` + name (``urn:kvsp:problem:kvsp-lease-quota``) and, when
reading a peer's problem, recognises a KVSP type by its last segment (after the last ``:`` or
``/``) so that peers using another base URI still interoperate (:func:`problem_name`). The
``kvsp`` URN namespace is not registered (RFC 8141); the base is a placeholder until the draft
assigns URIs, and is defined only here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

#: Base URI of KVSP problem types; a type is this base followed by the problem name.
PROBLEM_BASE: Final = "urn:kvsp:problem:"
#: Media type of problem details (RFC 9457 §3).
PROBLEM_MEDIA_TYPE: Final = "application/problem+json"

# Named by the draft.
LEASE_QUOTA: Final = "kvsp-lease-quota"  # §6.6: a lease request exceeds the client's quota
LAYERS_UNAVAILABLE: Final = "kvsp-layers-unavailable"  # §6.7: the holder lacks the layer range
STALE_EPOCH: Final = "kvsp-stale-epoch"  # §6.8: a checkpoint or message with an old epoch

# Ours (DESIGN.md §5).
UNAUTHORIZED: Final = "kvsp-unauthorized"  # no or unknown bearer token
FORBIDDEN: Final = "kvsp-forbidden"  # principal not authorized for the scope or holder
BAD_RECORD: Final = "kvsp-bad-record"  # body fails validation (RecordError)
NOT_FOUND: Final = "kvsp-not-found"  # no such block, lease, directive, session, ...
PRECONDITION_FAILED: Final = "kvsp-precondition-failed"  # e.g. PUT with If-None-Match: * on a held block (§6.7)
NOT_ACTIVE: Final = "kvsp-not-active"  # §6.3: a draining or sleeping instance refuses new sessions and directives
UNAVAILABLE: Final = "kvsp-unavailable"  # the role's state store cannot be reached (retry later)
NOT_LEADER: Final = "kvsp-not-leader"  # a standby PC: the active one answers (retry another PC)
OVERLOADED: Final = "kvsp-overloaded"  # a cap on concurrent work is reached (retry later)

SPEC_PROBLEMS: Final = (LEASE_QUOTA, LAYERS_UNAVAILABLE, STALE_EPOCH)
OUR_PROBLEMS: Final = (UNAUTHORIZED, FORBIDDEN, BAD_RECORD, NOT_FOUND, PRECONDITION_FAILED, NOT_ACTIVE,
                       UNAVAILABLE, NOT_LEADER, OVERLOADED)
PROBLEM_NAMES: Final = SPEC_PROBLEMS + OUR_PROBLEMS

#: The HTTP status each problem type is sent with. Only 404 for kvsp-layers-unavailable is
#: the draft's (§6.7); the others are ours.
DEFAULT_STATUS: Mapping[str, int] = MappingProxyType(
    {
        LEASE_QUOTA: 429,
        LAYERS_UNAVAILABLE: 404,
        STALE_EPOCH: 409,
        UNAUTHORIZED: 401,
        FORBIDDEN: 403,
        BAD_RECORD: 400,
        NOT_FOUND: 404,
        PRECONDITION_FAILED: 412,
        NOT_ACTIVE: 409,
        UNAVAILABLE: 503,
        NOT_LEADER: 503,
        OVERLOADED: 429,
    }
)

#: Short human-readable summaries (RFC 9457 §3.1.3 ``title``).
TITLES: Mapping[str, str] = MappingProxyType(
    {
        LEASE_QUOTA: "Lease quota exceeded",
        LAYERS_UNAVAILABLE: "Layers unavailable",
        STALE_EPOCH: "Stale epoch",
        UNAUTHORIZED: "Unauthorized",
        FORBIDDEN: "Forbidden",
        BAD_RECORD: "Invalid record",
        NOT_FOUND: "Not found",
        PRECONDITION_FAILED: "Precondition failed",
        NOT_ACTIVE: "Instance not active",
        UNAVAILABLE: "State store unavailable",
        NOT_LEADER: "Not the active controller",
        OVERLOADED: "Too much work in progress",
    }
)


def problem_type(name: str) -> str:
    """The ``type`` URI of a KVSP problem name; ``ValueError`` for an unknown name."""
    if name not in DEFAULT_STATUS:
        raise ValueError(f"unknown KVSP problem type {name!r}")
    return PROBLEM_BASE + name


def problem_name(type_uri: str) -> str | None:
    """The KVSP problem name a ``type`` URI ends in, whatever its base; ``None`` if it is not
    a KVSP problem type (``about:blank``, another protocol's type)."""
    last = type_uri.rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return last if last.startswith("kvsp-") and last else None
