"""The native extension's ``acked`` wake-ups (issue 28, speed of the native backend).

A stream that Python waits on (``Endpoint.watch_acked``, called by ``wait_writable``) wakes
Python only once its buffered bytes fell to the threshold waited for, not for every ACK frame
(docs/transport.md, "native", "Backpressure"); the other streams keep one wake-up per drain of
``acked`` events. Real QUIC between two native endpoints on loopback.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvsp_moq.transport import native
from system_programs import under_ci
from test_native_quic import MiB, Certs, Driver, certs, pair  # noqa: F401 (certs: the fixture)

pytestmark = pytest.mark.skipif(not native.available() and not under_ci(),
                                reason=native.unavailable_reason() or "")


class BatchDriver(Driver):
    """A Driver that also keeps each drain's events apart: one batch per wake-up."""

    def __init__(self, ep: Any) -> None:
        self.batches: list[list[tuple[Any, ...]]] = []
        super().__init__(ep)

    def drain(self) -> None:
        batch = self.ep.events()
        if batch:
            self.batches.append(batch)
        self.log.extend(batch)
        if batch:
            self.changed.set()


async def test_a_watched_stream_wakes_python_once_its_threshold_is_reached(certs: Certs) -> None:
    # Small windows: the 4 MiB take many acknowledgement rounds.
    srv, plain, sc, cc = await pair(certs, server_kw=dict(initial_max_stream_data=256 * 1024,
                                                          initial_max_data=512 * 1024))
    plain.pause()
    cli = BatchDriver(plain.ep)
    try:
        total, threshold = 4 * MiB, 1 * MiB
        sid = cli.ep.open_stream(cc, True)
        assert cli.ep.watch_acked(cc, sid, threshold) == 0  # armed before anything is queued
        cli.ep.send(cc, sid, os.urandom(total), True)
        assert len(await srv.stream_bytes(sc, sid)) == total
        # Python is woken for the stream's acknowledgements once 1 MiB or less is buffered:
        # a drain that found more came for another event.
        await cli.until(lambda e: e[0] == "acked" and e[2] == sid and e[3] <= threshold)
        for batch in cli.batches:
            acked = [e for e in batch if e[0] == "acked" and e[2] == sid]
            if acked and acked[0][3] > threshold:
                assert any(e[0] != "acked" for e in batch), batch
        # Armed again for 0 (what drain() waits for): the last acknowledgement wakes it.
        if cli.ep.watch_acked(cc, sid, 0) > 0:
            await cli.until(lambda e: e[0] == "acked" and e[2] == sid and e[3] == 0)
        assert cli.ep.buffered(cc, sid) == 0
    finally:
        cli.close()
        srv.close()


async def test_watch_acked_on_a_stream_that_is_gone_reports_nothing_buffered(
        certs: Certs) -> None:
    srv, cli, sc, cc = await pair(certs)
    try:
        sid = cli.ep.open_stream(cc, True)
        cli.ep.send(cc, sid, b"x" * 1000, True)
        assert await srv.stream_bytes(sc, sid) == b"x" * 1000
        await cli.until(lambda e: e[0] == "acked" and e[2] == sid and e[3] == 0)
        # Finished and acknowledged (closed, or about to): nothing to wait for.
        assert cli.ep.watch_acked(cc, sid, 0) == 0
        assert cli.ep.watch_acked(cc, sid + 400, 0) == 0  # never opened
    finally:
        cli.close()
        srv.close()
