"""Errors the control-plane services raise, each tied to a KVSP problem type (DESIGN.md §5).

Services are plain classes that know nothing of HTTP: they raise a :class:`ServiceError`, and
``http.server.problem_middleware`` (or, later, the MOQT binding) turns it into an RFC 9457 problem
with the type's status. A body that fails validation is reported with the core's
:class:`~kvsp_moq.kvsp.errors.RecordError`, which names the member at fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from ...kvsp import problems


class ConfigError(ValueError):
    """A configuration file or mapping is invalid; ``key`` is the dotted key at fault."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class ServiceError(Exception):
    """A request a service refuses. ``problem`` is the KVSP problem name it maps to."""

    problem: ClassVar[str]

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)

    @property
    def headers(self) -> Mapping[str, str]:
        """Extra response fields the refusal carries (``WWW-Authenticate`` for 401)."""
        return MappingProxyType({})


class Unauthorized(ServiceError):
    """No credentials, or credentials that name no principal (401, RFC 6750 §3).

    ``error`` is the RFC 6750 §3.1 error code: ``None`` when the request carried no bearer
    token at all (the server then sends no error code), ``"invalid_token"`` otherwise.
    """

    problem = problems.UNAUTHORIZED
    REALM: ClassVar[str] = "kvsp"

    def __init__(self, detail: str, *, error: str | None = None) -> None:
        super().__init__(detail)
        self.error = error

    @property
    def headers(self) -> Mapping[str, str]:
        challenge = f'Bearer realm="{self.REALM}"'
        if self.error is not None:
            challenge += f', error="{self.error}"'
        return MappingProxyType({"WWW-Authenticate": challenge})


class Forbidden(ServiceError):
    """The principal is known but not authorized for the scope, holder or instance (403)."""

    problem = problems.FORBIDDEN


class NotFound(ServiceError):
    """The addressed replica, record or resource does not exist (404)."""

    problem = problems.NOT_FOUND


class StaleEpoch(ServiceError):
    """A record carries an epoch lower than the highest seen for its instance (409, §6.3)."""

    problem = problems.STALE_EPOCH


class PreconditionFailed(ServiceError):
    """``PUT`` with ``If-None-Match: *`` on a block the holder already has (412, §6.7)."""

    problem = problems.PRECONDITION_FAILED


class LayersNotHeld(ServiceError):
    """The holder does not hold the requested layers, or not in the requested codec (404
    ``kvsp-layers-unavailable``, §6.7)."""

    problem = problems.LAYERS_UNAVAILABLE


class LeaseQuotaExceeded(ServiceError):
    """A lease request or renewal exceeds the client's quota on leased octets, on lease TTL or
    on live leases (429 ``kvsp-lease-quota``, §6.6)."""

    problem = problems.LEASE_QUOTA


class NotActive(ServiceError):
    """A draining or sleeping instance refuses a new session or prefetch directive (409
    ``kvsp-not-active``, §6.3: "MUST NOT accept new ones"); ours."""

    problem = problems.NOT_ACTIVE


class StoreUnavailable(ServiceError):
    """The role's state store (Redis) cannot be reached or did not answer within its timeout
    (503 ``kvsp-unavailable``, ours; DESIGN.md §8). The request may be retried."""

    problem = problems.UNAVAILABLE
    RETRY_AFTER_S: ClassVar[int] = 1

    @property
    def headers(self) -> Mapping[str, str]:
        return MappingProxyType({"Retry-After": str(self.RETRY_AFTER_S)})


class Overloaded(ServiceError):
    """A cap on concurrent work is reached (429 ``kvsp-overloaded``, ours; e.g. running prefetch
    directives, issue 18): nothing was started; retry after ``Retry-After``."""

    problem = problems.OVERLOADED

    @property
    def headers(self) -> Mapping[str, str]:
        return MappingProxyType({"Retry-After": "1"})


class NotLeader(ServiceError):
    """A standby Placement Controller refuses what only the active one may do (503
    ``kvsp-not-leader``, ours): the client tries its next PC URL. ``leader`` names the active
    PC when it is known."""

    problem = problems.NOT_LEADER

    def __init__(self, detail: str, *, leader: str | None = None) -> None:
        super().__init__(detail)
        self.leader = leader

    @property
    def headers(self) -> Mapping[str, str]:
        return MappingProxyType({"Retry-After": "1"})


class InstanceUnreachable(Exception):
    """An instance refused or did not answer a call of the PC (a client-side error, not a
    refusal the PC sends)."""


# Failures of calls to peers: raised by the clients (``client.http``) behind the interfaces the
# services define, and caught by those services (not refusals they send).


class LeaseRefused(Exception):
    """A holder did not grant a lease (404: block not held, 429: quota, or unreachable)."""


class ShardFetchFailed(Exception):
    """A peer did not serve a token range (error answer, bad container, unreachable)."""


class Superseded(Exception):
    """The session moved on to a higher epoch (a ``kvsp-stale-epoch`` answer): stop it."""


class SessionRefused(Exception):
    """The engine cannot serve this session on this instance (the message says why)."""


class PeerUnreachable(Exception):
    """The PC or the front end refused otherwise or could not be reached."""


class FrontEndUnreachable(Exception):
    """A front end refused or did not answer a failure notice."""


class SessionOpenFailed(Exception):
    """The PC did not place or start the session."""
