"""A real ``redis-server`` for the tests (Debian's package, listed in .ci/system-packages.txt;
``bash .ci/system-packages.sh``, which the README's test command runs, installs it).

:class:`RedisServer` runs one server process on a free loopback port in its own folder, with
or without the append-only file, and can be killed (SIGKILL), stopped (SIGSTOP, a hung store)
and restarted on the same port and data. Use the ``redis_server`` fixture (one per test), or
``RedisServer`` directly where a test needs its own settings.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from system_programs import require

REDIS_SERVER = "/usr/bin/redis-server"  # the path in .ci/system-packages.txt
START_TIMEOUT_S = 10.0
#: How far past a store timeout a 503 may come on the busy 2-core CI machine: a bound that tells
#: "answered after the timeout" from a hang, not a measure of speed.
SLACK_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` on 127.0.0.1. ``url`` is its ``redis://`` URL (database 0)."""

    def __init__(self, folder: Path, *, appendonly: bool = False, password: str | None = None) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.appendonly = appendonly
        self.password = password
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--save", "", "--protected-mode", "no", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no"]
        if self.appendonly:
            args += ["--appendfsync", "always"]  # nothing acknowledged is lost to a SIGKILL
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args

    def start(self) -> None:
        """Start the server and wait, bounded, for its systemd-style ``READY=1`` notice (sent
        once it accepts connections, after replaying its AOF)."""
        # The listed modules' tests are skipped at collection when it is missing (conftest.py);
        # this catches a use elsewhere, with the same reason.
        require(REDIS_SERVER)
        notify_path = self.folder / "notify.sock"
        notify_path.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(str(notify_path))
            notify.settimeout(START_TIMEOUT_S)
            with open(self.folder / "redis.log", "ab") as log:
                self.process = subprocess.Popen(
                    self._args() + ["--supervised", "systemd"], stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "NOTIFY_SOCKET": str(notify_path)})
            try:
                while b"READY=1" not in notify.recv(4096):
                    pass
            except TimeoutError:
                self.kill()
                raise RuntimeError(f"redis-server not ready within {START_TIMEOUT_S} s: "
                                   f"{(self.folder / 'redis.log').read_text()[-2000:]}") from None

    def kill(self) -> None:
        """SIGKILL: what a crash looks like. Data not in the AOF is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket but answers nothing (a hung store)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kill and start again on the same port and folder (the AOF, if on, is replayed)."""
        self.kill()
        self.start()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_aof(tmp_path: Path) -> Iterator[RedisServer]:
    """A server with the append-only file on (fsync always): survives SIGKILL with its data."""
    server = RedisServer(tmp_path / "redis-aof", appendonly=True)
    server.start()
    try:
        yield server
    finally:
        server.close()
