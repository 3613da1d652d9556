"""What an instance's engine did, counted (``GET {ii}engine``; docs/http-api.md "Generation").

Two paths bring KV into an instance: prefetch directives (§6.5, before a request) and the
requests themselves (on demand, §6.7, with recomputation of what no replica covers). Both are
counted per transport, in blocks and in KV octets (the K and V sections of every layer: what
both MOQT objects and HTTP containers carry, without the container header), so that a report
can be checked against the relay's and holder's own counters.

:class:`CountingRetriever` and :class:`CountingFetcher` wrap the prefetch executor's MOQT
retriever and HTTP fetcher to count what directives load.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...bridge import MoqtPool
from ...kvsp.container import FIXED_HEADER_SIZE, LENGTH_ENTRY_SIZE
from ...kvsp.records import ReplicaRecord
from ...pubsub.limits import DEFAULT_RECEIVE_LIMITS, ReceiveLimits
from ...storage import BlockStore, RecordKey
from ...transport import TransportConfig
from ..common.metrics import DURATION_BUCKETS
from ..client.retrieval import BlockFetcher, Landed, MoqtRetriever, Retrieved, retrieve_via_moqt

__all__ = ["CountingFetcher", "CountingRetriever", "Durations", "EngineCounters", "Transfer", "kv_octets"]

#: Durations kept one by one (the JSON's list): the latest ones; older ones stay in the totals.
RECENT_DURATIONS = 1000


def kv_octets(retrieved: Retrieved) -> int:
    """The K and V octets of a verified container."""
    return sum(len(layer.k) + len(layer.v) for layer in retrieved.layers)


def container_kv_octets(size: int, layers: int) -> int:
    """K and V octets of a raw container of ``size`` octets and ``layers`` layers (§4.3)."""
    return size - FIXED_HEADER_SIZE - LENGTH_ENTRY_SIZE * layers


@dataclass
class Transfer:
    blocks: int = 0
    octets: int = 0

    def add(self, octets: int) -> None:
        self.blocks += 1
        self.octets += octets

    def to_json(self) -> dict[str, int]:
        return {"blocks": self.blocks, "octets": self.octets}


class Durations:
    """Durations (ms) of a long-lived instance's requests in bounded memory: the count, the sum
    and the cumulative counts of :data:`DURATION_BUCKETS` over all of them (the histogram at
    ``GET {ii}metrics``), and the latest :data:`RECENT_DURATIONS` one by one, oldest first
    (iterating yields those)."""

    def __init__(self, recent: int = RECENT_DURATIONS) -> None:
        self.count = 0
        self.sum_ms = 0.0
        #: per bucket of DURATION_BUCKETS (seconds), the durations at or under it: not cumulative
        self._in_bucket = [0] * (len(DURATION_BUCKETS) + 1)
        self._recent: deque[float] = deque(maxlen=recent)

    def append(self, ms: float) -> None:
        self.count += 1
        self.sum_ms += ms
        self._in_bucket[bisect.bisect_left(DURATION_BUCKETS, ms / 1000)] += 1
        self._recent.append(ms)

    def cumulative(self) -> list[int]:
        """For each bound of DURATION_BUCKETS, then +Inf: how many durations were at or under it."""
        out, total = [], 0
        for n in self._in_bucket:
            total += n
            out.append(total)
        return out

    def __iter__(self) -> Iterator[float]:
        return iter(self._recent)

    def __len__(self) -> int:
        return len(self._recent)


@dataclass
class EngineCounters:
    """Cumulative counts since the instance started."""

    requests: int = 0
    failed_requests: int = 0
    #: §6.8 sessions run here (starts and resumes; ``instance/model_sessions.py``) and those that failed.
    sessions: int = 0
    failed_sessions: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    #: Complete prompt blocks (§4.2) of all requests, and how many the IS lookup matched.
    prompt_blocks: int = 0
    lookup_matched: int = 0
    #: Prompt blocks reused, by where the KV came from (request path).
    local: Transfer = field(default_factory=Transfer)
    moqt: Transfer = field(default_factory=Transfer)
    http: Transfer = field(default_factory=Transfer)
    #: Complete prompt blocks computed here (misses), and the tokens prefilled in all.
    recomputed_blocks: int = 0
    prefill_tokens: int = 0
    #: Blocks loaded by prefetch directives (§6.5), by transport.
    prefetch_moqt: Transfer = field(default_factory=Transfer)
    prefetch_http: Transfer = field(default_factory=Transfer)
    #: MOQT loads that failed for some layer and fell back (HTTP, then recomputation).
    moqt_fallbacks: int = 0
    #: IS lookups that failed or timed out (``index_timeout_s``): their prompts were recomputed.
    lookup_failures: int = 0
    #: New complete blocks published: own store + IS, HTTP holder, MOQT via the relay.
    published_store: int = 0
    published_holder: int = 0
    published_moqt: int = 0
    publish_errors: int = 0
    #: Time to first token of each request (ms): totals, and the latest ones in order.
    ttft_ms: Durations = field(default_factory=Durations)
    #: Seconds spent in prefill and decode, for the measured rates of the status record (§6.3).
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0

    @property
    def hits(self) -> int:
        return self.local.blocks + self.moqt.blocks + self.http.blocks

    @property
    def misses(self) -> int:
        return self.recomputed_blocks

    def prefill_rate(self) -> float | None:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 and self.prefill_tokens else None

    def decode_rate(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None

    def to_json(self) -> dict[str, Any]:
        reused = self.hits + self.misses
        return {
            "requests": self.requests,
            "failed_requests": self.failed_requests,
            "sessions": self.sessions,
            "failed_sessions": self.failed_sessions,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_blocks": self.prompt_blocks,
            "lookup_matched": self.lookup_matched,
            "hits": self.hits,
            "misses": self.misses,
            "hit_ratio": round(self.hits / reused, 4) if reused else None,
            "request_blocks": {"local": self.local.to_json(), "moqt": self.moqt.to_json(), "http": self.http.to_json(),
                               "recomputed": {"blocks": self.recomputed_blocks}},
            "prefetch_blocks": {"moqt": self.prefetch_moqt.to_json(), "http": self.prefetch_http.to_json()},
            "moqt_fallbacks": self.moqt_fallbacks,
            "lookup_failures": self.lookup_failures,
            "prefill_tokens": self.prefill_tokens,
            "published": {"store": self.published_store, "holder": self.published_holder, "moqt": self.published_moqt,
                          "errors": self.publish_errors},
            "ttft_ms": [round(t, 3) for t in self.ttft_ms],
            "prefill_tokens_per_s": _round(self.prefill_rate()),
            "decode_tokens_per_s": _round(self.decode_rate()),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


class CountingRetriever:
    """The prefetch executor's MOQT hook (:data:`.prefetch.MoqtRetriever`), counting what it
    loads into ``counters.prefetch_moqt``. ``inner`` None: a
    :class:`~.client.moqt.MoqtBlockRetriever` of its own, whose session pool keeps one QUIC
    connection per relay or holder across blocks and directives: the engine's pool once
    :meth:`share_pool` gave it one (the sessions the engine's own loads use, with the
    instance's token), else a pool of its own (closed by :meth:`close`)."""

    def __init__(self, counters: EngineCounters, inner: MoqtRetriever | None = None, *,
                 transport: TransportConfig | None = None,
                 receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS,
                 timeout: float = 30.0, idle_timeout: float | None = None) -> None:
        self.counters = counters
        #: Its own retriever's bounds per request: whole, and without an octet
        #: (``[instance.engine] moqt_timeout_s``, ``moqt_idle_timeout_s``).
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.inner = inner
        #: The QUIC/TLS client configuration of its own retriever (None: the bridge's default,
        #: which verifies against the system store; docs/security.md).
        self.transport = transport
        #: What a source may make each session of its own retriever hold
        #: (``[instance.engine.moqt_limits]``).
        self.receive_limits = receive_limits
        self._own: Any = None
        self._pool: MoqtPool | None = None

    def share_pool(self, pool: MoqtPool) -> None:
        """Load over ``pool`` (the engine's: ``setup.RelayAttachment`` opens its session to
        the relay at start, so a directive's first block pays no handshake); before the first
        load only. :meth:`close` leaves the pool open: its owner closes it."""
        if self._own is not None:
            raise RuntimeError("share_pool after the first load")
        self._pool = pool

    async def __call__(self, replicas: Sequence[ReplicaRecord]) -> Retrieved:
        retrieved = await retrieve_via_moqt(replicas, self.inner if self.inner is not None else self._retriever())
        self.counters.prefetch_moqt.add(kv_octets(retrieved))
        return retrieved

    @property
    def land(self) -> Callable[[Sequence[ReplicaRecord], BlockStore, RecordKey], Awaitable[Landed]] | None:
        """The retriever's ``land`` (a block straight into the store, ``client.moqt``), counted;
        None when ``inner`` has none (the executor then places what ``__call__`` returns)."""
        inner = getattr(self.inner, "land", None) if self.inner is not None else self._retriever().land
        if inner is None:
            return None

        async def land(replicas: Sequence[ReplicaRecord], store: BlockStore, key: RecordKey) -> Landed:
            landed: Landed = await inner(replicas, store, key)
            if landed.info is not None:
                self.counters.prefetch_moqt.add(sum(k + v for k, v in landed.info.lengths))
            return landed
        return land

    def _retriever(self) -> Any:
        if self._own is None:
            from ..client.moqt import MoqtBlockRetriever

            self._own = MoqtBlockRetriever(self.transport, receive_limits=self.receive_limits, pool=self._pool,
                                           timeout=self.timeout, idle_timeout=self.idle_timeout)
        return self._own

    async def close(self) -> None:
        if self._own is not None:
            await self._own.close()
            self._own = None


class CountingFetcher:
    """The prefetch executor's HTTP :class:`~.client.retrieval.BlockFetcher`, counting each complete
    block response (200 to a GET without ``layers=``) into ``counters.prefetch_http``: its
    ``Content-Length`` less the KVB1 header of ``layers`` layers (§4.3). The executor verifies
    the body (Repr-Digest, layer digests) before it stores it (§6.7)."""

    def __init__(self, counters: EngineCounters, inner: BlockFetcher, layers: int) -> None:
        self.counters = counters
        self.inner = inner
        self.layers = layers

    @contextlib.asynccontextmanager
    async def get(self, url: str) -> AsyncIterator[Any]:
        async with self.inner.get(url) as response:
            yield response
            if response.status == 200 and response.content_length is not None and "layers=" not in url:
                self.counters.prefetch_http.add(container_kv_octets(response.content_length, self.layers))
