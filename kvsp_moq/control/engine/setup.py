"""Assembling an instance's :class:`~.engine.engine.InferenceEngine` from ``[instance.engine]``.

``instance.serve.serve_instance`` calls :func:`start_engine` with the instance's store, lifecycle,
replica publisher and HTTP clients; this module adds what is MOQT: a
:class:`~kvsp_moq.bridge.MoqtPool` for on-demand loads through the relay, and a
:class:`~kvsp_moq.bridge.MoqtHolder` on the instance's store attached to the relay as a
publisher (binding v1), both presenting the instance's token (binding §9) and bounded by
``[instance.engine.moqt_limits]`` (``EngineConfig.moqt_limits``, docs/security.md).

The holder attaches to the relay in the background (:class:`RelayAttachment`); the start
waits for it at most ``moqt_timeout_s``. So an instance whose relay is down at start-up
(restarting at the same moment) starts and serves — loads over HTTP, recomputes, publishes to
its store and HTTP holder — and attaches once the relay is back, tried again with the
``moqt_reconnect_*`` backoff. Its ``moqt://`` records name the relay only
for replicas the relay accepted (``client.computed``): none before the attach, then all of them
at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from ...bridge import MoqtHolder, MoqtPool
from ...kvsp.codecs.policy import CodecPolicy
from ...pubsub import MoqtSession
from ...storage import BlockStore
from ...transport import TransportConfig
from ..client.publisher import IndexClient, ReplicaPublisher
from ..client.retrieval import BlockFetcher
from ..common.clock import Clock
from ..common.engine_config import EngineConfig
from ..common.lifecycle import Lifecycle
from ..common.tls import TlsConfig
from .counters import EngineCounters
from .engine import Closeable, DirectiveFinder, InferenceEngine, load_model
from .loader import Lookup
from ..client.computed import BlockStorer, ComputedBlockPublisher

__all__ = ["RelayAttachment", "engine_transport", "start_engine"]

log = logging.getLogger(__name__)


def engine_transport(config: EngineConfig, tls: TlsConfig) -> TransportConfig:
    """The MOQT client configuration of the engine (and of the instance's prefetch loads):
    ``[instance.engine] ca_file`` / ``insecure``, else ``[tls]``'s; verified by default."""
    return tls.transport(ca_file=config.ca_file, insecure=config.insecure,
                         purpose="the MOQT relay and holders of [instance.engine]")


class RelayAttachment:
    """The instance's MoqtHolder attaching to ``[instance.engine] relay_url`` in the
    background (:meth:`MoqtHolder.attach_relay_soon`: at once, then with the reconnect
    backoff), then the ``moqt://`` records of every replica it announced there published
    (the refresh would find them within ``record_ttl_ms / 12``; this does not wait), and
    ``pool``'s session to the relay opened: the one the engine's loads and the prefetch
    directives' FETCH over, so the first block of either pays no QUIC handshake and SETUP.
    Closed with the engine."""

    def __init__(self, attaching: asyncio.Task[MoqtSession | None], publisher: ComputedBlockPublisher,
                 url: str, pool: MoqtPool | None = None) -> None:
        self.url = url
        self.publisher = publisher
        self.pool = pool
        self.task: asyncio.Task[None] = asyncio.ensure_future(self._run(attaching))

    async def _run(self, attaching: asyncio.Task[MoqtSession | None]) -> None:
        if await attaching is None:
            return  # the holder closed first
        log.info("attached to relay %s: publishing its moqt:// records", self.url)
        records = self.publisher.moqt_records
        if records is not None:
            try:
                await records.refresh()
            except Exception as exc:  # the IS: its own refresh loop retries
                log.warning("moqt:// records after attaching to %s: %r (retried by the refresh)", self.url, exc)
        if self.pool is not None:
            try:  # bounded by the pool's connect_timeout
                await self.pool.get(self.url)
            except Exception as exc:  # the first load connects again (after the pool's backoff)
                log.info("opening the loads' session to relay %s: %r", self.url, exc)

    async def wait(self, timeout: float) -> bool:
        """Until attached and its records published, at most ``timeout`` seconds (the start's
        wait for a relay that is up); False: not yet (it goes on in the background)."""
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        return bool(done)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def start_engine(
    config: EngineConfig,
    *,
    store: BlockStore,
    lifecycle: Lifecycle,
    url: Callable[[], str],
    index: (Lookup | None),
    index_publisher: IndexClient | None,
    fetcher: BlockFetcher,
    storer: BlockStorer | None,
    replica_publisher: ReplicaPublisher | None,
    directives: DirectiveFinder | None,
    token: str | None,
    counters: EngineCounters | None = None,
    owned: Sequence[Closeable] = (),
    tls: TlsConfig | None = None,
    clock: Clock | None = None,
    codec_policy: CodecPolicy | None = None,
) -> InferenceEngine:
    """Load the model (in a thread: reading the weights and importing torch take a while)
    and attach to the relay in the background when one is configured. ``owned`` are closed with the engine
    (the prefetch executor's counting MOQT retriever and its session pool). ``tls``: the
    process's ``[tls]`` section, for what ``[instance.engine]`` does not set. ``clock``: the
    instance's, for the TTLs of the ``moqt://`` records (default: the monotonic clock).
    ``codec_policy``: ``[instance.codec_policy]``, which lossy replicas the engine may use."""
    bundle = await asyncio.to_thread(load_model, config)
    counters = counters if counters is not None else EngineCounters()
    transport = engine_transport(config, tls or TlsConfig())
    pool: MoqtPool | None = None
    moqt_holder: MoqtHolder | None = None
    tokens = (token,) if token else ()
    if config.relay_url is not None:
        pool = MoqtPool(transport, connect_timeout=config.moqt_timeout_s, setup_tokens=tokens,
                        receive_limits=config.moqt_limits, reconnect=config.moqt_reconnect)
        moqt_holder = MoqtHolder(store, ttl_ms=config.record_ttl_ms)
    publisher = ComputedBlockPublisher(
        store=store, counters=counters, publisher=replica_publisher, holder_url=config.holder_url, storer=storer,
        moqt_holder=moqt_holder, relay_url=config.relay_url, index=index_publisher, record_ttl_ms=config.record_ttl_ms,
        clock=clock, index_timeout_s=config.index_timeout_s,
    )
    publisher.start()  # the moqt:// records' refresh, stopped when the engine closes
    attached: tuple[RelayAttachment, ...] = ()
    if moqt_holder is not None and config.relay_url is not None:
        attachment = RelayAttachment(moqt_holder.attach_relay_soon(
            config.relay_url, transport, setup_tokens=tokens, receive_limits=config.moqt_limits,
            reconnect=config.moqt_reconnect), publisher, config.relay_url, pool)
        attached = (attachment,)
        try:
            up = await attachment.wait(config.moqt_timeout_s)
        except BaseException:  # the start was cancelled: nothing is left running
            await attachment.close()
            await publisher.close()
            await moqt_holder.close()
            if pool is not None:
                await pool.close()
            raise
        if not up:
            log.warning("relay %s not attached within moqt_timeout_s (%g s): serving without it, "
                        "attaching in the background", config.relay_url, config.moqt_timeout_s)
    return InferenceEngine(
        config=config, bundle=bundle, store=store, lifecycle=lifecycle, index=index, fetcher=fetcher,
        publisher=publisher, url=url, pool=pool, moqt_holder=moqt_holder, directives=directives, counters=counters,
        owned=(*owned, *attached, publisher), codec_policy=codec_policy,
    )

