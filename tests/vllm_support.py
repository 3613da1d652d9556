"""A loopback KVSP cluster for the vLLM connector tests (tests/test_vllm_connector.py).

:class:`LoopbackCluster` runs a real Index Service and a real HTTP holder on an event loop of
their own thread (the tests themselves are synchronous: they drive engine processes), and the
MOQT relay as a child process (``python -m relay``) with a certificate of a CA made for the
run. Bearer tokens are generated per run; one principal may act for every scope and holder.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvsp_moq.cli.demo.cluster import make_demo_tls
from kvsp_moq.control.client.http import HttpIndexClient
from kvsp_moq.control.common.auth import Authorizer, Grant, Principal
from kvsp_moq.control.common.clock import MonotonicClock
from kvsp_moq.control.common.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from kvsp_moq.control.common.tiers import build_store
from kvsp_moq.control.holder.serve import serve_holder
from kvsp_moq.control.index.serve import serve_index
from kvsp_moq.integrations.vllm.loop import ClientLoop

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


class LoopbackCluster:
    """IS + holder (in this process, on their own loop) + relay (a child process).
    ``descriptors``: Compatibility Descriptors (§4.1) whose blocks the holder (``GET
    ...?codec=n``, §6.7) and the relay (the coded tracks, docs/binding.md §13) transcode."""

    def __init__(self, descriptors: Sequence[Mapping[str, Any]] = ()) -> None:
        self.loop = ClientLoop("kvsp-test-cluster")
        self.workdir = Path(tempfile.mkdtemp(prefix="kvsp-vllm-"))
        self.descriptors = tuple(descriptors)
        self.token = secrets.token_urlsafe(32)
        everything: Grant = Grant(everything=True)
        self.auth = Authorizer.from_tokens({self.token: Principal("all", scopes=everything, holders=everything,
                                                                  instances=everything)})
        self.tls = make_demo_tls(self.workdir)
        self._stack = contextlib.AsyncExitStack()
        self.index_url, self.holder_url = self.run(self._start(), 60)
        self.index = HttpIndexClient(self.index_url, self.token)
        self.relay: subprocess.Popen[str] | None = None
        self.relay_url = ""
        self.metrics_url = ""
        self.start_relay()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return self.loop.run(coro, timeout)

    async def _start(self) -> tuple[str, str]:
        clock = MonotonicClock()
        index = await self._stack.enter_async_context(await serve_index(
            ControlConfig(auth=self.auth, index=IndexConfig()), clock=clock))
        hc = HolderConfig(index_url=index.url, index_token=self.token, tiers=(TierConfig("host", 256 << 20),),
                          descriptors=self.descriptors)
        holder = await self._stack.enter_async_context(
            await serve_holder(ControlConfig(auth=self.auth, holder=hc), clock=clock, store=build_store(hc.tiers, clock)))
        return index.url, holder.url

    def start_relay(self) -> None:
        transcode: list[str] = []
        for i, doc in enumerate(self.descriptors):
            path = self.workdir / f"descriptor-{i}.json"
            path.write_text(json.dumps(doc))
            transcode += ["--transcode-descriptor", str(path)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--metrics", "0", "--cache-mib", "64",
             "--cert", str(self.tls.cert_file), "--key", str(self.tls.key_file), "--drain-timeout", "2",
             "--log-level", "ERROR", *transcode],
            cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        self.relay = proc
        found: dict[str, str] = {}
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the relay exits: then the assertion below fails
            for name, pattern in (("url", r"relay listening on (moqt://\S+)"), ("metrics", r"relay metrics on (http://\S+)")):
                m = re.search(pattern, line)
                if m:
                    found[name] = m.group(1)
            if len(found) == 2:
                break
        assert len(found) == 2, f"the relay did not start (exit code {proc.poll()})"
        self.relay_url, self.metrics_url = found["url"], found["metrics"]

    def stop_relay(self) -> None:
        if self.relay is not None and self.relay.poll() is None:
            self.relay.terminate()
            try:
                self.relay.wait(15)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait(10)

    def relay_stats(self) -> dict[str, float]:
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:  # noqa: S310 (loopback)
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def close(self) -> None:
        self.stop_relay()
        with contextlib.suppress(Exception):
            self.run(self.index.close(), 10)
        with contextlib.suppress(Exception):
            self.run(self._stack.aclose(), 30)
        self.loop.close()
        shutil.rmtree(self.workdir, ignore_errors=True)  # the relay's key and the run's CA
