"""How the ``kvsp`` command reports a failure: one line ``kvsp: ...`` on stderr, with the hint
a user needs, never a traceback (``KVSP_TRACEBACK=1`` prints it as well, for a bug report).

:func:`describe` turns an exception into that line and the exit status: 2 for bad input
(:class:`UsageError`, a file that cannot be read), 1 for a failure of the work itself (a MOQT
error, a connection that could not be made, anything unexpected).
"""

from __future__ import annotations

import asyncio
import os
import traceback

from ..moqt.errors import RequestErrorCode
from ..pubsub import ErrorKind, MoqtError
from ..transport.api import ConnectError, TransportError
from ..transport.tls import InsecureCredentialsError

__all__ = ["UsageError", "describe", "print_traceback", "traceback_wanted"]

#: REQUEST_ERROR codes whose cause the user can fix from the command line.
_REQUEST_HINTS: dict[int, str] = {
    RequestErrorCode.UNAUTHORIZED: "the relay wants a token allowed this namespace: "
                                   "--token TOKEN or --token-file FILE",
    RequestErrorCode.MALFORMED_AUTH_TOKEN: "check the token given with --token / --token-file",
    RequestErrorCode.EXPIRED_AUTH_TOKEN: "the token has expired: get a new one",
    RequestErrorCode.DOES_NOT_EXIST: "nothing is published under this namespace and track "
                                     "(check NAMESPACE / --block and TRACK)",
}
_TLS_HINT = ("to trust this server give --ca FILE (its CA or self-signed certificate), "
             "or --insecure for a test server on loopback")


class UsageError(Exception):
    """Bad input from the command line or a file it names; printed without a traceback."""


def traceback_wanted() -> bool:
    return os.environ.get("KVSP_TRACEBACK", "") not in ("", "0")


def _connect_hint(message: str) -> str:
    low = message.lower()
    if "tls" in low or "certificate" in low:
        return _TLS_HINT
    if "timed out" in low:
        return "is the server up and reachable over UDP at that address? (check the URL and port)"
    if "alpn" in low:
        return "the server speaks other MOQT drafts: try another --draft, or none"
    return ""


def _moqt_line(exc: MoqtError) -> str:
    name = ""
    request = exc.kind is ErrorKind.REQUEST
    if request:
        try:
            name = " " + RequestErrorCode(exc.code).name
        except ValueError:
            pass
    line = f"MOQT error 0x{exc.code:x} ({exc.kind.value}{name}): {exc.reason or 'no reason given'}"
    hint = _REQUEST_HINTS.get(exc.code) if request else None
    return f"{line}; {hint}" if hint else line


def describe(exc: BaseException) -> tuple[str, int]:
    """The one-line message (without the ``kvsp: `` prefix) and the exit status for ``exc``."""
    if isinstance(exc, UsageError):
        return str(exc), 2
    if isinstance(exc, MoqtError):
        return _moqt_line(exc), 1
    if isinstance(exc, InsecureCredentialsError):
        return (f"{exc}; give the server's CA with --ca FILE instead of --insecure "
                "(a token is never sent unverified to another host)"), 1
    if isinstance(exc, ConnectError):
        hint = _connect_hint(str(exc))
        return (f"cannot connect: {exc}; {hint}" if hint else f"cannot connect: {exc}"), 1
    if isinstance(exc, TransportError | ConnectionError):
        return f"connection failed: {exc}", 1
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return f"timed out{': ' + str(exc) if str(exc) else ''} (no answer from the server)", 1
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename}: no such file", 2
    if isinstance(exc, OSError):  # a file that cannot be read, an address already in use
        return (f"{exc.filename}: {exc.strerror or exc}" if exc.filename else str(exc)), 2
    return f"{type(exc).__name__}: {exc} (unexpected; KVSP_TRACEBACK=1 shows where)", 1


def print_traceback(exc: BaseException) -> None:
    """The traceback of ``exc`` on stderr, when ``KVSP_TRACEBACK`` asks for it."""
    if traceback_wanted():
        traceback.print_exception(exc)
