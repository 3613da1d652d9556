"""Active/standby Placement Controllers over one store (DESIGN.md §8): the leader lock.

Every PC process holds a random **leader token** and, with a shared (Redis) store, runs
:meth:`Leadership.run`: every ``lease_ms / 3`` the active PC renews its lease (a
compare-and-renew script: only while the token still holds the lock), and a standby tries to
take the lock (``SET NX PX``). A standby that takes it loads the state from the store (the
``on_elected`` hook: registry, sessions, shard maps) and only then answers as the active PC;
until then, and whenever it is not the active one, every request is refused with 503
``kvsp-not-leader`` (:meth:`Leadership.require`), and its clients try their next PC URL.

Fencing: every write goes through :meth:`Leadership.write`, which passes the token to the
store; the store's scripts refuse a token that does not hold the lock at that instant, so a
deposed PC (paused past its lease, cut off from Redis) cannot change anything even before it
notices. A refused write, a failed renewal, or renewals failing for a whole lease (Redis
unreachable: the lease has lapsed there) makes it step down (the ``on_deposed`` hook drops its
cached state) and it goes back to trying the lock.

With the embedded memory store (one process, nobody to share with) the lock is taken for good
at start (``lease_ms=None``) and no loop runs.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..common.errors import NotLeader, StoreUnavailable
from .store import PcSnapshot, PcStore

__all__ = ["Leadership"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Leadership:
    """The leader lock of one PC process (module notes)."""

    def __init__(self, store: PcStore, *, lease_ms: int | None) -> None:
        self.store = store
        self.lease_ms = lease_ms
        self.token = uuid.uuid4().hex
        self.leading = False
        #: Called with the loaded state once this PC took the lock, before it answers.
        self.on_elected: Callable[[PcSnapshot], Awaitable[None]] | None = None
        #: Called when this PC stops being the active one.
        self.on_deposed: Callable[[], None] | None = None
        self.changed = asyncio.Event()  # set at every change of ``leading`` (tests, logs)
        self._renewed_at: float | None = None

    @property
    def interval_s(self) -> float:
        assert self.lease_ms is not None
        return self.lease_ms / 3000

    def require(self) -> None:
        """``NotLeader`` (503 kvsp-not-leader) unless this PC is the active one."""
        if not self.leading:
            raise NotLeader("this Placement Controller is a standby; another one is active")

    async def write(self, fn: Callable[[str], Awaitable[T]]) -> T:
        """Run a store write with this PC's token (fencing, module notes)."""
        if not self.leading and self.lease_ms is None:
            await self.step()  # the embedded store: the lock is this process's for good
        self.require()
        try:
            return await fn(self.token)
        except NotLeader:
            self.step_down("a write was refused: the lock is held by another PC")
            raise

    async def step(self) -> None:
        """One turn of :meth:`run`: renew the lease, or try to take the lock."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.leading:
            assert self.lease_ms is not None
            try:
                held = await self.store.renew(self.token, self.lease_ms)
            except StoreUnavailable as exc:
                if self._renewed_at is not None and started - self._renewed_at >= self.lease_ms / 1000:
                    self.step_down(f"the lease lapsed while the store was unreachable: {exc}")
                return
            if held:
                self._renewed_at = started
            else:
                self.step_down("the lease was lost")
            return
        if await self.store.acquire(self.token, self.lease_ms):
            self._renewed_at = started
            await self._take_over()

    async def _take_over(self) -> None:
        try:
            snapshot = await self.store.load()
            if self.on_elected is not None:
                await self.on_elected(snapshot)
        except BaseException:
            await asyncio.shield(self._give_up())
            raise
        self.leading = True
        self._changed()
        log.info("this PC is now the active one (token %s)", self.token[:8])

    async def _give_up(self) -> None:
        try:
            await self.store.release(self.token)
        except StoreUnavailable:
            pass

    def step_down(self, why: str) -> None:
        if not self.leading:
            return
        log.warning("this PC is no longer the active one: %s", why)
        self.leading = False
        self._renewed_at = None
        if self.on_deposed is not None:
            self.on_deposed()
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def start(self) -> None:
        """The first turn, before the PC serves (the memory store: the lock for good)."""
        try:
            await self.step()
        except StoreUnavailable as exc:
            log.warning("the leader lock could not be tried: %s", exc)

    async def run(self) -> None:
        """Renew or try the lock every ``lease_ms / 3``, forever (shared stores only)."""
        if self.lease_ms is None:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except StoreUnavailable as exc:
                log.warning("the leader lock could not be tried: %s", exc)
            except Exception:  # must not stop the loop
                log.exception("the leader lock step failed")

    async def close(self) -> None:
        """Give the lock up at shutdown, so a standby takes over at once."""
        if self.leading:
            self.leading = False
            await self._give_up()
