"""What the two :class:`~.api.Server` implementations share: :class:`ServerCore`.

:class:`~.endpoints.EngineServer` (one UDP socket demultiplexed by the library's
``QuicServer``) and :class:`~.aiopquic.server.AiopquicServer` (one picoquic context) differ in
how they listen and accept; what they do with the connections they accepted is the same:
keep them until they end, report the established ones, and on ``close`` close or refuse each
and wait, within a grace period, for their closing periods to end before the endpoint stops.
This module imports no QUIC library.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from typing import ClassVar, Generic, TypeVar

from .api import Address, Connection, HandlerFactory, Server
from .config import TransportConfig
from .connection_core import ConnectionCore

__all__ = ["ServerCore"]

_SERVER_CLOSE_GRACE = 5.0  # seconds wait_closed waits for closing periods to end

C = TypeVar("C", bound=ConnectionCore)


class ServerCore(Server, Generic[C]):
    """The accepted connections of a server (``C``) and its close sequence; a subclass
    listens, makes the connections (adding each to ``_all``, with :meth:`_conn_ended` as
    its end callback) and stops the endpoint (:meth:`_stop_endpoint`)."""

    #: The subclass module's logger, and what its endpoint's stop is called in the log.
    _log: ClassVar[logging.Logger] = logging.getLogger(__name__)
    _stopping: ClassVar[str] = "stopping the server"

    def __init__(self, config: TransportConfig, handler_factory: HandlerFactory) -> None:
        self._config = config
        self._factory = handler_factory
        self._address: Address = ("", 0)
        self._all: set[C] = set()
        self._closing: tuple[int, str] | None = None
        self._drained = asyncio.Event()

    def _conn_ended(self, conn: C) -> None:
        self._all.discard(conn)
        if self._closing is not None and not self._all:
            self._drained.set()

    @property
    def address(self) -> Address:
        return self._address

    @property
    def connections(self) -> frozenset[Connection]:
        return frozenset(c for c in self._all if c.handler is not None and not c.is_closed)

    def close(self, error_code: int = 0, reason: str = "") -> None:
        if self._closing is not None:
            return
        self._closing = (error_code, reason)
        for conn in list(self._all):
            conn.close_or_refuse(error_code, reason)
        if not self._all:
            self._drained.set()

    async def wait_closed(self) -> None:
        if self._closing is None:
            raise RuntimeError("call close() first")
        try:
            await asyncio.wait_for(self._drained.wait(), _SERVER_CLOSE_GRACE)
        except asyncio.TimeoutError:
            self._log.warning("%d connections still closing; %s anyway", len(self._all),
                              self._stopping)
        await self._stop_endpoint()

    @abc.abstractmethod
    async def _stop_endpoint(self) -> None:
        """Stop listening and release the endpoint (the socket, the thread)."""
