"""An instance's status reports to the PC (kvsp-draft §6.3) and its epoch.

"Each inference instance sends its Instance Status Record to the PC at an interval no longer
than one third of its ttl_ms": :class:`StatusReporter` sends one every ``interval_ms`` (the
configuration caps it at ``ttl_ms / 3``) on an injectable :class:`~.common.clock.Timer`, so tests
drive it with a manual clock or call :meth:`StatusReporter.report_now` directly. It also
reports at once when the instance enters sleeping ("enters sleeping and reports it").

The answer to a report carrying ``requested_state: "sleeping"`` is acted on: ``draining``
means accepted (the instance drains), ``active`` refused.

Epoch (§6.3 "MUST increase every time it restarts"): :func:`wall_clock_epoch`, the start time
in milliseconds since the Unix epoch; or :func:`persisted_epoch`, a counter in a file
incremented at every start, for hosts whose clock may move backward across restarts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Protocol

from ...kvsp.records import InstanceStatusRecord
from ...kvsp.records.instance import DRAINING, SLEEPING
from ..common.clock import Timer
from ..common.records import StatusAnswer

log = logging.getLogger(__name__)


def wall_clock_epoch() -> int:
    """The start time in ms since the Unix epoch (§6.3)."""
    return time.time_ns() // 1_000_000


def persisted_epoch(path: str | Path) -> int:
    """Read the counter in ``path`` (0 if absent), store it plus one, return the new value."""
    path = Path(path)
    try:
        previous = int(path.read_text().strip() or "0")
    except FileNotFoundError:
        previous = 0
    epoch = previous + 1
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(f"{epoch}\n")
    os.replace(tmp, path)  # atomic: a crash leaves the old or the new value
    return epoch


class PcClient(Protocol):
    """The PC, as an instance reports to it."""

    async def report(self, record: InstanceStatusRecord) -> StatusAnswer:
        """``PUT {pc}instance-status``; raises on refusal (e.g. 409 stale epoch)."""
        ...


class ReportSubject(Protocol):
    """What the reporter needs of the instance."""

    def status_record(self) -> InstanceStatusRecord:
        ...

    def on_answer(self, record: InstanceStatusRecord, answer: StatusAnswer) -> None:
        ...


class StatusReporter:
    """Sends the instance's status to the PC periodically and on demand."""

    def __init__(self, subject: ReportSubject, client: PcClient | None, timer: Timer, interval_ms: int) -> None:
        self.subject = subject
        self.client = client
        self.timer = timer
        self.interval_ms = interval_ms
        self._pending: set[asyncio.Task[None]] = set()
        self.last_answer: StatusAnswer | None = None

    async def report_now(self) -> StatusAnswer | None:
        """Send one record and act on the answer; ``None`` without a PC."""
        if self.client is None:
            return None
        record = self.subject.status_record()
        answer = await self.client.report(record)
        self.last_answer = answer
        self.subject.on_answer(record, answer)
        return answer

    def trigger(self) -> None:
        """Report soon (from synchronous code: a state change)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._report_logged())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def flush(self) -> None:
        """Wait for the reports triggered so far."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def report_logged(self) -> None:
        """:meth:`report_now`, a failure logged rather than raised."""
        await self._report_logged()

    async def _report_logged(self) -> None:
        try:
            await self.report_now()
        except Exception as exc:  # the next periodic report retries
            log.warning("status report to the PC failed: %s", exc)

    async def run(self) -> None:
        """Report every ``interval_ms`` forever (the instance's background task; the first
        report is sent by the server before it announces itself)."""
        while True:
            await self.timer.sleep_ms(self.interval_ms)
            await self._report_logged()


def sleep_request(state: str, idle_ms: int, sleep_after_idle_ms: int) -> str | None:
    """``"sleeping"`` when an active instance has been idle long enough (§6.3 MAY)."""
    if state in (DRAINING, SLEEPING) or sleep_after_idle_ms <= 0:
        return None
    return SLEEPING if idle_ms >= sleep_after_idle_ms else None

