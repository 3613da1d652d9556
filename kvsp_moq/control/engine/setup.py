"""Assembling an instance's :class:`~.engine.engine.InferenceEngine` from ``[instance.engine]``.

``instance.serve.serve_instance`` calls :func:`start_engine` with the instance's store, lifecycle,
replica publisher and HTTP clients; this module adds what is MOQT: a
:class:`~kvsp_moq.bridge.MoqtPool` for on-demand loads through the relay, and a
:class:`~kvsp_moq.bridge.MoqtHolder` on the instance's store attached to the relay as a
publisher (binding v1), both presenting the instance's token (binding §9) and bounded by
``[instance.engine.moqt_limits]`` (``EngineConfig.moqt_limits``, docs/security.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ...bridge import MoqtHolder, MoqtPool
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
from .publish import BlockStorer, ComputedBlockPublisher

__all__ = ["engine_transport", "start_engine"]


def engine_transport(config: EngineConfig, tls: TlsConfig) -> TransportConfig:
    """The MOQT client configuration of the engine (and of the instance's prefetch loads):
    ``[instance.engine] ca_file`` / ``insecure``, else ``[tls]``'s; verified by default."""
    return tls.transport(ca_file=config.ca_file, insecure=config.insecure,
                         purpose="the MOQT relay and holders of [instance.engine]")


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
) -> InferenceEngine:
    """Load the model (in a thread: reading the weights and importing torch take a while)
    and connect to the relay when one is configured. ``owned`` are closed with the engine
    (the prefetch executor's counting MOQT retriever and its session pool). ``tls``: the
    process's ``[tls]`` section, for what ``[instance.engine]`` does not set. ``clock``: the
    instance's, for the TTLs of the ``moqt://`` records (default: the monotonic clock)."""
    bundle = await asyncio.to_thread(load_model, config)
    counters = counters if counters is not None else EngineCounters()
    transport = engine_transport(config, tls or TlsConfig())
    pool: MoqtPool | None = None
    moqt_holder: MoqtHolder | None = None
    if config.relay_url is not None:
        tokens = (token,) if token else ()
        pool = MoqtPool(transport, connect_timeout=config.moqt_timeout_s, setup_tokens=tokens,
                        receive_limits=config.moqt_limits, reconnect=config.moqt_reconnect)
        moqt_holder = MoqtHolder(store, ttl_ms=config.record_ttl_ms)
        try:
            await moqt_holder.attach_relay(config.relay_url, transport, setup_tokens=tokens,
                                           receive_limits=config.moqt_limits,
                                           reconnect=config.moqt_reconnect)
        except BaseException:
            await moqt_holder.close()
            await pool.close()
            raise
    publisher = ComputedBlockPublisher(
        store=store, counters=counters, publisher=replica_publisher, holder_url=config.holder_url, storer=storer,
        moqt_holder=moqt_holder, relay_url=config.relay_url, index=index_publisher, record_ttl_ms=config.record_ttl_ms,
        clock=clock, index_timeout_s=config.index_timeout_s,
    )
    publisher.start()  # the moqt:// records' refresh, stopped when the engine closes
    return InferenceEngine(
        config=config, bundle=bundle, store=store, lifecycle=lifecycle, index=index, fetcher=fetcher,
        publisher=publisher, url=url, pool=pool, moqt_holder=moqt_holder, directives=directives, counters=counters,
        owned=(*owned, publisher),
    )

