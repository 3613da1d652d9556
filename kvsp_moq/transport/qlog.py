"""qlog files of QUIC connections, on request (``TransportConfig.qlog_dir``; docs/tracing.md).

aioquic and qh3 both log a connection's events (``packet_sent``, ``packet_received``,
``datagrams_sent``, transport parameters, ...) into a ``QuicLoggerTrace`` that the
``QuicConfiguration.quic_logger`` hands out (``start_trace``) and takes back once the
connection is over (``end_trace``). Their own ``QuicFileLogger`` names the file after the
connection's original destination connection ID alone, so the client's and the server's file of
one connection overwrite each other when both ends log into one directory (a loopback test, a
relay chained to itself). :class:`QlogDirectory` is that logger with the vantage point in the
name, ``{ODCID}_{client|server}.qlog``, written whole through a temporary file (a reader never
sees half a file), plus :meth:`QlogDirectory.flush` for connections still open, which runs for
every logger at interpreter exit (a process ended by SIGTERM/SIGINT keeps the traces of
connections it did not close; SIGKILL loses them). One file is one JSON qlog (``qlog_format`` "JSON", the library's ``qlog_version``, 0.3
for both) holding one trace; qvis (https://qvis.quictools.info) opens it.

This module imports no QUIC library: a backend passes its ``QuicLoggerTrace`` class and qlog
version (``library.QuicLibrary.qlog``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any, Protocol

__all__ = ["QlogDirectory", "TraceFactory", "qlog_file_name"]


class TraceFactory(Protocol):
    """A library's ``QuicLoggerTrace`` class."""

    def __call__(self, *, is_client: bool, odcid: bytes) -> Any: ...


def qlog_file_name(odcid: bytes, is_client: bool) -> str:
    """The file one connection's trace goes to, seen from one end."""
    return f"{odcid.hex()}_{'client' if is_client else 'server'}.qlog"


class QlogDirectory:
    """A ``quic_logger`` writing one qlog file per connection and end into ``directory``
    (created if missing). Shared by every connection of a configuration; not thread-safe, as
    the connections of one event loop need not be."""

    def __init__(self, directory: str | os.PathLike[str], trace_class: TraceFactory, qlog_version: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._trace_class = trace_class
        self.qlog_version = qlog_version
        self._open: dict[int, tuple[Any, bool, bytes]] = {}
        _LIVE.add(self)

    def start_trace(self, is_client: bool, odcid: bytes) -> Any:
        trace = self._trace_class(is_client=is_client, odcid=odcid)
        self._open[id(trace)] = (trace, is_client, odcid)
        return trace

    def end_trace(self, trace: Any) -> None:
        entry = self._open.pop(id(trace), None)
        if entry is not None:
            self._write(*entry)

    def flush(self) -> list[Path]:
        """Write the traces of connections not over yet (their events so far); the files
        written. Each is written again, complete, if its connection ends later."""
        return [self._write(trace, is_client, odcid) for trace, is_client, odcid in list(self._open.values())]

    @property
    def open_traces(self) -> int:
        return len(self._open)

    def _write(self, trace: Any, is_client: bool, odcid: bytes) -> Path:
        document = {"qlog_format": "JSON", "qlog_version": self.qlog_version, "traces": [trace.to_dict()]}
        path = self.directory / qlog_file_name(odcid, is_client)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".qlog-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(document, out, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path



_LIVE: weakref.WeakSet[QlogDirectory] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for logger in list(_LIVE):
        with contextlib.suppress(OSError):
            logger.flush()
