"""LMCache's row in ``kvsp bench vllm``, where ``lmcache`` is installed (docs/vllm.md "Benchmark").

LMCache is not a dependency of this project: its wheel pulls CUDA packages and pins numpy and
protobuf below what the project uses, so it is installed by hand, without its dependencies, and
only what its multi-process server and vLLM's ``LMCacheMPConnector`` import is added
(:data:`INSTALL`). Where ``lmcache`` cannot be found, or Debian's ``redis-server`` (its L2,
below), the bench says so and goes on without the row.

**What the row measures**: engine D's time to first token when LMCache loads the N-token prefix
from a **Redis** server, as KVSP's engine B loads it from a remote holder: LMCache's L1 (local
memory) is skipped, so the load is the lookup in Redis, the chunks' GETs from it into the
server's memory and their copy into vLLM's paged cache.

:class:`RedisBackend` is that Redis: the bench's own ``redis-server`` (found on ``PATH``:
Debian's ``/usr/bin/redis-server``) on a free loopback port, without persistence (``--save ""
--appendonly no``), in a directory of its own, in a process group of its own (a terminal's
Ctrl-C reaches the bench only, which stops it last), its start bounded (until it answers PING)
and its stop bounded (SIGTERM, then SIGKILL to its group).

:class:`LmcacheServer` is LMCache's multi-process cache server, ``python -m
lmcache.v1.multiprocess.http_server`` (its ZMQ request server and its HTTP front end on free
loopback ports, ``--supported-transfer-mode auto``, ``--chunk-size`` :func:`chunk_tokens`), with
its L2 the Redis above (``--l2-adapter '{"type": "resp", ...}'``: LMCache's native RESP client)
and **L1 skipped**: ``--l2-store-policy skip_l1`` deletes each chunk from the local-memory L1
(1 GB, LRU) once Redis has it, and ``--l2-prefetch-policy default`` keeps nothing it loaded from
Redis in L1 after handing it to vLLM. It starts its Redis, then itself, in a process group of
its own with both logs in a directory of its own; every wait on them is bounded (their starts,
their stops). Engine D runs vLLM's ``LMCacheMPConnector`` against it with vLLM's own prefix
cache off (LMCache keys its chunks on the request's ``cache_salt``, so a repeat under another
salt would miss; without vLLM's cache the same prompt twice is LMCache's own hit): the round's
first request computes the prompt and stores its KV (into L1, and from there to Redis in the
background), the bench waits (bounded, :meth:`LmcacheServer.wait_in_redis`, as it waits for
engine A's publications) until the server's store queue is empty and its L1 holds no object,
and the second request loads it, from Redis then. The server logs ``Retrieved N tokens`` for
each load; a round's load counts only if exactly one such line with the N prefix tokens came
with it, its first token is the recomputed one (:func:`check_lmcache`), and Redis served it
(:func:`check_redis_load`: the store added keys to Redis, L1 held nothing when the load was
asked, and Redis answered at least one GET per stored key during the load, its ``INFO
commandstats``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import redis

from ....integrations.vllm.engine_process import EngineSpec

__all__ = ["BACKEND", "INSTALL", "LmcacheServer", "RedisBackend", "check_lmcache", "check_redis_load",
           "chunk_tokens", "lmcache_missing", "redis_missing"]

#: The optional install (docs/vllm.md "Benchmark"): never with lmcache's dependencies.
INSTALL = ".venv/bin/pip install --no-deps lmcache==0.5.6 aiofile aiofiles redis sortedcontainers nvtx"
#: Its chunk size where the prefix allows (LMCache's default), else vLLM's block.
DEFAULT_CHUNK = 256
#: Bounds (s): the server's start (it imports torch: tens of seconds on a busy machine), its
#: stop, how long a load's ``Retrieved`` line may lag the request's answer, Redis's start, and
#: how long a store may take to reach Redis and leave L1.
START_S = 300.0
STOP_S = 30.0
RETRIEVED_S = 30.0
REDIS_START_S = 15.0
IN_REDIS_S = 30.0
#: LMCache without its usage telemetry and banner, in the server and in engine D.
ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
#: LMCache's multi-process server with its HTTP front end.
SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
#: The Redis server the bench starts (on PATH: Debian's /usr/bin/redis-server).
REDIS_SERVER = "redis-server"
#: What LMCache's row loads from, in the figures' params (module notes).
BACKEND = "Redis L2 (resp adapter), L1 skipped"
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens")
_READY = "LMCache cache server is running"


def lmcache_missing() -> str | None:
    """Why LMCache's row cannot be measured here (None: ``lmcache`` is importable)."""
    if importlib.util.find_spec("lmcache") is None:
        return f"lmcache not installed (optional: {INSTALL})"
    return None


def redis_missing() -> str | None:
    """Why LMCache's Redis L2 cannot be started here (None: ``redis-server`` is on PATH)."""
    if shutil.which(REDIS_SERVER) is None:
        return ("lmcache: redis-server not installed (LMCache's row loads from a Redis of its own: "
                "apt-get install redis-server)")
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


def check_redis_load(stored_keys: int, l1_objects: int, redis_gets: int) -> None:
    """A round's LMCache load counts only if Redis served it: the store added ``stored_keys``
    (> 0) keys to Redis, LMCache's L1 held ``l1_objects`` (0) when the load was asked, and Redis
    answered ``redis_gets`` (at least one per stored key) GETs during the load; RuntimeError
    says what did not."""
    if stored_keys <= 0:
        raise RuntimeError(f"the LMCache store added {stored_keys} keys to Redis")
    if l1_objects:
        raise RuntimeError(f"LMCache's L1 held {l1_objects} objects when the load was asked: not a load from Redis")
    if redis_gets < stored_keys:
        raise RuntimeError(f"Redis answered {redis_gets} GETs during the load, fewer than the {stored_keys} "
                           "keys stored: not a load from Redis")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_group(proc: subprocess.Popen[bytes] | None, name: str, progress: Callable[[str], None]) -> None:
    """SIGTERM, then SIGKILL to its process group after :data:`STOP_S`; every wait bounded."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            progress(f"{'lmcache':<14} {name} still running {STOP_S:.0f} s after SIGTERM: killed")
    if proc is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what it started, and itself if it hung
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            progress(f"{'lmcache':<14} {name} (pid {proc.pid}) did not exit after SIGKILL")


def _read(log: IO[str] | None, path: Path) -> str:
    if log is not None:
        log.flush()
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class RedisBackend:
    """LMCache's L2 for one bench run: a ``redis-server`` of the bench's own (module notes)."""

    def __init__(self, workdir: Path, progress: Callable[[str], None]) -> None:
        self.progress = progress
        self.port = _free_port()
        self.dir = workdir / "redis"
        self.log_path = workdir / "redis-server.log"
        self._log: IO[str] | None = None
        self._client: redis.Redis | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = REDIS_START_S) -> None:
        """Start it and wait (bounded) until it answers PING; RuntimeError (with its log's tail)
        if it is not installed, exits or is late."""
        executable = shutil.which(REDIS_SERVER)
        if executable is None:
            raise RuntimeError(redis_missing())
        self.dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        started = time.monotonic()
        while True:
            with contextlib.suppress(redis.RedisError):
                if self.client().ping():
                    break
            if self.process.poll() is not None:
                raise RuntimeError(f"its redis-server exited ({self.process.returncode}):\n{self.tail()}")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"its redis-server did not answer PING in {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.05)  # another process: polled, bounded above
        self.progress(f"{'lmcache':<14} its Redis L2: {executable} (pid {self.process.pid}, port {self.port}, "
                      "no persistence)")

    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5.0,
                                       socket_connect_timeout=2.0)
        return self._client

    def counters(self) -> dict[str, int]:
        """Its key count (``DBSIZE``) and the GETs it answered so far (``INFO commandstats``);
        RuntimeError if it does not answer."""
        try:
            c = self.client()
            stats: dict[str, Any] = c.info("commandstats")
            return {"keys": int(c.dbsize()), "gets": int(stats.get("cmdstat_get", {}).get("calls", 0))}
        except redis.RedisError as exc:
            raise RuntimeError(f"its redis-server (port {self.port}) did not answer: {exc}") from None

    def tail(self, lines: int = 10) -> str:
        return "\n".join(_read(self._log, self.log_path).splitlines()[-lines:])

    def close(self) -> None:
        """Stop it (SIGTERM, then SIGKILL to its group after :data:`STOP_S`)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        _stop_group(self.process, "its redis-server", self.progress)
        if self._log is not None:
            self._log.close()
            self._log = None


class LmcacheServer:
    """LMCache's multi-process server for one bench run, with its Redis L2 (module notes)."""

    def __init__(self, chunk: int, progress: Callable[[str], None], *, module: str = SERVER_MODULE) -> None:
        self.chunk = chunk
        self.module = module
        self.progress = progress
        self.port = _free_port()
        self.http_port = _free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvsp-bench-lmcache-"))
        self.log_path = self.workdir / "lmcache-server.log"
        self.redis = RedisBackend(self.workdir, progress)
        self._log: IO[str] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_S) -> None:
        """Start its Redis, then it, and wait (bounded) until its request server runs;
        RuntimeError with the log's tail if either exits or is late."""
        self.redis.start()
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        l2 = json.dumps({"type": "resp", "host": "127.0.0.1", "port": self.redis.port})
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, "--host", "127.0.0.1",
             "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
             "--supported-transfer-mode", "auto", "--chunk-size", str(self.chunk), "--l1-size-gb", "1",
             "--eviction-policy", "LRU", "--l2-adapter", l2, "--l2-store-policy", "skip_l1",
             "--l2-prefetch-policy", "default", "--disable-observability"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **ENV})
        self.progress(f"{'lmcache':<14} starting its multi-process server (pid {self.process.pid}, port "
                      f"{self.port}, chunk {self.chunk}, {BACKEND}; log in {self.log_path})")
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

    def status(self) -> dict[str, Any]:
        """Its HTTP front end's ``/status`` (its L1, its store controller...); RuntimeError if
        it does not answer with JSON."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=5.0) as answer:
                status: dict[str, Any] = json.load(answer)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"its server's /status did not answer: {exc}") from None
        return status

    def wait_in_redis(self, timeout: float = IN_REDIS_S) -> int:
        """Wait (bounded) until its store queue is empty and its L1 holds no object: what was
        stored is in Redis only. The L1's object count then (0); RuntimeError if late."""
        deadline = time.monotonic() + timeout
        while True:
            storage = self.status()["storage_manager"]
            queue, l1 = storage["store_controller"], storage["l1_manager"]
            queued = int(queue["pending_keys_count"]) + int(queue["in_flight_task_count"])
            objects = int(l1["total_object_count"])
            if not queued and not objects:
                return objects
            if time.monotonic() > deadline:
                raise RuntimeError(f"after {timeout:.0f} s its store queue has {queued} keys, its L1 {objects} "
                                   "objects: the store did not reach Redis")
            time.sleep(0.02)  # another process: polled, bounded above

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
        return _read(self._log, self.log_path)

    def close(self) -> None:
        """Stop it, then its Redis (each: SIGTERM, then SIGKILL to its group after
        :data:`STOP_S`), remove its directory."""
        try:
            _stop_group(self.process, "server", self.progress)
            if self._log is not None:
                self._log.close()
                self._log = None
        finally:
            try:
                self.redis.close()
            finally:
                shutil.rmtree(self.workdir, ignore_errors=True)
