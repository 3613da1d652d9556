"""Hostile HTTP requests against the control plane's routes (no tests here; used by
``test_http_hostile.py``).

:func:`attack_json_route` sends a route every kind of bad request the checklist names —
wrong credentials, wrong media types, oversized bodies (with Content-Length and chunked),
truncated JSON, non-objects, invalid UTF-8, lone surrogates, duplicate names, NaN, deep
nesting, and, for every leaf member of a valid body, values of the wrong JSON type, negative
and huge numbers (beyond I-JSON, beyond a double, beyond Python's int-parsing limit) — and
collects every answer that breaks the rules: each refusal must be an RFC 9457 problem
(``application/problem+json``, ``status`` = the HTTP status, a ``type`` and a ``title``) with
the expected status and KVSP problem type, and nothing may be a 500.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PROBLEM_JSON = "application/problem+json"
KVSP_JSON = "application/kvsp+json"
_RAW = "__raw_literal__"
#: Members whose values are free-form JSON (``sampler.params``, §4.4): any type is valid there.
FREE_FORM = frozenset({"params"})


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    @property
    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def problem(self) -> str | None:
        doc = self.json
        if not isinstance(doc, dict) or not isinstance(doc.get("type"), str):
            return None
        return doc["type"].rsplit(":", 1)[-1]


@dataclass
class Findings:
    """Every rule an answer broke, with the request that got it."""

    broken: list[str] = field(default_factory=list)
    requests: int = 0

    def check(self, what: str, answer: Answer, status: int | tuple[int, ...], problem: str | None = None,
              member: str | None = None) -> None:
        self.requests += 1
        statuses = (status,) if isinstance(status, int) else status
        where = f"{what}: got {answer.status} {answer.body[:300]!r}"
        if answer.status >= 500:
            self.broken.append(f"5xx — {where}")
            return
        if answer.status not in statuses:
            self.broken.append(f"expected {statuses} — {where}")
            return
        if answer.status < 400:
            return
        if answer.content_type != PROBLEM_JSON:
            self.broken.append(f"not {PROBLEM_JSON} ({answer.content_type}) — {where}")
            return
        doc = answer.json
        if not (isinstance(doc, dict) and doc.get("status") == answer.status and isinstance(doc.get("type"), str)
                and isinstance(doc.get("title"), str)):
            self.broken.append(f"not a problem details object — {where}")
            return
        if problem is not None and answer.problem != problem:
            self.broken.append(f"expected problem {problem} — {where}")
        if member is not None and not str(doc.get("member", "")).startswith(member):
            self.broken.append(f"expected member {member!r} — {where}")

    def assert_clean(self) -> None:
        assert not self.broken, f"{len(self.broken)} of {self.requests} answers broke the rules:\n" + "\n".join(self.broken)


async def send(http: aiohttp.ClientSession, method: str, url: str, *, token: str | None,
               body: bytes | None = None, content_type: str | None = KVSP_JSON, chunked: bool = False,
               params: Mapping[str, str] | None = None, headers: Mapping[str, str] | None = None) -> Answer:
    """One request; ``chunked`` sends the body without Content-Length."""
    sent: dict[str, str] = {}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    if body is not None and content_type is not None:
        sent["Content-Type"] = content_type
    sent.update(headers or {})
    data: Any = body
    if chunked and body is not None:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(body), 65536):
                yield body[i:i + 65536]
        data = chunks()
    async with http.request(method, url, data=data, headers=sent, params=params) as resp:
        return Answer(resp.status, resp.content_type, await resp.read())


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every scalar of a JSON value, the first element of each array
    standing for all; free-form members are left out."""
    if isinstance(value, dict):
        for key, v in value.items():
            if key in FREE_FORM:
                continue
            yield from leaves(v, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        if value:
            yield from leaves(value[0], f"{path}[0]")
        yield path, value
    else:
        yield path, value


def replaced(body: Any, path: str, new: Any) -> Any:
    """A deep copy of ``body`` with the value at ``path`` (as :func:`leaves` names it) replaced."""
    copy = json.loads(json.dumps(body))
    parts = path.replace("[0]", ".[0]").split(".")
    target = copy
    for part in parts[:-1]:
        target = target[0] if part == "[0]" else target[part]
    last = parts[-1]
    if last == "[0]":
        target[0] = new
    else:
        target[last] = new
    return copy


def with_raw(body: Any, path: str, literal: str) -> bytes:
    """``body`` as JSON text with the value at ``path`` written as the raw ``literal``."""
    return json.dumps(replaced(body, path, _RAW)).replace(f'"{_RAW}"', literal).encode()


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


WRONG_TYPES: tuple[Any, ...] = ("x", 1, 1.5, True, None, [], {})
#: Numbers out of every member's range, as raw JSON literals: negative, beyond I-JSON's exact
#: integers, beyond 64 bits, beyond a double, and beyond Python's int-parsing digit limit.
BAD_NUMBERS = ("-1", "-9007199254740993", "9007199254740993", "18446744073709551616", "1e400", "-1e400",
               "1" + "0" * 5000, "0.5")


@dataclass
class JsonRoute:
    """A route with a JSON body. ``body`` is valid for it (it is never sent as it is), ``who``
    a principal that may call it, ``outsider`` one that is authenticated but lacks the grant
    (403 with ``body``), ``max_body`` the role's max_body_octets."""

    method: str
    url: str
    body: dict[str, Any]
    who: str
    max_body: int
    outsider: str | None = None
    #: Leaf paths whose numbers are signed 64-bit or wider (``sampler.seed``, §4.4): the
    #: negative and beyond-I-JSON numbers are valid there.
    wide: frozenset[str] = frozenset()


async def attack_json_route(http: aiohttp.ClientSession, route: JsonRoute, tokens: Mapping[str, str],
                            found: Findings) -> None:
    """Every hostile variant of one JSON route (module notes)."""
    m, url, token = route.method, route.url, tokens[route.who]
    name = f"{m} {url}"
    valid = json.dumps(route.body).encode()

    async def go(what: str, body: bytes | None, status: int | tuple[int, ...], problem: str | None = None,
                 member: str | None = None, **kw: Any) -> None:
        kw.setdefault("token", token)
        found.check(f"{name} [{what}]", await send(http, m, url, body=body, **kw), status, problem, member)

    # credentials (RFC 6750; docs/http-api.md "Authentication")
    await go("no credentials", valid, 401, "kvsp-unauthorized", token=None)
    await go("unknown token", valid, 401, "kvsp-unauthorized", token="A" * 43)
    await go("malformed token", valid, 401, "kvsp-unauthorized", token="a b")
    await go("basic scheme", valid, 401, "kvsp-unauthorized", token=None, headers={"Authorization": "Basic dXNlcjpwdw=="})
    if route.outsider is not None:
        await go("outsider", valid, 403, "kvsp-forbidden", token=tokens[route.outsider])
    # media types and sizes
    await go("text/plain", valid, 415, content_type="text/plain")
    await go("latin-1 charset", valid, 415, content_type="application/json; charset=latin-1")
    await go("no content type", valid, 415, content_type=None)
    big = b'{"x":"' + b"a" * route.max_body + b'"}'
    await go("oversized", big, 413)
    await go("oversized chunked", big, 413, chunked=True)
    # JSON that is not an acceptable object
    for what, raw in (
        ("empty", b""), ("truncated", valid[: len(valid) // 2]), ("array", b"[]"), ("string", b'"x"'),
        ("number", b"1"), ("null", b"null"), ("invalid UTF-8", b'{"x":"\xff\xfe"}'),
        ("overlong UTF-8", b'{"x":"\xc0\xaf"}'), ("duplicate names", b'{"x":1,"x":2}'), ("NaN", b'{"x":NaN}'),
        ("Infinity", b'{"x":-Infinity}'), ("trailing data", valid + b"{}"), ("BOM", b"\xef\xbb\xbf" + valid),
        ("deep nesting", b'{"x":' + b"[" * 20_000 + b"]" * 20_000 + b"}"),
        ("deep objects", b'{"x":' + b'{"a":' * 5_000 + b"1" + b"}" * 5_000 + b"}"),
        ("nesting just over the limit", b'{"x":' + b"[" * 64 + b"]" * 64 + b"}"),
    ):
        if len(raw) <= route.max_body:
            await go(what, raw, 400, "kvsp-bad-record", "$")
    # every member: missing, the wrong JSON type, bad numbers, bad strings
    for path, value in leaves(route.body):
        top = path.split(".")[0].split("[")[0]
        for new in WRONG_TYPES:
            if _json_kind(new) == _json_kind(value) or (isinstance(value, float) and new == 1):
                continue
            await go(f"{path} = {new!r}", json.dumps(replaced(route.body, path, new)).encode(), 400,
                     "kvsp-bad-record", top)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for literal in BAD_NUMBERS:
                if path in route.wide and literal in ("-1", "-9007199254740993", "9007199254740993"):
                    continue
                await go(f"{path} = {literal[:24]}", with_raw(route.body, path, literal), 400, "kvsp-bad-record")
        if isinstance(value, str):
            await go(f"{path} = lone surrogate", with_raw(route.body, path, '"\\ud800"'), 400, "kvsp-bad-record", top)
            await go(f"{path} = huge", json.dumps(replaced(route.body, path, "a" * route.max_body)).encode(), 413)
            await go(f"{path} = long", json.dumps(replaced(route.body, path, "a" * 5000)).encode(),
                     (400, 403, 404, 409, 412, 200, 201, 202, 204))
        if isinstance(value, list):
            many = json.dumps(replaced(route.body, path, [value[0] if value else 0] * 5000)).encode()
            await go(f"{path} = 5000 elements", many, (400, 403, 404, 409, 412, 413, 200, 201, 202, 204))
    for key in route.body:
        missing = {k: v for k, v in route.body.items() if k != key}
        # may be valid (an optional member): any refusal, or success
        await go(f"without {key}", json.dumps(missing).encode(), (400, 403, 404, 409, 412, 200, 201, 202, 204))
