"""Reserved Track Namespaces (draft-ietf-moq-transport-22 §"Reserved Namespaces" and
§"Session-Level Tracks and Namespaces"; the same text in draft 18 and the draft-20 editor's copy).

* "MOQT reserves all Track Namespace values whose first tuple field begins with a period
  (0x2e, ``.``)" — :func:`is_reserved_namespace`. "Unless otherwise specified, an endpoint that
  receives a request for an unrecognized reserved namespace MUST pass it to the Application."
* "A Track Namespace whose first field is exactly ``.`` ... MUST NOT be used for any purpose;
  endpoints MUST NOT publish tracks or namespaces under it and MUST reject requests
  referencing it with DOES_NOT_EXIST."
* ``.session`` holds session-level tracks and namespaces, "managed by the MOQT implementation,
  not the Application"; "Relays MUST NOT forward requests for session-level tracks and
  namespaces to other sessions" — :func:`is_session_level_namespace`. "An endpoint that
  receives a request for an unrecognized session-level track or namespace MUST reject it with
  REQUEST_ERROR using error code DOES_NOT_EXIST rather than passing it to the Application."
  The draft registers none ("This document does not define any initial entries"), and neither
  do we: every ``.session`` request is unrecognized.

:func:`rejected_namespace` is the session's rule (the request is answered REQUEST_ERROR
DOES_NOT_EXIST and never reaches the application).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..wire.buffer import Buffer

__all__ = [
    "RESERVED_PREFIX",
    "SESSION_LEVEL_FIELD",
    "UNUSABLE_FIELD",
    "is_reserved_namespace",
    "is_session_level_namespace",
    "rejected_namespace",
]

#: A first field beginning with this byte is reserved.
RESERVED_PREFIX = b"."
#: The first field that "MUST NOT be used for any purpose".
UNUSABLE_FIELD = b"."
#: The first field of session-level tracks and namespaces.
SESSION_LEVEL_FIELD = b".session"


def _first(namespace: Sequence[Buffer]) -> bytes | None:
    return bytes(namespace[0]) if len(namespace) else None


def is_reserved_namespace(namespace: Sequence[Buffer]) -> bool:
    """True if the first Track Namespace Field begins with ``.`` (``.``, ``.session``, and
    any future registration). A relay never forwards such a request to another session."""
    first = _first(namespace)
    return first is not None and first.startswith(RESERVED_PREFIX)


def is_session_level_namespace(namespace: Sequence[Buffer]) -> bool:
    """True if the first field is exactly ``.session`` (session-level: never forwarded)."""
    return _first(namespace) == SESSION_LEVEL_FIELD


def rejected_namespace(namespace: Sequence[Buffer]) -> bool:
    """True if a request naming ``namespace`` (a Track Namespace or a Track Namespace Prefix)
    MUST be rejected with DOES_NOT_EXIST by the MOQT layer: a first field of exactly ``.``,
    or ``.session`` (no session-level track or namespace is recognized here)."""
    first = _first(namespace)
    return first == UNUSABLE_FIELD or first == SESSION_LEVEL_FIELD
