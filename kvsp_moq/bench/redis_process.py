"""A throwaway ``redis-server`` for a benchmark (``kvsp bench index --store redis`` without
``--redis-url``): a free loopback port, a temporary folder, no persistence, stopped at exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

__all__ = ["RedisProcess"]

START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """``with RedisProcess() as url:`` a running server's ``redis://`` URL."""

    def __init__(self, executable: str | None = None) -> None:
        found = executable or shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            raise RuntimeError("no redis-server (or valkey-server) on PATH: install one, or pass --redis-url")
        self.executable = found
        self.port = _free_port()
        self._folder = tempfile.TemporaryDirectory(prefix="kvsp-bench-redis-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> str:
        self._process = subprocess.Popen(
            [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._folder.name,
             "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The server is another process: poll its port, bounded, until it answers PING.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self.url
            except OSError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"{self.executable} did not start on port {self.port}")
            time.sleep(0.02)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._folder.cleanup()
