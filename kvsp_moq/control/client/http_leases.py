"""A holder's leases over HTTP (kvsp-draft §6.6; docs/http-api.md "POST {h}leases"): the
``instance.prefetch.LeaseClient`` an instance uses, on :class:`~.http.HttpClient`."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ...kvsp import problems
from ...kvsp.records import LeaseGrant, LeaseRequest, Record, parse_json
from ..common.errors import LeaseRefused
from .http import ANSWER_LOST, NOT_REACHED, TRANSPORT_ERRORS, HttpClient

__all__ = ["HttpLeaseClient"]


def _leases(holder: str) -> str:
    return f"{holder if holder.endswith('/') else holder + '/'}leases"


class HttpLeaseClient(HttpClient):
    """§6.6 ``POST``/``DELETE {holder}leases`` (``instance.prefetch.LeaseClient``).

    Both calls are retried after a 503 ``kvsp-unavailable``, or after the connection dropped
    once the request was sent (its answer may be what was lost), up to ``retries`` times, ``retry_pause_s`` apart (the holder's ``Retry-After``), because both are
    safe to repeat: a grant carries an ``Idempotency-Key`` (the same on every try), so a try the
    holder stored but did not acknowledge is answered again, not doubled; a release the holder
    applied already is answered 204 (404: the lease is gone too). ``pause`` waits between tries
    (``asyncio.sleep``); the other keywords are :class:`~.http.HttpClient`'s. A holder that
    cannot be reached (connection refused, a timeout) is not tried again: nothing reached it,
    or its caller's own bound is spent, and a prefetch's deadline is better spent on the next
    source (tests/test_migration.py, a directive whose first source is a dead instance)."""

    def __init__(self, token: str | None, *, retries: int = 2, retry_pause_s: float = 1.0,
                 pause: Callable[[float], Awaitable[None]] | None = None, **kw: Any) -> None:
        super().__init__(token, **kw)
        self.retries = retries
        self.retry_pause_s = retry_pause_s
        self._pause = pause if pause is not None else asyncio.sleep

    async def _retried(self, method: str, url: str, body: Record | None = None,
                       headers: Mapping[str, str] | None = None) -> tuple[int, bytes, str | None, str]:
        """One lease call, retried as the class notes say; the last try's answer or error."""
        for tries_left in range(self.retries, -1, -1):
            try:
                answer = await self._call(method, url, body, headers)
            except ANSWER_LOST as exc:
                if not tries_left or isinstance(exc, NOT_REACHED):
                    raise
            else:
                if not (tries_left and answer[0] == 503 and answer[2] == problems.UNAVAILABLE):
                    return answer
            await self._pause(self.retry_pause_s)
        raise AssertionError("unreachable: the last try returns or raises")

    async def lease(self, holder: str, request: LeaseRequest) -> LeaseGrant:
        key = {"Idempotency-Key": f'"{secrets.token_urlsafe(18)}"'}  # one request, however many tries
        try:
            status, body, name, detail = await self._retried("POST", _leases(holder), request, key)
        except TRANSPORT_ERRORS as exc:
            raise LeaseRefused(f"{type(exc).__name__}: {exc}") from exc
        if status != 201:
            raise LeaseRefused(f"status {status} {name or ''}: {detail}")
        return parse_json(body, LeaseGrant)

    async def release(self, holder: str, lease: str) -> None:
        status, _, name, detail = await self._retried("DELETE", f"{_leases(holder)}/{lease}")
        if status not in (204, 404):  # 404: expired already
            raise LeaseRefused(f"release: status {status} {name or ''}: {detail}")
