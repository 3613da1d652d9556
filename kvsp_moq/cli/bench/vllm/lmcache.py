"""LMCache's row in ``kvsp bench vllm``, where ``lmcache`` is installed (docs/vllm.md "Benchmark").

LMCache is not a dependency of this project: its wheel pulls CUDA packages and pins numpy and
protobuf below what the project uses, so it is installed by hand, without its dependencies, and
only what its multi-process server and vLLM's ``LMCacheMPConnector`` import is added
(:data:`INSTALL`). Where ``lmcache`` cannot be found the bench says so and goes on without it.

:class:`LmcacheServer` is LMCache's multi-process cache server, ``python -m
lmcache.v1.multiprocess.http_server`` (its ZMQ request server and its HTTP front end on free
loopback ports, ``--supported-transfer-mode auto``, a local-memory L1 of 1 GB with LRU eviction,
``--chunk-size`` :func:`chunk_tokens`), started by the bench in a process group of its own with
its log in a directory of its own; every wait on it is bounded (its start, its stop: SIGTERM,
then SIGKILL to its group). Engine D runs vLLM's ``LMCacheMPConnector`` against it with vLLM's
own prefix cache off (LMCache keys its chunks on the request's ``cache_salt``, so a repeat under
another salt would miss; without vLLM's cache the same prompt twice is LMCache's own hit): the
round's first request computes the prompt and stores its KV, the second loads it. The server
logs ``Retrieved N tokens`` for each load; a round's load counts only if exactly one such line
with the N prefix tokens came with it, and its first token is the recomputed one
(:func:`check_lmcache`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ....integrations.vllm.engine_process import EngineSpec

__all__ = ["INSTALL", "LmcacheServer", "check_lmcache", "chunk_tokens", "lmcache_missing"]

#: The optional install (docs/vllm.md "Benchmark"): never with lmcache's dependencies.
INSTALL = ".venv/bin/pip install --no-deps lmcache==0.5.6 aiofile aiofiles redis sortedcontainers nvtx"
#: Its chunk size where the prefix allows (LMCache's default), else vLLM's block.
DEFAULT_CHUNK = 256
#: Bounds (s): the server's start (it imports torch: tens of seconds on a busy machine), its
#: stop, and how long a load's ``Retrieved`` line may lag the request's answer.
START_S = 300.0
STOP_S = 30.0
RETRIEVED_S = 30.0
#: LMCache without its usage telemetry and banner, in the server and in engine D.
ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
#: LMCache's multi-process server with its HTTP front end.
SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens")
_READY = "LMCache cache server is running"


def lmcache_missing() -> str | None:
    """Why LMCache's row cannot be measured here (None: ``lmcache`` is importable)."""
    if importlib.util.find_spec("lmcache") is None:
        return f"lmcache not installed (optional: {INSTALL})"
    return None


def chunk_tokens(prefix_tokens: int, block_tokens: int) -> int:
    """LMCache's chunk size for an N-token prefix: its default (256) where N is a multiple of
    it, else vLLM's block, so that LMCache stores and loads exactly the N prefix tokens."""
    return DEFAULT_CHUNK if prefix_tokens % DEFAULT_CHUNK == 0 else block_tokens


def check_lmcache(prefix_tokens: int, answers: dict[str, dict[str, Any]], retrieved: list[int],
                  first_token: list[int]) -> None:
    """A round's LMCache requests (``lmcache_store``, ``lmcache``) count only if the server
    retrieved the N prefix tokens once (``retrieved``: the ``Retrieved`` lines since the round's
    first request) and both first tokens are ``first_token``; RuntimeError says what did not."""
    if retrieved != [prefix_tokens]:
        raise RuntimeError(f"the LMCache server retrieved {retrieved} tokens for the round's load, "
                           f"not [{prefix_tokens}]")
    for way, answer in answers.items():
        if answer["token_ids"][:1] != first_token:
            raise RuntimeError(f"{way}: first token {answer['token_ids'][:1]}, recomputed {first_token}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LmcacheServer:
    """LMCache's multi-process server for one bench run (module notes)."""

    def __init__(self, chunk: int, progress: Callable[[str], None], *, module: str = SERVER_MODULE) -> None:
        self.chunk = chunk
        self.module = module
        self.progress = progress
        self.port = _free_port()
        self.http_port = _free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvsp-bench-lmcache-"))
        self.log_path = self.workdir / "lmcache-server.log"
        self._log: IO[str] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_S) -> None:
        """Start it and wait (bounded) until its request server runs; RuntimeError with its
        log's tail if it exits or is late."""
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, "--host", "127.0.0.1",
             "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
             "--supported-transfer-mode", "auto", "--chunk-size", str(self.chunk), "--l1-size-gb", "1",
             "--eviction-policy", "LRU", "--disable-observability"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **ENV})
        self.progress(f"{'lmcache':<14} starting its multi-process server (pid {self.process.pid}, port "
                      f"{self.port}, chunk {self.chunk}; log in {self.log_path})")
        started = time.monotonic()
        while _READY not in self._text():
            if self.process.poll() is not None:
                raise RuntimeError(f"its server exited ({self.process.returncode}):\n{self.tail()}")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"its server did not start in {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.2)  # another process's log: polled, bounded above
        self.progress(f"{'lmcache':<14} server ready after {time.monotonic() - started:.0f} s")

    def spec(self, model_dir: str, *, max_model_len: int, dtype: str, block_tokens: int) -> EngineSpec:
        """Engine D: vLLM's ``LMCacheMPConnector`` against this server, vLLM's prefix cache off."""
        config = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}}
        return EngineSpec(model_dir, block_size=block_tokens, max_model_len=max_model_len, dtype=dtype,
                          enable_prefix_caching=False, kv_transfer_config=config, env=dict(ENV))

    def retrieved(self) -> list[int]:
        """The token counts of the server's ``Retrieved N tokens`` lines so far."""
        return [int(m) for m in _RETRIEVED.findall(self._text())]

    def wait_retrieved(self, count: int, timeout: float = RETRIEVED_S) -> list[int]:
        """:meth:`retrieved` once it has at least ``count`` lines, or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while len(got := self.retrieved()) < count and time.monotonic() < deadline:
            time.sleep(0.05)  # another process's log: polled, bounded above
        return got

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self._text().splitlines()[-lines:])

    def _text(self) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop it (SIGTERM, then SIGKILL to its group after :data:`STOP_S`), remove its directory."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.progress(f"{'lmcache':<14} server still running {STOP_S:.0f} s after SIGTERM: killed")
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what it started, and itself if it hung
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.progress(f"{'lmcache':<14} server (pid {proc.pid}) did not exit after SIGKILL")
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.workdir, ignore_errors=True)
