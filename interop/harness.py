"""Process plumbing for interop cases: peers run as subprocesses in their own process group,
their output is read line by line (readiness is a line they print, never a sleep), and every
process group is killed when a case ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPTS = Path(__file__).resolve().parent / "peer_scripts"



def _load_payload_module() -> Any:
    """peer_scripts/payload.py, which the peer venvs import by path (it is stdlib only)."""
    spec = importlib.util.spec_from_file_location("interop_peer_payload",
                                                  PEER_SCRIPTS / "payload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_payload = _load_payload_module()
payload: Callable[[int, int, int], bytes] = _payload.payload
aiomoqt_counted: Callable[[int, int, int], bytes] = _payload.aiomoqt_counted
sha256: Callable[[bytes | bytearray | memoryview], str] = _payload.sha256

__all__ = [
    "PEER_SCRIPTS",
    "ROOT",
    "CaseError",
    "PeerProcess",
    "aiomoqt_counted",
    "kill_group",
    "log",
    "only_loopback",
    "payload",
    "sha256",
]


class CaseError(RuntimeError):
    """A case could not complete (peer died, timed out, refused to run)."""


def log(msg: str) -> None:
    print(f"[{time.monotonic():.3f}] {msg}", file=sys.stderr, flush=True)


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the process group led by ``pid`` (started with ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def only_loopback() -> bool:
    """Whether this process's network namespace has no interface but ``lo`` (checked over
    the kernel's interface index, which follows the current namespace)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return False
    return names == ["lo"]


class PeerProcess:
    """A peer subprocess. Lines of stdout (and stderr, merged) are kept in a bounded log and
    handed to :meth:`expect`; JSON lines are parsed."""

    def __init__(self, name: str, argv: Sequence[object], *, cwd: str | Path | None = None,
                 env: dict[str, str] | None = None, stdin: bool = False,
                 keep_lines: int = 400) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.cwd = cwd
        self.env = env
        self.want_stdin = stdin
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self._new_line = asyncio.Event()
        self._seen: list[str] = []  # lines not yet consumed by expect()
        self._reader: asyncio.Task[None] | None = None
        self.eof = False

    async def start(self) -> PeerProcess:
        log(f"{self.name}: {' '.join(self.argv)}")
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, cwd=self.cwd, env=env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE if self.want_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            limit=1 << 20)
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            async for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines.append(line)
                self._seen.append(line)
                self._new_line.set()
        finally:
            self.eof = True
            self._new_line.set()

    async def expect(self, match: Callable[[str], Any], timeout: float, what: str) -> Any:
        """Consume lines until ``match(line)`` returns something truthy; return it. Raises
        :class:`CaseError` when the peer's output ends or ``timeout`` passes first."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            while self._seen:
                line = self._seen.pop(0)
                found = match(line)
                if found:
                    return found
            if self.eof:
                raise CaseError(f"{self.name} ended (rc={self.returncode}) before {what}")
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise CaseError(f"{self.name}: no {what} within {timeout:.0f} s")
            self._new_line.clear()
            try:
                await asyncio.wait_for(self._new_line.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def expect_event(self, events: str | Sequence[str], timeout: float,
                           what: str | None = None) -> dict[str, Any]:
        """The next JSON line whose ``event`` is one of ``events`` (``error`` always matches
        and raises)."""
        names = {events} if isinstance(events, str) else set(events)

        def match(line: str) -> dict[str, Any] | None:
            ev = parse_json(line)
            if ev is None:
                return None
            if ev.get("event") == "error" and "error" not in names:
                raise CaseError(f"{self.name} reported an error: {ev.get('error')}")
            return ev if ev.get("event") in names else None

        return await self.expect(match, timeout, what or "/".join(sorted(names)))

    async def collect_events(self, until: str, timeout: float) -> list[dict[str, Any]]:
        """Every JSON event up to and including ``until`` (or ``error``)."""
        out: list[dict[str, Any]] = []

        def match(line: str) -> bool:
            ev = parse_json(line)
            if ev is None:
                return False
            out.append(ev)
            return ev.get("event") in (until, "error")

        await self.expect(match, timeout, f"event {until!r}")
        return out

    async def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    def close_stdin(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proc.wait(), timeout)
        return self.proc.returncode

    async def stop(self, grace: float = 2.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace``, then drain the reader."""
        if self.proc is None:
            return
        self.close_stdin()
        if self.proc.returncode is None:
            kill_group(self.proc.pid, signal.SIGTERM)
            if await self.wait(grace) is None:
                kill_group(self.proc.pid, signal.SIGKILL)
                await self.wait(5.0)
        kill_group(self.proc.pid, signal.SIGKILL)  # stragglers in the group
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 5.0)

    def tail(self, n: int = 60) -> list[str]:
        return list(self.lines)[-n:]


def parse_json(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
