"""``python -m relay --workers N``: the relay as N worker processes sharing one UDP port,
under one hub relay that holds the upstream side (issue 16: fan-out that uses more cores).

One relay process sends every byte once per subscriber, each copy encrypted for its own QUIC
connection on one core (docs/relay.md "Cores"). With ``--workers N``:

* **N worker processes** (``multiprocessing`` spawn), each a full :class:`~relay.core.Relay`
  listening on the public ``--listen`` address with ``SO_REUSEPORT``
  (``TransportConfig.reuse_port``): the kernel spreads QUIC peers over the workers by their
  address 4-tuple, so every packet of a connection reaches the worker that holds it (QUIC's
  connection IDs are not looked at; a peer whose address changes, NAT rebinding or
  migration, may land on another worker and lose its connection). A worker authorizes its
  own clients (``--config``), caches what passes through it and fans out to them;
* **one hub relay** in the supervisor process, on ``127.0.0.1`` (port 0, its own
  self-signed certificate, which the workers verify): every worker's ``--upstream``. The
  hub holds the real ``--upstream`` (if any), so the chain above sees ONE relay. Through the
  ordinary chaining rules (docs/relay.md "Chaining") one upstream subscription per track is
  shared by all workers: a publisher lands on some worker, which announces its namespaces
  (and PUBLISHes) to the hub; a subscriber on another worker is routed hub → that worker;
  the hub's subscription is one more subscriber of that worker's fan-out. A FETCH that
  misses a worker's cache is asked of the hub, whose cache then serves every worker: the
  cache is two levels (each worker's, the hub's), not one shared memory;
* the hub accepts only the workers: one principal, a random token made at start
  (``[relay] upstream_token`` of each worker); the hub's own upstream token is the one of
  ``--config``.

Costs, and when it pays: a track published on worker A and subscribed on B crosses A → hub →
B (two more hops, each a decryption and an encryption). On 2 cores the extra work eats the
gain (docs/benchmarks.md); with a core per worker plus one for the hub, each worker
encrypts only for its own subscribers.

SIGTERM / SIGINT: every worker drains (GOAWAY, ``--drain-timeout``), then the hub; exit 0.
A worker that dies is not restarted: its clients lose their connections, and because the
kernel then re-spreads addresses over the remaining sockets, other workers' clients may too
(limitation of ``SO_REUSEPORT`` for QUIC).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import secrets
import signal
import socket
from multiprocessing.process import BaseProcess

from kvsp_moq.transport.tls import make_self_signed

from .ops.auth import AuthConfig, Authorizer, Grants, Principal, token_digest
from .ops.config import RelayConfig
from .core import Relay
from .ops.logs import configure_logging

__all__ = ["WORKER_START_TIMEOUT", "hub_config", "serve_workers", "worker_config"]

logger = logging.getLogger("relay")

#: Seconds a worker process may take to start listening.
WORKER_START_TIMEOUT = 60.0
#: Name of the hub's one principal (the workers).
HUB_PRINCIPAL = "relay-worker"
_EVERYTHING = Grants(publish=((),), subscribe=((),))


def hub_config(base: RelayConfig, token: bytes, cert_pem: bytes, key_pem: bytes) -> RelayConfig:
    """The hub: ``base`` on 127.0.0.1, port 0, its own certificate, only ``token`` admitted;
    it keeps ``base``'s upstream (and the upstream token of its ``--config``)."""
    server = base.server_transport.replace(
        certificate_pem=cert_pem, private_key_pem=key_pem, certificate_file=None,
        private_key_file=None, reuse_port=False)
    auth = AuthConfig(Authorizer([(token_digest(token), Principal(HUB_PRINCIPAL, _EVERYTHING))]),
                      base.auth_token_cache_size,
                      base.auth.upstream_token if base.auth is not None else None)
    return dataclasses.replace(base, host="127.0.0.1", port=0, server_transport=server,
                               auth=auth, solicit_namespaces=True, solicit_prefix=())


def worker_config(base: RelayConfig, port: int, hub_url: str, hub_cert_pem: bytes,
                  token: bytes) -> RelayConfig:
    """One worker: ``base`` on its public address with SO_REUSEPORT, the hub as upstream
    (verified against the hub's certificate, ``token`` in SETUP), its clients authorized by
    ``base.auth`` (none: every request allowed, as an open relay)."""
    authorizer = base.auth.authorizer if base.auth is not None else Authorizer([], _EVERYTHING)
    auth = AuthConfig(authorizer, base.auth_token_cache_size, token)
    upstream = base.upstream_transport.replace(ca_data=hub_cert_pem, ca_file=None,
                                               insecure=False)
    return dataclasses.replace(base, port=port, upstream=hub_url, upstream_transport=upstream,
                               server_transport=base.server_transport.replace(reuse_port=True),
                               auth=auth, metrics=None)


def _reserve(host: str, port: int) -> socket.socket:
    """A SO_REUSEPORT socket on ``host:port`` (0: any free port), held while the workers
    bind the same port (then closed, before any peer may connect)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


# -- the worker process ------------------------------------------------------------------------
def _worker_main(config: RelayConfig, log_format: str, log_level: int,
                 ready: multiprocessing.connection.Connection) -> None:
    from kvsp_moq.transport import run

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor says when (SIGTERM)
    configure_logging(log_format, log_level)
    run(_worker(config, ready))


async def _worker(config: RelayConfig, ready: multiprocessing.connection.Connection) -> None:
    relay = await Relay(config).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    ready.send(relay.port)
    ready.close()
    await stop.wait()
    await relay.shutdown()


# -- the supervisor ----------------------------------------------------------------------------
class _Workers:
    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []

    async def start(self, configs: list[RelayConfig], log_format: str, log_level: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        pipes = []
        for i, config in enumerate(configs):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, name=f"relay-worker-{i}",
                               args=(config, log_format, log_level, child), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            pipes.append(parent)
        for i, pipe in enumerate(pipes):
            ok = await asyncio.to_thread(pipe.poll, WORKER_START_TIMEOUT)
            if not ok:
                raise RuntimeError(f"relay worker {i} did not start within "
                                   f"{WORKER_START_TIMEOUT:g} s")
            try:
                pipe.recv()
            except EOFError:
                raise RuntimeError(f"relay worker {i} failed to start "
                                   f"(exit {self.procs[i].exitcode})") from None
            pipe.close()

    async def stop(self, timeout: float) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                proc.terminate()  # SIGTERM: GOAWAY, drain, exit
        for proc in self.procs:
            await asyncio.to_thread(proc.join, timeout)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)


async def serve_workers(config: RelayConfig, workers: int, log_format: str = "text",
                        log_level: int = logging.WARNING) -> int:
    """Run the hub here and ``workers`` worker processes on ``config``'s address; print
    ``relay listening on moqt://HOST:PORT/moq`` once all listen; SIGTERM / SIGINT: drain and
    stop them all, then the hub; returns the exit status (0)."""
    if workers < 2:
        raise ValueError("serve_workers needs at least 2 workers")
    token = secrets.token_urlsafe(32).encode()
    cert = make_self_signed(ip_addresses=("127.0.0.1",))
    if config.auth is None:
        logger.warning("relay: no authorization config (--config): the relay is OPEN, every "
                       "peer may publish and subscribe anything")
    hub = await Relay(hub_config(config, token, cert.cert_pem, cert.key_pem)).start()
    hub_url = f"moqt://127.0.0.1:{hub.port}/moq"
    pool = _Workers()
    try:
        reserved = _reserve(config.host, config.port)
        try:
            port = reserved.getsockname()[1]
            await pool.start([worker_config(config, port, hub_url, cert.cert_pem, token)
                              for _ in range(workers)], log_format, log_level)
        finally:
            reserved.close()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"relay listening on moqt://{config.host}:{port}/moq", flush=True)
        print(f"relay workers: {workers} (hub {hub_url})", flush=True)
        if hub.metrics is not None:
            host = config.metrics[0] if config.metrics else "127.0.0.1"
            print(f"relay metrics on http://{host}:{hub.metrics.port}/metrics (the hub)",
                  flush=True)
        await stop.wait()
    finally:
        await pool.stop(config.drain_timeout + 5.0)
        await hub.shutdown()
    print("relay stopped", flush=True)
    return 0
