"""Keeping a client's session to a relay alive: a liveness probe and reconnect backoff.

Why a probe: when a relay's process is killed and a new one binds the same port, nothing
tells the clients. The new process drops the old connections' packets (it cannot send a
Stateless Reset without the old process's keys, RFC 9000 §10.3), so each client's QUIC
connection looks open until its idle timeout (``TransportConfig.idle_timeout``, 60 s), and a
request sent on it waits for its own deadline. A PING the peer must acknowledge (RFC 9000
§19.2; ``Connection.ping``) every :attr:`Reconnect.keepalive` seconds finds a dead peer within
``keepalive + liveness_timeout``; the session is then closed and a new one made, which reaches
the restarted relay at the same URL.

Why backoff: a relay that is down for a while is not asked again on every request. The
delays grow from :attr:`Reconnect.backoff_initial` by :attr:`Reconnect.backoff_factor` to
:attr:`Reconnect.backoff_max`, each shortened by a random part of up to
:attr:`Reconnect.jitter` of itself (many clients of one relay do not come back in step).

Backends: aioquic and qh3 send a real PING frame. aiopquic's ``ping`` waits until picoquic has
no bytes in flight, so on a connection that *sends* without a pause for longer than
``liveness_timeout`` a live peer is taken for gone: with that backend raise
``liveness_timeout`` above the longest transfer, or set ``keepalive`` to 0.

Users: the instance's session pool (``bridge/pool.py``), the holder's relay links
(``bridge/holder.py``) and the relay's own upstream link (``relay/subscribe/uplink.py``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass

from ..transport import Connection, TransportError

__all__ = ["Reconnect", "probe_liveness"]


@dataclass(frozen=True)
class Reconnect:
    """How a client watches its session to a relay and connects again (seconds)."""

    #: Seconds between two liveness PINGs on the session; 0: no probe (a dead peer is then
    #: found by the QUIC idle timeout or a request's own deadline only).
    keepalive: float = 5.0
    #: A PING not acknowledged within this many seconds means the peer is gone.
    liveness_timeout: float = 5.0
    #: The first reconnect waits this long; each failed attempt multiplies the wait by
    #: ``backoff_factor``, up to ``backoff_max``.
    backoff_initial: float = 0.1
    backoff_max: float = 5.0
    backoff_factor: float = 2.0
    #: Up to this fraction of each wait is taken off at random (0: exact waits).
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.keepalive < 0:
            raise ValueError("keepalive must be >= 0")
        if not self.liveness_timeout > 0:
            raise ValueError("liveness_timeout must be > 0")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError("backoff_initial must be > 0 and <= backoff_max")
        if self.backoff_factor < 1:
            raise ValueError("backoff_factor must be >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")

    def delays(self) -> Iterator[float]:
        """The waits before attempts 1, 2, ... (endless: the caller decides when to stop)."""
        delay = self.backoff_initial
        while True:
            yield delay * (1 - self.jitter * random.random())
            delay = min(self.backoff_max, delay * self.backoff_factor)

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` failed attempts in a row (``failures`` >= 1), without
        jitter: ``backoff_initial * factor ** (failures - 1)``, at most ``backoff_max``."""
        return min(self.backoff_max,
                   self.backoff_initial * self.backoff_factor ** max(0, min(failures - 1, 64)))


async def probe_liveness(connection: Connection, reconnect: Reconnect) -> str | None:
    """PING ``connection`` every ``reconnect.keepalive`` seconds; return why the peer is
    taken for gone (a PING not acknowledged within ``liveness_timeout``), or None once the
    connection ended by itself (or at once when ``keepalive`` is 0)."""
    if reconnect.keepalive <= 0:
        return None
    while not connection.is_closed:
        await asyncio.sleep(reconnect.keepalive)  # the probe's period, not a wait for a state
        if connection.is_closed:
            return None
        try:
            await asyncio.wait_for(connection.ping(), reconnect.liveness_timeout)
        except asyncio.TimeoutError:
            return f"no acknowledgement of a PING within {reconnect.liveness_timeout:g} s"
        except (ConnectionError, TransportError):
            return None  # it ended meanwhile (a WebTransport session raises when closed)
    return None
