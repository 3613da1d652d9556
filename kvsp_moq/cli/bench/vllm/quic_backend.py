"""The QUIC backend of every process of ``kvsp bench vllm`` that speaks QUIC (``--backend``).

Those processes are the relay (a child of the plane, ``cli.demo.cluster``, started with this
process's environment), the engines' ``KVSPConnector`` (each ``EngineProcess`` starts with this
process's environment and its spec's ``env``; vLLM's engine core inherits it) and the direct
row's holder process (``--backend`` on its command line) and loader (in this process). None of
them takes a backend setting of its own: each builds a ``TransportConfig`` whose default backend
is ``$KVSP_QUIC_BACKEND`` (docs/transport.md). So the bench:

- refuses a backend this build cannot run before anything starts (:func:`check_backend`: a
  :class:`UsageError` with the transport's own reason, as ``kvsp bench kv`` refuses one);
- sets ``$KVSP_QUIC_BACKEND`` for the run (:func:`quic_backend_env`, restored afterwards) and
  names it in every engine's spec too (:func:`on_backend`), so that the relay and the engines
  start with it;
- reads it back from each started process's environment (:func:`check_processes`, Linux's
  ``/proc/PID/environ``) and refuses the run where one did not get it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from ....integrations.vllm.engine_process import EngineSpec
from ....transport.config import BACKEND_ENV
from ..backend import check_backend, default_backend

__all__ = ["check_backend", "check_processes", "default_backend", "on_backend", "process_backend",
           "quic_backend_env"]


@contextlib.contextmanager
def quic_backend_env(name: str) -> Iterator[None]:
    """``$KVSP_QUIC_BACKEND`` = ``name`` while the block runs (every process started in it
    inherits it), then as it was."""
    before = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before


def on_backend(spec: EngineSpec, name: str) -> EngineSpec:
    """``spec`` with ``$KVSP_QUIC_BACKEND`` = ``name`` in its environment: its connector's
    MOQT sessions (to the relay, as a client and as the holder it attaches) run on ``name``."""
    return dataclasses.replace(spec, env={**spec.env, BACKEND_ENV: name})


def process_backend(pid: int) -> str | None:
    """``$KVSP_QUIC_BACKEND`` in the environment process ``pid`` started with (None: unset;
    OSError where it cannot be read)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key.decode(errors="replace") == BACKEND_ENV:
            return value.decode(errors="replace")
    return None


def check_processes(name: str, pids: Mapping[str, int]) -> dict[str, str | None]:
    """What each process of ``pids`` (role -> pid) started with; RuntimeError naming those
    that did not start with backend ``name``."""
    seen = {role: process_backend(pid) for role, pid in pids.items()}
    wrong = {role: got for role, got in seen.items() if got != name}
    if wrong:
        raise RuntimeError(f"processes not started on QUIC backend {name!r} (${BACKEND_ENV}): {wrong}")
    return seen
