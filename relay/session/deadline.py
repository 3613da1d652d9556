"""A bound on every wait of the relay on a peer (issue 18): one event-loop timer
(``call_later``), no polling.

Each request the relay sends upstream (SUBSCRIBE, FETCH, TRACK_STATUS, PUBLISH_NAMESPACE,
SUBSCRIBE_NAMESPACE, PUBLISH to the upstream relay) holds a :class:`Deadline` of
``RelayConfig.request_timeout`` seconds, armed when the request is sent and re-armed on
every sign of progress that request is waiting for (an upstream FETCH: each object event;
the others: their answer cancels it). On expiry the request's handler cancels the upstream
request (RESET_STREAM / STOP_SENDING CANCELLED, draft-22 §"Request Cancellation"), forgets
its state, and answers the downstream requests waiting on it with REQUEST_ERROR TIMEOUT
(0x2, §"REQUEST_ERROR": "The subscription could not be completed before an implementation
specific timeout. For example, a relay could not establish an upstream subscription within
the timeout").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Deadline"]


class Deadline:
    """Calls ``on_expiry`` once ``seconds`` passed since the last :meth:`arm` or
    :meth:`touch` (unless :meth:`cancel` came first)."""

    def __init__(self, seconds: float, on_expiry: Callable[[], None]) -> None:
        self.seconds = seconds
        self.on_expiry = on_expiry
        self._handle: asyncio.TimerHandle | None = None
        #: Loop time of the last :meth:`touch` since the timer was (re)armed, or None.
        self._touched: float | None = None
        self.expired = False

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        """Start (or restart) the wait."""
        self.cancel()
        self._touched = None
        if self.seconds > 0 and not self.expired:
            self._handle = asyncio.get_running_loop().call_later(self.seconds, self._fire)

    def touch(self) -> None:
        """Progress, as :meth:`arm` but cheap enough for every chunk of a transfer: no new
        timer per call; the armed one, when it fires, re-arms for what is left of
        ``seconds`` since the last touch."""
        if self._handle is None:
            self.arm()
        else:
            self._touched = asyncio.get_running_loop().time()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        touched, self._touched = self._touched, None
        if touched is not None:
            loop = asyncio.get_running_loop()
            left = touched + self.seconds - loop.time()
            if left > 0:  # progress since the timer was set: wait for the rest
                self._handle = loop.call_later(left, self._fire)
                return
        self._handle = None
        self.expired = True
        self.on_expiry()
