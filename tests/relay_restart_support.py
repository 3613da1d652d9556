"""``python -m relay`` as a real process for the restart tests (tests/test_relay_reconnect*.py):
started on port 0, then killed (SIGKILL) or stopped (SIGTERM) and restarted on the SAME port,
so clients' URLs stay valid. Every wait is bounded."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GUARD = 20.0


async def within(aw: Any, timeout: float = GUARD) -> Any:
    return await asyncio.wait_for(aw, timeout)


class RelayProcess:
    """``python -m relay`` on 127.0.0.1: started, killed, restarted on the same port."""

    def __init__(self, log: Path, *args: str) -> None:
        self.args = args
        self.log = log
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self._copier: asyncio.Task[None] | None = None
        self._lines: asyncio.Queue[str] = asyncio.Queue()

    @property
    def url(self) -> str:
        return f"moqt://127.0.0.1:{self.port}/moq"

    async def start(self) -> RelayProcess:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "relay", "--listen", f"127.0.0.1:{self.port}",
            "--log-level", "INFO", *self.args, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        self._lines = asyncio.Queue()
        self._copier = asyncio.ensure_future(self._copy_log(self.proc))
        assert self.proc.stdout is not None
        line = (await within(self.proc.stdout.readline())).decode()
        assert line.startswith("relay listening on moqt://127.0.0.1:"), (line, self.log.read_text())
        self.port = int(line.rsplit(":", 1)[1].split("/")[0])
        return self

    async def _copy_log(self, proc: asyncio.subprocess.Process) -> None:
        """stderr into the log file, each line also to :meth:`wait_log` (never blocks the
        relay on a full pipe)."""
        assert proc.stderr is not None
        with self.log.open("ab") as out:
            while line := await proc.stderr.readline():
                out.write(line)
                out.flush()
                self._lines.put_nowait(line.decode(errors="replace"))

    async def wait_log(self, text: str, timeout: float = GUARD) -> str:
        """The next stderr line containing ``text`` (bounded)."""
        while True:
            line = await within(self._lines.get(), timeout)
            if text in line:
                return line

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        assert self.proc is not None
        return await within(self.proc.wait())

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._copier is not None:
            await within(self._copier)
