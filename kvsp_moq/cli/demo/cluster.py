"""The loopback cluster of ``kvsp demo``: every role started for real, with embedded defaults.

:func:`start_cluster` starts, on 127.0.0.1 with ports chosen by the OS and bearer tokens
generated for this run (no configuration file of the user's):

* an Index Service (``serve_index``), knowing the reference model's Compatibility Descriptor;
* a holder (``serve_holder``: blocks over HTTP, leases, publication of its records to the IS);
* a MOQT relay: ``python -m relay`` as a child process (its metrics endpoint on for the
  report's cross-checks), serving a certificate of a CA made for this run
  (``transport.tls.make_self_signed``): the instances verify it against that CA's file
  (``[tls] ca_file``), so the instances' tokens only ever cross verified TLS. It is not open:
  its ``--config`` (:func:`relay_auth_toml`) lets only the instances' tokens publish and
  subscribe, under the run's scope (docs/relay.md "Authorization");
* a Placement Controller (``serve_pc``) fed by the IS: it places sessions (§6.4), sends prefetch
  directives (§6.5) and keeps checkpoints (§6.8);
* a front end (``serve_frontend``): clients start sessions there (it asks the PC to place them)
  and read their output; instances deliver the output tokens to it (§6.8 exactly once);
* two inference instances, each ``kvsp instance --listen 127.0.0.1:0 --config FILE`` in its own
  process, running the reference model (``[instance.engine]``, torch threads = 1) and the
  sessions the PC starts on it (``control.instance.serve.serve_model_instance``): they load context
  blocks from their store, through the relay over MOQT, or from the holder over HTTP,
  recompute the rest, and publish what they computed to the holder (HTTP) and through the relay
  (MOQT). Their configuration files are written to a temporary directory removed at the end.

The HTTP roles serve plain HTTP on 127.0.0.1: loopback is the one place a bearer token may
cross plain HTTP without ``[tls] allow_plain_http`` (docs/security.md).

The PC and the front end run in this process, so the demo can read their figures directly
(the directives the PC sent, the front end's delivery tally).

:func:`start_kv_plane` starts only the first three (IS, relay, holder): ``kvsp demo --engine
vllm`` runs vLLM engines instead of the rest (``.vllm``).

Everything is entered into one :class:`contextlib.AsyncExitStack`, so leaving it (normally,
on an error or on cancellation by Ctrl-C) closes the servers in reverse order and stops the
child processes (SIGTERM, then SIGKILL after 10 s). The HTTP calls the demo itself makes go
through :func:`http_request`, a tiny HTTP/1.1 client on asyncio streams (only
the control plane's HTTP modules may import aiohttp).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from relay.ops.names import format_namespace

from ...control.common.auth import Authorizer, Grant, Principal
from ...control.common.clock import MonotonicClock
from ...control.common.config import (
    ControlConfig,
    FrontEndConfig,
    HolderConfig,
    IndexConfig,
    PcConfig,
    TierConfig,
)
from ...control.frontend.service import FrontEnd
from ...control.common.tiers import build_store
from ...control.frontend.serve import FRONTEND_SERVICE, serve_frontend
from ...control.pc.serve import PC_SERVICE, serve_pc
from ...control.client.http import HttpFrontEndClient, HttpIndexClient
from ...control.http.server import RunningServer
from ...control.holder.serve import serve_holder
from ...control.index.serve import serve_index
from ...control.pc.service import PlacementController
from ...kvsp import compat, scope
from ...kvsp.naming import scope_prefix
from ...transport.tls import make_self_signed

__all__ = ["Cluster", "HttpReply", "InstanceProcess", "KvPlane", "demo_authorizer", "http_request", "relay_auth_toml",
           "start_cluster", "start_kv_plane"]

ROOT = Path(__file__).resolve().parents[2]  # the directory holding kvsp_moq/ and relay/
ROLES = ("holder", "instance-1", "instance-2", "pc", "frontend", "client")
MiB = 1 << 20
#: Links each instance reports (the §6.4 inputs): the relay is rack-local, the HTTP holder far.
RELAY_LINK = (10_000.0, 100.0)  # Mbit/s, RTT µs
HTTP_LINK = (100.0, 2_000.0)
#: QUIC datagrams of the relay and the instances' MOQT connections: loopback carries 64 KiB
#: datagrams, so the blocks cross in ~14x fewer packets than at the 1200 of an unknown path
#: (``[transport] max_datagram_size``; the per-packet work is what a loopback transfer costs).
DATAGRAM_SIZE = 16384
#: Seconds a child process gets to stop after SIGTERM before it is killed.
STOP_GRACE_S = 10.0


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
    if len(status_line.split()) < 2:  # the peer closed without an answer (it died mid-request, say)
        raise ConnectionError(f"{method} {url}: the connection closed without an HTTP response")
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


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _stopper(proc: asyncio.subprocess.Process) -> Callable[[], Any]:
    async def stop() -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    return stop


async def _read_until(proc: asyncio.subprocess.Process, what: str, patterns: Mapping[str, str],
                      timeout: float = 120.0) -> dict[str, str]:
    """The first match of every pattern in the child's stdout lines (it must not exit first)."""
    assert proc.stdout is not None
    found: dict[str, str] = {}
    async with asyncio.timeout(timeout):
        while len(found) < len(patterns):
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise RuntimeError(f"{what} exited during start-up (status {await proc.wait()})")
            for name, pattern in patterns.items():
                if name not in found and (m := re.match(pattern, line)):
                    found[name] = m.group(1)
    return found


@dataclass(frozen=True)
class DemoTls:
    """The run's TLS material: the relay's chain and key, and the CA that signed it."""

    cert_file: Path
    key_file: Path
    ca_file: Path


def make_demo_tls(workdir: Path) -> DemoTls:
    """A CA and a relay certificate it signed (127.0.0.1, ::1, localhost), for this run only."""
    made = make_self_signed(common_name="kvsp demo", days=1)
    cert_file, key_file = made.write(workdir / "relay.crt", workdir / "relay.key")
    ca_file = workdir / "demo-ca.pem"
    ca_file.write_bytes(made.ca_pem)
    return DemoTls(cert_file, key_file, ca_file)


def relay_auth_toml(tokens: Mapping[str, str], prefixes: Sequence[str]) -> str:
    """The relay's ``--config`` (docs/relay.md "Authorization"): the principal of each
    ``name -> token`` may publish and subscribe under ``prefixes`` (namespace prefixes, as
    ``relay.ops.names.format_namespace`` writes them). There is no ``[anonymous]``: a request
    without one of these tokens is refused (REQUEST_ERROR UNAUTHORIZED), and a SETUP with
    another token closes the session."""
    lines: list[str] = []
    for name, token in tokens.items():
        lines += ["[[principals]]", f"name = {_toml(name)}", f"token = {_toml(token)}",
                  f"publish = {_toml(list(prefixes))}", f"subscribe = {_toml(list(prefixes))}", ""]
    return "\n".join(lines)


def die_with_parent(cmd: Sequence[str]) -> list[str]:
    """``cmd`` run so that the kernel sends it SIGTERM when the thread that started it ends
    (``setpriv --pdeathsig TERM``, util-linux): a demo killed with SIGKILL, or one whose own
    shutdown is cut short, leaves no child of its own running. As given where setpriv is missing."""
    setpriv = shutil.which("setpriv") if sys.platform == "linux" else None
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else list(cmd)


async def _start_relay(stack: AsyncExitStack, tls: DemoTls, auth_file: Path) -> RelayProcess:
    proc = await asyncio.create_subprocess_exec(
        *die_with_parent([sys.executable, "-m", "relay"]), "--listen", "127.0.0.1:0", "--metrics", "0", "--cache-mib", "64",
        "--cert", str(tls.cert_file), "--key", str(tls.key_file), "--config", str(auth_file),
        "--drain-timeout", "2", "--max-datagram-size", str(DATAGRAM_SIZE), "--log-level", "ERROR",
        cwd=str(ROOT), env=_child_env(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )
    stack.push_async_callback(_stopper(proc))
    found = await _read_until(proc, "the relay", {"url": r"relay listening on (moqt://\S+)",
                                                  "metrics": r"relay metrics on (http://\S+)"}, timeout=30)
    return RelayProcess(proc, found["url"], found["metrics"])


@dataclass
class InstanceProcess:
    """``kvsp instance`` in a child process; ``url`` is its base URL (the bound address)."""

    name: str
    process: asyncio.subprocess.Process
    url: str
    config_path: Path

    @property
    def port(self) -> int:
        return int(urlsplit(self.url).port or 0)


def _toml(value: Any) -> str:
    """A TOML value: JSON strings, numbers and arrays are valid TOML for what is written here."""
    return json.dumps(value)


def instance_toml(*, tokens: Mapping[str, str], token: str, index_url: str, pc_url: str, relay_url: str,
                  holder_url: str, model_dir: str, block_tokens: int, scope_key_file: str, ca_file: str,
                  records_journal: str | None = None) -> str:
    """The configuration of one demo instance (docs/http-api.md "Configuration", [instance.engine]);
    ``records_journal`` for an instance that is restarted (``kvsp soak``: §6.1, client/journal.py)."""
    lines: list[str] = []
    for role, tok in tokens.items():
        lines += ["[[principals]]", f"name = {_toml(role)}", f"token = {_toml(tok)}",
                  'scopes = ["*"]', 'holders = ["*"]', 'instances = ["*"]', ""]
    lines += [
        "[tls]",
        f"ca_file = {_toml(ca_file)}",  # the relay's certificate is verified against the demo CA
        "",
        "[transport]",
        f"max_datagram_size = {DATAGRAM_SIZE}",
        "",
        "[instance]",
        f"index_url = {_toml(index_url)}",
        f"pc_url = {_toml(pc_url)}",
        f"token = {_toml(token)}",
        "status_ttl_ms = 3000",
        *([f"records_journal = {_toml(records_journal)}"] if records_journal else []),
        f"tiers = [{{kind = \"host\", capacity = {256 * MiB}}}]",
        f"links = [{{holder = {_toml(relay_url)}, mbit_per_s = {RELAY_LINK[0]}, rtt_us = {RELAY_LINK[1]}}}, "
        f"{{holder = {_toml(holder_url)}, mbit_per_s = {HTTP_LINK[0]}, rtt_us = {HTTP_LINK[1]}}}]",
        "",
        "[instance.engine]",
        f"model_dir = {_toml(model_dir)}",
        f"block_tokens = {block_tokens}",
        "torch_threads = 1",
        f"relay_url = {_toml(relay_url)}",
        f"holder_url = {_toml(holder_url)}",
        f"scope_key_files = [{_toml(scope_key_file)}]",
        "",
    ]
    return "\n".join(lines)


async def _spawn_instance(stack: AsyncExitStack, name: str, config_path: Path) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        *die_with_parent([sys.executable, "-m", "kvsp_moq", "instance"]), "--listen", "127.0.0.1:0", "--config", str(config_path),
        cwd=str(ROOT), env=_child_env(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )
    stack.push_async_callback(_stopper(proc))
    return proc


@dataclass
class Cluster:
    tokens: dict[str, str]
    index: RunningServer
    relay: RelayProcess
    holder: RunningServer
    pc: RunningServer
    frontend: RunningServer
    instances: list[InstanceProcess]
    index_client: HttpIndexClient
    frontend_client: HttpFrontEndClient
    servers: list[dict[str, Any]] = field(default_factory=list)

    def instance_named(self, url: str) -> InstanceProcess:
        return next(i for i in self.instances if i.url == url)

    @property
    def pc_service(self) -> PlacementController:
        return self.pc.app[PC_SERVICE]

    @property
    def fe_service(self) -> FrontEnd:
        return self.frontend.app[FRONTEND_SERVICE]


def demo_authorizer(tokens: Mapping[str, str]) -> Authorizer:
    """One principal per role (name -> token). They may act for every scope, holder and
    instance: the URLs are only known once the servers are bound (a deployment lists them,
    docs/deploy.md)."""
    everything: Grant = Grant(everything=True)
    return Authorizer.from_tokens({
        tok: Principal(role, scopes=everything, holders=everything, instances=everything)
        for role, tok in tokens.items()
    })


@dataclass
class KvPlane:
    """The roles every demo has: the IS, the relay (a child process, ``tls`` its certificate)
    and the HTTP holder."""

    tls: DemoTls
    index: RunningServer
    relay: RelayProcess
    holder: RunningServer


async def start_kv_plane(stack: AsyncExitStack, *, auth: Authorizer, holder_token: str, workdir: Path,
                         descriptors: tuple[Mapping[str, Any], ...], relay_tokens: Mapping[str, str],
                         relay_prefixes: Sequence[str], progress: Callable[[str], None],
                         clock: MonotonicClock | None = None) -> KvPlane:
    """Start the IS (knowing ``descriptors``), the relay and the holder (which publishes its
    records to the IS with ``holder_token``), all entered into ``stack``. The relay serves
    only the MOQT clients of ``relay_tokens`` (name -> token), under ``relay_prefixes``
    (:func:`relay_auth_toml`; its file is written into ``workdir``)."""
    clock = clock or MonotonicClock()
    index = await stack.enter_async_context(await serve_index(
        ControlConfig(auth=auth, index=IndexConfig(descriptors=descriptors)), clock=clock))
    progress(f"index service  {index.url}")

    tls = make_demo_tls(workdir)
    auth_file = workdir / "relay-auth.toml"
    auth_file.touch(mode=0o600)  # bearer tokens: readable by this user only, before they are written
    auth_file.write_text(relay_auth_toml(relay_tokens, relay_prefixes))
    relay = await _start_relay(stack, tls, auth_file)
    progress(f"relay          {relay.url} (pid {relay.process.pid}, metrics {relay.metrics_url}; "
             f"authorized: the tokens of {', '.join(relay_tokens)} only; loopback only)")

    hc = HolderConfig(index_url=index.url, index_token=holder_token, tiers=(TierConfig("host", 256 * MiB),))
    holder = await stack.enter_async_context(
        await serve_holder(ControlConfig(auth=auth, holder=hc), clock=clock, store=build_store(hc.tiers, clock)))
    progress(f"holder         {holder.url} (HTTP blocks and leases)")
    return KvPlane(tls, index, relay, holder)


async def start_cluster(stack: AsyncExitStack, *, descriptor: Mapping[str, Any], model_dir: str, scope_key: bytes,
                        progress: Callable[[str], None]) -> Cluster:
    """Start every role (module notes); the instances run the model of ``model_dir`` with
    ``descriptor``'s block size and know ``scope_key``."""
    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    auth = demo_authorizer(tokens)
    clock = MonotonicClock()
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvsp-demo-")))
    key_file = workdir / "scope.key"
    key_file.write_text(scope_key.hex() + "\n")
    key_file.chmod(0o600)

    # The instances are the relay's only MOQT clients: they publish and load the run's scope.
    relay_clients = {role: tokens[role] for role in ("instance-1", "instance-2")}
    prefix = format_namespace(scope_prefix(compat.compat_id(descriptor), scope.scope_id(scope_key)))
    plane = await start_kv_plane(stack, auth=auth, holder_token=tokens["holder"], workdir=workdir,
                                 descriptors=(descriptor,), relay_tokens=relay_clients, relay_prefixes=(prefix,),
                                 progress=progress, clock=clock)
    index, tls, relay, holder = plane.index, plane.tls, plane.relay, plane.holder

    pcc = PcConfig(index_url=index.url, index_token=tokens["pc"], instance_token=tokens["pc"],
                   prefetch_deadline_ms=30_000, prefetch_lease_ms=30_000)
    pc = await stack.enter_async_context(await serve_pc(ControlConfig(auth=auth, pc=pcc), clock=clock))
    progress(f"PC             {pc.url}")

    fc = FrontEndConfig(pc_url=pc.url, pc_token=tokens["frontend"])
    frontend = await stack.enter_async_context(await serve_frontend(ControlConfig(auth=auth, frontend=fc)))
    progress(f"front end      {frontend.url} (sessions, exactly-once token streams)")

    # Both instances start at once (each imports torch and loads the model in its own process).
    procs = []
    for n in (1, 2):
        path = workdir / f"instance-{n}.toml"
        path.write_text(instance_toml(
            tokens=tokens, token=tokens[f"instance-{n}"], index_url=index.url, pc_url=pc.url, relay_url=relay.url,
            holder_url=holder.url, model_dir=model_dir, block_tokens=int(descriptor["block_tokens"]),
            scope_key_file=str(key_file), ca_file=str(tls.ca_file)))
        procs.append((n, path, await _spawn_instance(stack, f"instance {n}", path)))
    progress("instances      starting 2 x `kvsp instance` (loading the reference model, torch threads = 1)")
    instances = []
    for n, path, proc in procs:
        found = await _read_until(proc, f"instance {n}", {"url": r"kvsp instance: listening on (\S+)"})
        instances.append(InstanceProcess(f"instance-{n}", proc, found["url"], path))
        progress(f"instance {n}     {found['url']} (pid {proc.pid}; model {descriptor['model']}, B = {descriptor['block_tokens']})")

    index_client = HttpIndexClient(index.url, tokens["client"])
    stack.push_async_callback(index_client.close)
    frontend_client = HttpFrontEndClient(tokens["client"], timeout_s=60)
    stack.push_async_callback(frontend_client.close)
    servers: list[dict[str, Any]] = [
        {"role": "index", "url": index.url, "port": index.port, "protocol": "tcp"},
        {"role": "relay", "url": relay.url, "port": relay.port, "protocol": "udp", "pid": relay.process.pid},
        {"role": "relay-metrics", "url": relay.metrics_url, "port": urlsplit(relay.metrics_url).port, "protocol": "tcp"},
        {"role": "holder", "url": holder.url, "port": holder.port, "protocol": "tcp"},
        {"role": "pc", "url": pc.url, "port": pc.port, "protocol": "tcp"},
        {"role": "frontend", "url": frontend.url, "port": frontend.port, "protocol": "tcp"},
        *({"role": i.name, "url": i.url, "port": i.port, "protocol": "tcp", "pid": i.process.pid} for i in instances),
    ]
    return Cluster(tokens, index, relay, holder, pc, frontend, instances, index_client, frontend_client, servers)
