"""A vLLM engine in a child process, driven over JSON lines (tests, ``kvsp demo``, ``kvsp bench``).

Starting a vLLM engine takes tens of seconds, so a caller starts each engine once and sends
it many requests. ``python -m kvsp_moq.integrations.vllm.engine_process SPEC_JSON`` builds
``vllm.LLM`` from the spec (:class:`EngineSpec`: model directory, block size, the
``KVTransferConfig`` dict of :func:`.settings.kv_transfer_config` or none), prints
``{"ready": true}`` and then answers each request line on stdin with one line on stdout::

    {"id": 1, "prompt_token_ids": [...], "max_tokens": 8, "kv_transfer_params": {...}, "cache_salt": "a",
     "lora": {"name": "ad1", "id": 1, "path": "/models/ad1"}}
    -> {"id": 1, "token_ids": [...], "kv_transfer_params": {"kvsp": {...}}, "elapsed_s": 0.12}
    {"id": 2, "batch": [{"prompt_token_ids": [...], ...}, ...]}    several requests in one batch
    -> {"id": 2, "results": [{"token_ids": [...], "first_token_s": 0.05, "finished_s": 0.09,
                              "first_token_ns": <time.monotonic_ns()>, ...}, ...]}
    {"id": 3, "flush": 30}    wait for the connector's background publications
    -> {"id": 3, "flushed": true}

Greedy decoding (temperature 0, ``ignore_eos``). vLLM's own logs go to stderr.
:class:`EngineProcess` starts and drives one from the parent, every wait bounded.

Each engine runs in a process group of its own: vLLM starts its engine core (and, on some
builds, workers) as child processes, which outlive an engine that is killed while it starts.
:meth:`EngineProcess.close` therefore ends the whole group, and waits (bounded) until none of
its processes is left, zombies aside. A terminal's Ctrl-C reaches only the parent, which closes
each engine's stdin: the engine's own way to stop.

Nothing of an engine outlives :meth:`EngineProcess.close`, however the engine ended (it exited
on its stdin's end, was killed after its grace period, or died by itself): the shared-memory
segments vLLM makes (``/dev/shm/psm_*``, freed by vLLM only when it shuts down cleanly) are
noted while its processes map them, when it is ready and before each stop, and unlinked once
they are gone (:mod:`.shm`); what vLLM puts in the temporary directory (its ZMQ IPC sockets,
torch.distributed's rendezvous file) goes to a directory of the engine's own, ``TMPDIR`` and
``VLLM_RPC_BASE_PATH`` of its processes, removed at the end; torch's compile cache stays where
torch keeps it for every process of the user (``TORCHINDUCTOR_CACHE_DIR``), shared across runs.
"""

from __future__ import annotations

import getpass
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from .shm import SegmentLedger

__all__ = ["EngineProcess", "EngineSpec"]


@dataclass(frozen=True)
class EngineSpec:
    model_dir: str
    block_size: int = 32
    max_model_len: int = 2048
    #: ``KVTransferConfig`` fields (None: no connector at all).
    kv_transfer_config: dict[str, Any] | None = None
    #: vLLM's own prefix cache: on, as vLLM's default is (a repeat on the same engine is then
    #: vLLM's own hit; the connector serves what another engine computed).
    enable_prefix_caching: bool = True
    #: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) on CPU.
    kv_cache_gib: int = 1
    #: The model's dtype (``LLM(dtype=...)``: float32, bfloat16, float16) and the KV cache's
    #: (``kv_cache_dtype``: auto = the model's, fp8_e4m3, fp8_e5m2).
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    #: LoRA adapters served (``enable_lora``), with their largest rank.
    max_loras: int = 0
    max_lora_rank: int = 8
    #: vLLM's token budget per step (None: vLLM's default); a longer prompt is prefilled in chunks.
    max_num_batched_tokens: int | None = None
    #: The CPUs the engine's processes run on and vLLM binds its OpenMP threads to
    #: (``VLLM_CPU_OMP_THREADS_BIND``); None: all of this process's.
    cpus: tuple[int, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)


def _request(req: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The (prompt, sampling parameters, LoRA request) of one request line."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": req["kv_transfer_params"]} if req.get("kv_transfer_params") else None
    params = SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 8)), ignore_eos=True,
                            extra_args=extra)
    prompt = TokensPrompt(prompt_token_ids=list(req["prompt_token_ids"]))
    if req.get("cache_salt"):
        prompt["cache_salt"] = req["cache_salt"]
    adapter = None
    if req.get("lora"):
        from vllm.lora.request import LoRARequest

        adapter = LoRARequest(str(req["lora"]["name"]), int(req["lora"]["id"]), str(req["lora"]["path"]))
    return prompt, params, adapter


def _batch(llm: Any, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several requests in one batch, stepped by hand: when each one's first token and its end
    came (s from the batch's start), so that one request's wait can be seen not to hold the
    others."""
    engine = llm.llm_engine
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for i, req in enumerate(reqs):
        prompt, params, adapter = _request(req)
        engine.add_request(f"batch-{i}", prompt, params, lora_request=adapter)
        results[f"batch-{i}"] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            mine = results.get(output.request_id)
            if mine is None:
                continue
            now = time.perf_counter() - start
            if output.outputs and output.outputs[0].token_ids and "first_token_s" not in mine:
                mine["first_token_s"] = now
                mine["first_token_ns"] = time.monotonic_ns()  # CLOCK_MONOTONIC: comparable between processes
            if output.finished:
                mine.update(token_ids=list(output.outputs[0].token_ids), kv_transfer_params=output.kv_transfer_params,
                            finished_s=now)
    return [results[f"batch-{i}"] for i in range(len(reqs))]


def _serve(spec: EngineSpec, out: IO[str]) -> None:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from .settings import WORKER_EXTENSION

    kv = KVTransferConfig(**spec.kv_transfer_config) if spec.kv_transfer_config else None
    lora: dict[str, Any] = {"enable_lora": True, "max_loras": spec.max_loras, "max_lora_rank": spec.max_lora_rank} \
        if spec.max_loras else {}
    extension: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION} if kv is not None else {}
    if spec.max_num_batched_tokens is not None:
        extension["max_num_batched_tokens"] = spec.max_num_batched_tokens
    llm = LLM(model=spec.model_dir, dtype=spec.dtype, kv_cache_dtype=spec.kv_cache_dtype, enforce_eager=True,
              block_size=spec.block_size, max_model_len=spec.max_model_len,
              enable_prefix_caching=spec.enable_prefix_caching, tensor_parallel_size=spec.tensor_parallel_size,
              kv_transfer_config=kv, max_num_seqs=4, seed=0, **lora, **extension)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        start = time.perf_counter()
        try:
            if "flush" in req:  # the connector's background publications (worker_extension_cls)
                flushed = llm.collective_rpc("kvsp_flush", args=(float(req["flush"]),)) if kv is not None else []
                answer: dict[str, Any] = {"flushed": all(flushed)}
            elif "batch" in req:
                answer = {"results": _batch(llm, list(req["batch"]))}
            else:
                prompt, params, adapter = _request(req)
                result = llm.generate([prompt], params, use_tqdm=False, lora_request=adapter)[0]
                answer = {"token_ids": list(result.outputs[0].token_ids), "kv_transfer_params": result.kv_transfer_params}
        except Exception as exc:
            out.write(json.dumps({"id": req.get("id"), "error": f"{type(exc).__name__}: {exc}"}) + "\n")
            out.flush()
            continue
        out.write(json.dumps({"id": req.get("id"), **answer, "elapsed_s": time.perf_counter() - start}) + "\n")
        out.flush()


class EngineProcess:
    """One engine child process (module notes). ``start_timeout`` bounds the engine's start,
    ``request_timeout`` each request; a child that exits or is late raises RuntimeError."""

    def __init__(self, spec: EngineSpec, *, name: str = "engine", stderr: IO[str] | int | None = None,
                 python: str = sys.executable) -> None:
        self.spec = spec
        self.name = name
        #: The shared memory its processes were seen mapping, and what close() had to unlink.
        self.segments = SegmentLedger()
        self.unlinked: list[str] = []
        self.tmpdir = Path(tempfile.mkdtemp(prefix="kvsp-engine-"))  # the engine's own (module notes)
        try:
            _check_ipc_room(self.tmpdir)
            env = {"TORCHINDUCTOR_CACHE_DIR": _torch_cache_dir(), **os.environ,
                   "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib), "TMPDIR": str(self.tmpdir),
                   "VLLM_RPC_BASE_PATH": str(self.tmpdir), **spec.env}
            self.process = subprocess.Popen(
                [python, "-m", "kvsp_moq.integrations.vllm.engine_process", json.dumps(asdict(spec))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, bufsize=1,
                process_group=0)  # its own group (module notes)
        except BaseException:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            raise
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()
        self._next_id = 0

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _line(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name}: no answer within {timeout} s")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited (code {self.process.wait(10)})")
            value: dict[str, Any] = json.loads(line)
            return value

    def wait_ready(self, timeout: float = 600.0) -> None:
        if not self._line(timeout).get("ready"):
            raise RuntimeError(f"{self.name}: unexpected first line")
        self.segments.note(_group_members(self.process.pid))  # vLLM makes its segments while it starts

    def generate(self, prompt_token_ids: list[int], *, max_tokens: int = 8, kv_transfer_params: dict[str, Any] | None = None,
                 cache_salt: str | None = None, lora: dict[str, Any] | None = None,
                 timeout: float = 300.0) -> dict[str, Any]:
        """One greedy request; its answer (``token_ids``, ``kv_transfer_params``, ``elapsed_s``).
        ``lora``: ``{"name", "id", "path"}`` of an adapter to apply (the engine serves LoRA)."""
        return self._ask({"prompt_token_ids": prompt_token_ids, "max_tokens": max_tokens,
                          "kv_transfer_params": kv_transfer_params, "cache_salt": cache_salt, "lora": lora}, timeout)

    def batch(self, requests: list[dict[str, Any]], timeout: float = 300.0) -> list[dict[str, Any]]:
        """Several requests (each as :meth:`generate`'s keyword arguments) in one batch; per
        request its ``token_ids``, ``kv_transfer_params``, and ``first_token_s`` and
        ``finished_s`` (s from the batch's start)."""
        results: list[dict[str, Any]] = self._ask({"batch": requests}, timeout)["results"]
        return results

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout`` s) until the connector's background publications are done
        on every worker (its blocks are then at the HTTP holder and their records at the IS);
        True when they are. Before asking another engine for what this one computed."""
        return bool(self._ask({"flush": timeout}, timeout + 30)["flushed"])

    def _ask(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        self._next_id += 1
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"id": self._next_id, **req}) + "\n")
        self.process.stdin.flush()
        answer = self._line(timeout)
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer

    def close(self, timeout: float = 60.0) -> None:
        """Close stdin and give the engine ``timeout`` s to exit, then kill it; then kill what is
        left of its process group, unlink the shared memory its processes left (the names go
        to ``unlinked``) and remove its temporary directory (module notes). Safe to call twice."""
        pgid = self.process.pid
        self.segments.note(_group_members(pgid))  # while they live: a killed engine frees nothing
        try:
            if self.process.poll() is None:
                assert self.process.stdin is not None
                try:
                    self.process.stdin.close()
                    self.process.wait(timeout)
                except (OSError, subprocess.TimeoutExpired):
                    self.process.kill()
                    self.process.wait(10)
            _end_group(pgid, GROUP_EXIT_S, self.segments)
        finally:
            self.unlinked += self.segments.sweep()
            shutil.rmtree(self.tmpdir, ignore_errors=True)


#: Bound (s) on the exit of the processes left in an engine's group once they are sent SIGKILL.
GROUP_EXIT_S = 10.0
#: Room for a path in a Unix socket's address (``sun_path``, less its final NUL): vLLM binds
#: ZMQ IPC sockets at ``VLLM_RPC_BASE_PATH/<uuid4>``.
_IPC_PATH_MAX = 107
_UUID_LEN = 36


def _torch_cache_dir() -> str:
    """torch's compile cache where torch puts it by default for this process's user
    (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``), for an engine whose
    temporary directory is its own: the cache is the user's, kept across runs."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _check_ipc_room(directory: Path) -> None:
    """ValueError where vLLM's IPC sockets would not fit under ``directory`` (a long TMPDIR):
    said before the engine starts, not as a ZMQ error deep in its start."""
    if len(os.fsencode(directory)) + 1 + _UUID_LEN > _IPC_PATH_MAX:
        raise ValueError(f"the engine's temporary directory {directory} is too long for vLLM's IPC socket "
                         f"paths ({_IPC_PATH_MAX} octets at most): set TMPDIR to a shorter directory")


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from ``/proc`` (Linux: vLLM's
    CPU and CUDA builds both run there); [] where ``/proc`` cannot be read."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(name))
    return members


def _end_group(pgid: int, timeout: float, ledger: SegmentLedger | None = None) -> None:
    """SIGKILL to every process left in group ``pgid``, then wait until none is alive (each
    waited on through a pidfd, readable once it has exited; bounded: RuntimeError after
    ``timeout`` s). ``ledger`` notes what they map just before (module notes)."""
    deadline = time.monotonic() + timeout
    while members := _group_members(pgid):
        if ledger is not None:
            ledger.note(members)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:  # the group emptied meanwhile
            return
        for pid in members:
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already
                continue
            try:
                left = max(0.0, deadline - time.monotonic())
                select.select([fd], [], [], left)
            finally:
                os.close(fd)
        if time.monotonic() > deadline and _group_members(pgid):
            raise RuntimeError(f"processes {members} of engine group {pgid} still alive {timeout} s after SIGKILL")


def main() -> None:
    # The answers get the original stdout; everything vLLM prints (and its child processes,
    # which inherit fd 1) goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = EngineSpec(**json.loads(sys.argv[1]))
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)  # before vLLM starts: its processes inherit it
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in spec.cpus)
    _serve(spec, answers)


if __name__ == "__main__":
    main()
