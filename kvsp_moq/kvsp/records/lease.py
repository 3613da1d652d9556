"""Leases (kvsp-draft §6.6; body shapes ours).

``POST leases`` on a holder carries a :class:`LeaseRequest` and is answered with a
:class:`LeaseGrant`; ``PUT leases/{lease}`` renews with a :class:`LeaseRenewal` and is
answered with a new grant; ``DELETE leases/{lease}`` releases it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .members import HEX16, HEX32, MAX_SAFE_INT, Int, ListOf, Str
from .record import Record, member

#: A lease identifier: 1..128 URI-unreserved characters (RFC 3986 §2.3), so it can be a path
#: segment (``leases/{lease}``) without escaping.
LEASE_ID = Str(max_len=128, pattern=r"[A-Za-z0-9._~-]+", what="1 to 128 URI-unreserved characters")


@dataclass(frozen=True, kw_only=True)
class LeaseRequest(Record):
    """Lease the replicas of ``block_keys`` of one compat_id and scope for ``ttl_ms`` (§6.6).
    The block resources they protect are ``blocks/{compat_id}/{scope_id}/{key}`` (§6.7)."""

    RECORD_NAME = "lease request"

    block_keys: tuple[bytes, ...] = member(ListOf(HEX32, min_len=1))
    compat_id: bytes = member(HEX32)
    scope_id: bytes = member(HEX16)
    ttl_ms: int = member(Int(1))


@dataclass(frozen=True, kw_only=True)
class LeaseRenewal(Record):
    """Body of ``PUT leases/{lease}``: extend the lease by ``ttl_ms`` from now."""

    RECORD_NAME = "lease renewal"

    ttl_ms: int = member(Int(1))


@dataclass(frozen=True, kw_only=True)
class LeaseGrant(Record):
    """A created or renewed lease: its identifier and the granted TTL, which the holder may
    have reduced to the client's quota (§6.6); ``expires_ms`` optionally gives the expiry as
    milliseconds since the Unix epoch on the holder's clock."""

    RECORD_NAME = "lease grant"

    lease: str = member(LEASE_ID)
    ttl_ms: int = member(Int(1))
    expires_ms: int | None = member(Int(0, MAX_SAFE_INT), optional=True)
