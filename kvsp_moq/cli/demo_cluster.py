"""The loopback cluster of ``kvsp demo``: every role started for real, with embedded defaults.

:func:`start_cluster` starts, on 127.0.0.1 with ports chosen by the OS and bearer tokens
generated for this run (no configuration file):

* an Index Service (``serve_index``);
* a holder: the HTTP holder (``serve_holder``, publishing its records to the IS) and, on the
  same :class:`~kvsp_moq.storage.BlockStore`, a :class:`~kvsp_moq.bridge.MoqtHolder` that
  publishes the store's replicas to the relay (binding v1);
* a MOQT relay: ``python -m relay`` as a child process (its metrics endpoint on for the
  cache statistics);
* two instance control planes (``serve_instance``), reporting to the PC;
* a Placement Controller (``serve_pc``) fed by the IS.

Everything is entered into one :class:`contextlib.AsyncExitStack`, so leaving it (normally,
on an error or on cancellation by Ctrl-C) closes the servers in reverse order and terminates
the relay process. The HTTP calls the demo itself makes go through :func:`http_request`, a
tiny HTTP/1.1 client on asyncio streams (only ``kvsp_moq.control.http`` may import aiohttp).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import sys
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..bridge import MoqtHolder
from ..control.auth import Authorizer, Grant, Principal
from ..control.clock import MonotonicClock
from ..control.config import ControlConfig, HolderConfig, IndexConfig, InstanceConfig, LinkConfig, PcConfig, TierConfig
from ..control.holder import build_store
from ..control.http import INSTANCE_SERVICE, HttpIndexClient, RunningServer, serve_holder, serve_index, serve_instance, serve_pc
from ..control.instance import InstanceService
from ..control.prefetch import MoqtRetriever
from ..transport import TransportConfig

__all__ = ["Cluster", "HttpReply", "http_request", "start_cluster"]

ROOT = Path(__file__).resolve().parents[2]  # the directory holding kvsp_moq/ and relay/
ROLES = ("holder", "instance-1", "instance-2", "pc")
MiB = 1 << 20
#: Links instance 2 reports (the §6.4 inputs): the relay is rack-local, the HTTP holder far.
RELAY_LINK = (10_000.0, 100.0)  # Mbit/s, RTT µs
HTTP_LINK = (100.0, 2_000.0)


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def http_request(url: str, method: str = "GET", *, token: str | None = None, body: bytes | None = None,
                       content_type: str | None = None, headers: Mapping[str, str] | None = None,
                       timeout: float = 30.0) -> HttpReply:
    """One HTTP/1.1 request on a fresh connection (``Connection: close``); the whole answer."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {path or '/'} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    if body is not None:
        lines += [f"Content-Length: {len(body)}", f"Content-Type: {content_type or 'application/kvsp+json'}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    out_headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        out_headers[name.strip().lower()] = value.strip()
    if "chunked" in out_headers.get("transfer-encoding", ""):
        payload = _dechunk(payload)
    return HttpReply(int(status_line.split()[1]), out_headers, payload)


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


@dataclass
class RelayProcess:
    process: asyncio.subprocess.Process
    url: str
    metrics_url: str

    @property
    def port(self) -> int:
        return int(urlsplit(self.url.replace("moqt://", "http://")).port or 0)

    async def stats(self) -> dict[str, float]:
        """The relay's counters, read from its Prometheus endpoint."""
        reply = await http_request(self.metrics_url, timeout=10)
        out: dict[str, float] = {}
        for line in reply.body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


async def _start_relay(stack: AsyncExitStack) -> RelayProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--metrics", "0", "--cache-mib", "64",
        "--drain-timeout", "2", "--max-datagram-size", "1452", "--log-level", "ERROR",
        cwd=str(ROOT), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )

    async def stop() -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    stack.push_async_callback(stop)
    assert proc.stdout is not None
    url = metrics = None
    async with asyncio.timeout(30):
        while url is None or metrics is None:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise RuntimeError(f"the relay exited during start-up (status {await proc.wait()})")
            if m := re.match(r"relay listening on (moqt://\S+)", line):
                url = m.group(1)
            elif m := re.match(r"relay metrics on (http://\S+)", line):
                metrics = m.group(1)
    return RelayProcess(proc, url, metrics)


@dataclass
class Cluster:
    tokens: dict[str, str]
    index: RunningServer
    relay: RelayProcess
    holder_http: RunningServer
    holder_moqt: MoqtHolder
    pc: RunningServer
    instances: list[RunningServer]
    index_client: HttpIndexClient
    servers: list[dict[str, Any]] = field(default_factory=list)

    def instance_service(self, i: int) -> InstanceService:
        return self.instances[i].app[INSTANCE_SERVICE]


async def start_cluster(stack: AsyncExitStack, *, descriptor: Mapping[str, Any],
                        retriever: Callable[[str], MoqtRetriever],
                        progress: Callable[[str], None]) -> Cluster:
    """Start every role; ``retriever(relay_url)`` is instance 2's MOQT retrieval hook."""
    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    # One principal per role. They may act for every scope, holder and instance: the URLs are
    # only known once the servers are bound (a deployment lists them, docs/http-api.md).
    everything: Grant = Grant(everything=True)
    auth = Authorizer.from_tokens({
        tok: Principal(role, scopes=everything, holders=everything, instances=everything)
        for role, tok in tokens.items()
    })
    clock = MonotonicClock()

    index = await stack.enter_async_context(await serve_index(
        ControlConfig(auth=auth, index=IndexConfig(descriptors=(descriptor,))), clock=clock))
    progress(f"index service  {index.url}")

    relay = await _start_relay(stack)
    progress(f"relay          {relay.url} (pid {relay.process.pid}, metrics {relay.metrics_url}; "
             "no authorization config: open, loopback only)")

    hc = HolderConfig(index_url=index.url, index_token=tokens["holder"], tiers=(TierConfig("host", 256 * MiB),))
    store = build_store(hc.tiers, clock)
    holder_http = await stack.enter_async_context(
        await serve_holder(ControlConfig(auth=auth, holder=hc), clock=clock, store=store))
    holder_moqt = MoqtHolder(store)
    stack.push_async_callback(holder_moqt.close)
    await holder_moqt.attach_relay(relay.url, TransportConfig(insecure=True, max_datagram_size=1452))
    progress(f"holder         {holder_http.url} (HTTP), publishing its store to the relay over MOQT")

    pcc = PcConfig(index_url=index.url, index_token=tokens["pc"], instance_token=tokens["pc"],
                   prefetch_deadline_ms=30_000, prefetch_lease_ms=30_000)
    pc = await stack.enter_async_context(await serve_pc(ControlConfig(auth=auth, pc=pcc), clock=clock))
    progress(f"PC             {pc.url}")

    instances = []
    for n, links in ((1, ()), (2, (LinkConfig(relay.url, *RELAY_LINK), LinkConfig(holder_http.url, *HTTP_LINK)))):
        ic = InstanceConfig(index_url=index.url, pc_url=pc.url, token=tokens[f"instance-{n}"], links=links,
                            tiers=(TierConfig("host", 256 * MiB),))
        hook = retriever(relay.url) if n == 2 else None
        server = await stack.enter_async_context(await serve_instance(
            ControlConfig(auth=auth, instance=ic), clock=clock, moqt_retriever=hook))
        instances.append(server)
        progress(f"instance {n}     {server.url}")

    index_client = HttpIndexClient(index.url, tokens["holder"])
    stack.push_async_callback(index_client.close)
    servers: list[dict[str, Any]] = [
        {"role": "index", "url": index.url, "port": index.port, "protocol": "tcp"},
        {"role": "relay", "url": relay.url, "port": relay.port, "protocol": "udp", "pid": relay.process.pid},
        {"role": "relay-metrics", "url": relay.metrics_url, "port": urlsplit(relay.metrics_url).port, "protocol": "tcp"},
        {"role": "holder", "url": holder_http.url, "port": holder_http.port, "protocol": "tcp"},
        {"role": "pc", "url": pc.url, "port": pc.port, "protocol": "tcp"},
        *({"role": f"instance-{n}", "url": s.url, "port": s.port, "protocol": "tcp"} for n, s in enumerate(instances, 1)),
    ]
    return Cluster(tokens, index, relay, holder_http, holder_moqt, pc, instances, index_client, servers)
