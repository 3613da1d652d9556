"""vLLM engines on the demo's loopback KV plane (``kvsp demo --engine vllm``, ``kvsp bench vllm``).

:class:`VllmPlane` starts the roles every demo has (:func:`.cluster.start_kv_plane`: an Index
Service, the MOQT relay as a child process with a certificate of a CA made for the run, an
HTTP holder) on an asyncio loop of their own thread (``integrations.vllm.loop.ClientLoop``),
and vLLM engines, each in its own process
(``integrations.vllm.engine_process.EngineProcess``), whose ``KVSPConnector`` talks to them:
the IS URL, the relay's ``moqt://`` URL (verified against the run's CA), the holder, a
bearer token per engine, one scope ``demo`` with a Scope Key drawn for the run (kvsp-draft
§4.2). The calling thread drives the engines synchronously; every wait is bounded.

The model is the connector's tiny random-weight Llama (``integrations.vllm.tiny_model``),
written into the run's directory, unless a local Hugging Face model directory is given.
vLLM's logs go to one file per engine in that directory (their tails are shown when an engine
fails). :meth:`VllmPlane.close` stops the engines in parallel (stdin closed, then killed after
a grace period, with what they started; the shared memory a killed engine left is unlinked and
said, and each engine's own temporary directory removed: ``EngineProcess.close``), the holder,
the relay and the IS, and removes the run's directory (its relay key and CA with it); it runs
on every exit, an error, Ctrl-C and SIGTERM (:func:`interrupts_as_keyboard_interrupt`) included.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from ...integrations.vllm.engine_process import EngineProcess, EngineSpec
from ...integrations.vllm.loop import ClientLoop
from ...integrations.vllm.settings import connector_extra_config, kv_transfer_config, salt_digest
from ...integrations.vllm.tiny_model import TinyLlama, write_tiny_llama
from ..errors import UsageError
from .cluster import DATAGRAM_SIZE, KvPlane, demo_authorizer, start_kv_plane

__all__ = ["BLOCK_TOKENS", "DTYPE_BYTES", "SCOPE", "VllmPlane", "interrupts_as_keyboard_interrupt", "kv_bytes_per_token_layer",
           "kvsp_stats", "require_vllm"]

#: vLLM's block size = the descriptor's B: the CPU attention backend needs a multiple of 32.
BLOCK_TOKENS = 32
SCOPE = "demo"
#: Bounds (s): an engine's start (tens of seconds alone, minutes on a loaded 2-core machine),
#: one request, the plane's start and stop, an engine's exit after its stdin closed.
ENGINE_START_S = 900.0
REQUEST_S = 300.0
PLANE_S = 120.0
ENGINE_STOP_S = 30.0


def require_vllm() -> None:
    """A usage error (exit 2) where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed here: pip install -e '.[vllm]' (docs/vllm.md "
                         "\"Install\": torch 2.13.0 first, then remove torchvision, torchaudio, torchcodec)")


def kvsp_stats(answer: Mapping[str, Any]) -> dict[str, Any]:
    """What the connector reported for one request (``kv_transfer_params["kvsp"]``; {} if off)."""
    params = answer.get("kv_transfer_params") or {}
    stats: dict[str, Any] = dict(params.get("kvsp") or {})
    return stats


@contextlib.contextmanager
def interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does, so the same
    cleanup runs for both."""
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: How often (s) the demo and the bench say which engines are still starting.
STILL_STARTING_S = 20.0


def model_vocab(model_dir: Path) -> int:
    """``vocab_size`` of a Hugging Face model directory's ``config.json``."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        return int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{model_dir}: not a Hugging Face model directory ({exc})") from None


#: Octets of one KV element of the engines' dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token_layer(model_dir: Path, dtype: str) -> tuple[int, int]:
    """The model's layers and its KV octets per token per layer (K and V) in ``dtype``, from
    its ``config.json``."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{model_dir}: no KV geometry in its config.json ({exc})") from None
    return layers, 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]



class VllmPlane:
    """The KV plane and the engines of a vLLM demo or bench (module notes)."""

    def __init__(self, progress: Callable[[str], None], *, prefix: str = "kvsp-demo-vllm-") -> None:
        self.progress = progress
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))
        self.tokens = {role: secrets.token_urlsafe(32) for role in ("holder", "engine-a", "engine-b", "engine-c", "engine-d")}
        self.scope_key = os.urandom(32)
        #: A secret cache_salt that selects the scope (``scope_salts``): a request under it misses
        #: the engine's own prefix cache (vLLM keys it on the salt) but not the KVSP scope.
        self.scope_salt = secrets.token_urlsafe(16)
        self.engines: list[EngineProcess] = []
        self._logs: dict[str, tuple[Path, IO[str]]] = {}
        self._stack = AsyncExitStack()
        self._loop: ClientLoop | None = None
        self.plane: KvPlane | None = None

    def __enter__(self) -> VllmPlane:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(interrupted=kind is KeyboardInterrupt)

    # -- the KV plane -------------------------------------------------------------------------------
    def start_plane(self) -> KvPlane:
        self._loop = ClientLoop("kvsp-demo-plane")
        # The relay serves the engines' tokens only (their connectors' MOQT sessions), under every
        # KVSP namespace: an engine's Compatibility ID (model, dtype, rank) is only known inside it.
        engines = {role: token for role, token in self.tokens.items() if role.startswith("engine-")}
        self.plane = self._loop.run(start_kv_plane(
            self._stack, auth=demo_authorizer(self.tokens), holder_token=self.tokens["holder"], workdir=self.workdir,
            descriptors=(), relay_tokens=engines, relay_prefixes=("kvsp-1",), progress=self.progress), PLANE_S)
        return self.plane

    def relay_stats(self) -> dict[str, float]:
        assert self._loop is not None and self.plane is not None
        return self._loop.run(self.plane.relay.stats(), 15)

    def servers(self) -> list[dict[str, Any]]:
        assert self.plane is not None
        p = self.plane
        return [
            {"role": "index", "url": p.index.url, "port": p.index.port, "protocol": "tcp"},
            {"role": "relay", "url": p.relay.url, "port": p.relay.port, "protocol": "udp", "pid": p.relay.process.pid},
            {"role": "holder", "url": p.holder.url, "port": p.holder.port, "protocol": "tcp"},
            *({"role": e.name, "pid": e.process.pid} for e in self.engines),
        ]

    # -- the model and the engines ------------------------------------------------------------------
    def model(self, model_dir: str | None, shape: TinyLlama = TinyLlama()) -> tuple[Path, int]:
        """The model directory and its vocabulary size: ``model_dir`` as given, else the tiny
        Llama of ``shape`` written into the run's directory."""
        if model_dir is not None:
            path = Path(model_dir)
            return path, model_vocab(path)
        with contextlib.suppress(ImportError):  # transformers' "Writing model shards" bar
            importlib.import_module("transformers").utils.logging.disable_progress_bar()
        path = write_tiny_llama(self.workdir / "tiny-llama", shape)
        self.progress(f"model          tiny random-weight Llama ({shape.layers} layers, hidden {shape.hidden}, "
                      f"{shape.kv_heads} KV heads x {shape.head_dim}, vocab {shape.vocab}) written to {path}")
        return path, shape.vocab

    def kvsp_spec(self, model_dir: Path, role: str, *, max_model_len: int = 2048, dtype: str = "float32",
                  block_tokens: int | None = None, kv_role: str = "kv_both",
                  max_num_batched_tokens: int | None = None, cpus: tuple[int, ...] | None = None) -> EngineSpec:
        """An engine with the KVSP connector on this plane, with ``role``'s token, running
        ``dtype`` (vLLM's prefix cache on, its default); ``block_tokens``: the KVSP block size
        (default: vLLM's, :data:`BLOCK_TOKENS`); ``kv_role``: vLLM's (``kv_producer`` /
        ``kv_consumer`` for prefill→decode); ``max_num_batched_tokens``: vLLM's step budget (a
        prompt longer than it is prefilled in chunks, one step each); ``cpus``: the CPUs its
        processes run on (None: all)."""
        more = {"block_tokens": block_tokens} if block_tokens else {}
        assert self.plane is not None
        p, token = self.plane, self.tokens[role]
        extra = connector_extra_config(
            index_url=p.index.url, relay_url=p.relay.url, holder_url=p.holder.url, index_token=token,
            holder_token=token, moqt_token=token, ca_file=str(p.tls.ca_file), scopes={SCOPE: self.scope_key},
            default_scope=SCOPE, scope_salts={SCOPE: [salt_digest(self.scope_salt)]}, deadline_ms=20_000,
            moqt_timeout_ms=5_000, max_datagram_size=DATAGRAM_SIZE, **more)  # loopback, as the demo's relay
        return EngineSpec(str(model_dir), block_size=BLOCK_TOKENS, max_model_len=max_model_len, dtype=dtype,
                          kv_transfer_config=kv_transfer_config(extra, kv_role=kv_role),
                          max_num_batched_tokens=max_num_batched_tokens, cpus=cpus)

    def start_engine(self, name: str, spec: EngineSpec) -> EngineProcess:
        log_path = self.workdir / f"{name.replace(' ', '-')}.log"
        log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        engine = EngineProcess(spec, name=name, stderr=log)
        self._logs[name] = (log_path, log)
        self.engines.append(engine)
        self.progress(f"{name:<14} starting (pid {engine.process.pid}; vLLM logs in {log_path})")
        return engine

    def wait_ready(self, engines: list[EngineProcess]) -> None:
        """Wait for every engine's start, in parallel; the first failure raises (with its log's tail)."""
        started = time.perf_counter()
        errors: list[tuple[EngineProcess, BaseException]] = []

        def ready(engine: EngineProcess) -> None:
            try:
                engine.wait_ready(ENGINE_START_S)
                self.progress(f"{engine.name:<14} ready after {time.perf_counter() - started:.0f} s")
            except BaseException as exc:  # reported below
                errors.append((engine, exc))

        waiters = [threading.Thread(target=ready, args=(e,), daemon=True) for e in engines]
        for t in waiters:
            t.start()
        while any(t.is_alive() for t in waiters):  # a line every STILL_STARTING_S: never silent for minutes
            for t in waiters:
                t.join(STILL_STARTING_S / len(waiters))
            waiting = [e.name for e, t in zip(engines, waiters) if t.is_alive()]
            if waiting:
                self.progress(f"still starting {', '.join(waiting)}, {time.perf_counter() - started:.0f} s "
                              "(vLLM loads the model and compiles)")
        if errors:
            engine, exc = errors[0]
            raise RuntimeError(f"{exc}; the end of its log:\n{self.log_tail(engine.name)}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        path, log = self._logs[name]
        log.flush()
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def generate(self, engine: EngineProcess, prompt: list[int], max_tokens: int, *,
                 kvsp: bool = True, cache_salt: str | None = None) -> dict[str, Any]:
        """One greedy request. Unless ``kvsp``, it is computed from scratch: the connector off,
        and a fresh ``cache_salt`` so that vLLM's own prefix cache misses too."""
        salt = cache_salt if kvsp else f"recompute-{secrets.token_hex(8)}"
        try:
            return engine.generate(prompt, max_tokens=max_tokens, timeout=REQUEST_S,
                                   kv_transfer_params=None if kvsp else {"kvsp": False}, cache_salt=salt)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; the end of its log:\n{self.log_tail(engine.name)}") from None

    # -- the end ------------------------------------------------------------------------------------
    def close(self, *, interrupted: bool = False) -> None:
        """Stop everything (module notes); safe to call twice."""
        def stop(engine: EngineProcess) -> None:  # with vLLM's engine core: its process group
            try:
                engine.close(timeout=10.0 if interrupted else ENGINE_STOP_S)
            except RuntimeError as exc:
                self.progress(f"{engine.name}: {exc}")
            if engine.unlinked:  # it was killed (or died): vLLM did not free them itself
                self.progress(f"{engine.name:<14} unlinked the {len(engine.unlinked)} shared-memory segments "
                              f"its processes left: {', '.join(engine.unlinked)}")

        def stop_plane() -> None:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.run(self._stack.aclose(), PLANE_S)
                self._loop.close()
                self._loop = None

        def stop_all() -> None:  # the engines in parallel (each may wait out its grace period)
            try:
                stoppers = [threading.Thread(target=stop, args=(e,), name=f"stop {e.name}") for e in self.engines]
                for t in stoppers:
                    t.start()
                for t in stoppers:
                    t.join()
                stop_plane()
            finally:  # the run's directory (the relay's key, the CA) goes whatever failed above
                for _, log in self._logs.values():
                    log.close()
                shutil.rmtree(self.workdir, ignore_errors=True)

        # On a thread of its own, so that a second Ctrl-C or SIGTERM does not cut it short.
        worker = threading.Thread(target=stop_all, name="kvsp-demo-stop")
        worker.start()
        while worker.is_alive():
            try:
                worker.join()
            except KeyboardInterrupt:
                self.progress("already shutting down")


def progress_line(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)
