"""Retrieving a block from ``moqt://`` holders for a prefetch directive (kvsp-draft §6.5,
§6.7; binding v1, docs/binding.md §4, §5, §10).

The MOQT counterpart of :func:`.retrieval.retrieve_block`: it returns the same verified
:class:`~.client.retrieval.Retrieved` (header, layers ascending, SHA-256 of the container) or raises
:class:`~.client.retrieval.RetrievalFailed`, so :mod:`.instance.prefetch` places either result alike. It lives
on the control side because ``Retrieved`` is control's type and ``kvsp_moq.bridge`` may not
import ``kvsp_moq.control`` (tests/test_layering.py); the transfer itself is the bridge's
:func:`~kvsp_moq.bridge.load_block`.

For each record, in order (the next one after any failure, like §6.1 "continue with the next
replica"):

1. only a replica this consumer can verify is tried: a ``moqt://`` holder, codec ``raw``
   (binding §2: the only payload v1 defines), ``layer_digests`` listed (§4.4: REQUIRED for
   layer-wise transfer; binding §4.1 verifies against them) and every layer resident;
2. the geometry comes from the record and the track: ``size`` = 20 + 16·L + L·2·S (KVB1
   header, §4.3, for L layers of K and V sections of S octets each), and the Token Count from
   the Track Properties of TRACK_STATUS (binding §3.2), which must hold layers 0..L-1 and, when
   they list LAYER_DIGESTS, the record's. For codec raw a layer's payload is K || V with
   ``len(K) == len(V) == S`` (binding §2), so the layers are received as octets: a
   :class:`~kvsp_moq.sinks.NumpySink` of a one-octet element type, 1 head of S / tokens;
3. :func:`~kvsp_moq.bridge.load_block` FETCHes layers 0..L-1 (binding §5); the sink verifies
   every layer against the record's ``layer_digests`` before it is exposed (binding §4.1,
   §6.7 "clients MUST also verify the layer digests");
4. the verified layers are assembled into a KVB1 container (``encode_container``), which must
   have the record's ``size``, and the record's ``digest`` must be the replica digest of its
   layer digests (§4.3, §6.7: checked by :class:`ReplicaRecord` on construction and again
   here). ``container_sha256`` is the SHA-256 of that container (what an HTTP holder's
   ``Repr-Digest`` would carry).

Failures are reported as :class:`~.client.retrieval.Attempt`\\ s: ``skipped`` (step 1), ``miss``
(DOES_NOT_EXIST: the holder no longer has it, binding §5), ``rejected`` (a check or a layer
digest failed) or ``error`` (unreachable, timeout, another MOQT error).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from ...bridge import BindingError, MoqtPool, TrackInfo
from ...bridge.landing import OCTET_GEOMETRY, StoreLanding, track_problem
from ...bridge.load import fetch_layers
from ...kvsp.container import (
    FIXED_HEADER_SIZE,
    LENGTH_ENTRY_SIZE,
    DecodedLayer,
    decode_container,
    encode_container,
    replica_digest,
)
from ...kvsp.records import ReplicaRecord
from ...kvsp.registries import CODEC_RAW
from ...moqt.errors import RequestErrorCode
from ...moqt.messages import Message
from ...moqt.session import SessionConfig
from ...pubsub import DEFAULT_RECEIVE_LIMITS, MoqtError, ReceiveLimits
from ...sinks import LayerSink, NumpySink
from ...storage import BlockStore, RecordKey, StorageError
from ...transport import TransportConfig
from .retrieval import Attempt, Landed, RetrievalFailed, Retrieved

__all__ = ["MoqtBlockRetriever", "retrieve_block"]


class _Reject(Exception):
    """One replica failed; ``outcome`` classifies it (:class:`~.client.retrieval.Attempt`)."""

    def __init__(self, outcome: str, detail: str) -> None:
        self.outcome = outcome
        super().__init__(detail)


class MoqtBlockRetriever:
    """``await retriever(replicas) -> Retrieved``: the prefetch hook (:data:`.prefetch.MoqtRetriever`)
    over one :class:`~kvsp_moq.bridge.MoqtPool`, so sessions to a holder or relay are reused
    across blocks (the blocks a prefetch keeps in flight share one session per URL: each is a
    FETCH of its own on it). :meth:`land` stores the block in a :class:`~kvsp_moq.storage.BlockStore`
    as it arrives instead (no container). ``config`` is the QUIC/TLS client configuration (the
    bridge's default when None: the server certificate verified against the system trust store;
    integrity rests on the record's digests, §6.7, confidentiality on TLS);
    ``session_config`` a factory of SessionConfigs per connection; ``pool`` instead of both:
    a pool of the caller's (e.g. one carrying the instance's AUTHORIZATION_TOKEN, binding §9),
    which :meth:`close` leaves open. ``timeout``: seconds per FETCH; ``idle_timeout``: seconds
    a FETCH may go without an octet before the source is abandoned (None: only ``timeout``).
    ``receive_limits``: what a source may make each session of its own pool hold."""

    def __init__(self, config: TransportConfig | None = None, *, timeout: float = 30.0,
                 connect_timeout: float = 5.0,
                 session_config: Callable[[], SessionConfig] | None = None,
                 pool: MoqtPool | None = None,
                 receive_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS,
                 idle_timeout: float | None = None) -> None:
        self._own_pool = pool is None
        self.pool = pool or MoqtPool(config, connect_timeout=connect_timeout, session_config=session_config,
                                     receive_limits=receive_limits)
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout

    async def __call__(self, replicas: Sequence[ReplicaRecord]) -> Retrieved:
        attempts: list[Attempt] = []
        for record in replicas:
            try:
                return await self._one(record, tuple(attempts))
            except _Reject as exc:
                attempts.append(Attempt(record.holder, exc.outcome, str(exc)))
        raise RetrievalFailed(_block_key(replicas), _all_layers(replicas), attempts)

    async def land(self, replicas: Sequence[ReplicaRecord], store: BlockStore, key: RecordKey) -> Landed:
        """Fetch the block from the first replica that passes verification straight into
        ``store`` under ``key`` (:class:`~kvsp_moq.bridge.StoreLanding`: each layer received
        into the tier, hashed once as it lands, verified against the record, committed); the
        same checks and outcomes as :meth:`__call__`. :class:`RetrievalFailed` when no replica
        delivered (nothing is left in the store)."""
        attempts: list[Attempt] = []
        for record in replicas:
            try:
                digests, section = _verifiable(record)
                landing = StoreLanding(store, key, digests, section)
                try:
                    try:
                        await self._fetch(record, landing, landing.on_response, landing.check)
                    except _Reject:
                        if landing.exists:  # stored meanwhile by another load: nothing to do
                            return Landed(record, None, tuple(attempts))
                        raise
                    try:
                        info = landing.finish()
                    except StorageError as exc:
                        raise _Reject("rejected" if landing.writer is None else "error", str(exc)) from None
                except BaseException:
                    landing.discard("the retrieval failed")
                    raise
                return Landed(record, info, tuple(attempts))
            except _Reject as exc:
                attempts.append(Attempt(record.holder, exc.outcome, str(exc)))
        raise RetrievalFailed(_block_key(replicas), _all_layers(replicas), attempts)

    async def close(self) -> None:
        if self._own_pool:
            await self.pool.close()

    # -- one replica ----------------------------------------------------------------------------

    async def _one(self, record: ReplicaRecord, attempts: tuple[Attempt, ...]) -> Retrieved:
        digests, section = _verifiable(record)
        count = len(digests)
        # One octet per element: a layer is 2 x S octets (the record's geometry, §4.3); the
        # Token Count comes with FETCH_OK (binding §3.2), checked against the record.
        sink = NumpySink(OCTET_GEOMETRY, section, (0, count - 1), digests)
        tokens: list[int] = []

        def check(response: object) -> str | None:
            try:
                info = TrackInfo.parse(getattr(response, "track_properties", ()))
            except BindingError as exc:
                return f"track properties: {exc}"
            problem = track_problem(info, digests, section)
            if problem is None:
                tokens.append(info.token_count)
            return problem

        await self._fetch(record, sink, None, check)
        return _assemble(record, digests, tokens[0], [sink.layer(layer) for layer in range(count)], attempts)

    async def _fetch(self, record: ReplicaRecord, sink: LayerSink[Any],
                     on_response: Callable[[Message], None] | None,
                     check: Callable[[object], str | None]) -> None:
        """FETCH layers 0..L-1 of the record's replica into ``sink`` (binding §5): no
        TRACK_STATUS first, ``check`` judges the Track Properties of FETCH_OK. Once more on
        the pool's new session when the FETCH was refused because of a GOAWAY. ``_Reject``
        unless every layer was verified."""
        name = record.block_name()
        assert name is not None  # a moqt:// record carries moqt_namespace (checked on construction)
        last = len(record.layer_digests or ()) - 1
        problems: list[str] = []

        def judged(response: object) -> str | None:
            problem = check(response)
            if problem is not None:
                problems.append(problem)
            return problem

        error: str | None = None
        for _ in range(2):
            try:
                session = await self.pool.get(record.holder)
            except (OSError, TimeoutError, ConnectionError, MoqtError) as exc:
                raise _Reject("error", f"cannot connect: {exc!r}") from None
            _, error, refused = await fetch_layers(session, name, CODEC_RAW.name, sink, 0, last,
                                                   timeout=self.timeout, idle_timeout=self.idle_timeout,
                                                   on_response=on_response, check=judged)
            if not refused:
                break
        if error is None:
            return
        if f"{RequestErrorCode.DOES_NOT_EXIST:#x}" in error.split(":", 1)[0]:
            raise _Reject("miss", f"FETCH: {error}")  # binding §5: a cache miss, like HTTP 404
        failed = [sink.failure_reason(layer) or "" for layer in sink.failed_layers]
        # rejected: the Track Properties, a layer digest or a layer's size disagreed with the record
        outcome = "rejected" if problems or any("digest" in r or "payload length" in r for r in failed) else "error"
        raise _Reject(outcome, f"layers 0-{last} not delivered: {error}"[:2000])


def _verifiable(record: ReplicaRecord) -> tuple[tuple[bytes, ...], int]:
    """The record's layer digests and section size S, or ``_Reject("skipped")``."""
    if not record.is_moqt:
        raise _Reject("skipped", "not a moqt:// holder")
    if record.codec != CODEC_RAW.value:
        raise _Reject("skipped", f"codec {record.codec}: binding v1 defines only raw payloads")
    digests = record.layer_digests
    if digests is None:
        raise _Reject("skipped", "the record lists no layer digests to verify with (§4.4)")
    count = len(digests)
    if not record.holds_layers(0, count - 1):
        raise _Reject("skipped", f"the record does not list layers 0-{count - 1} as resident")
    data = record.size - (FIXED_HEADER_SIZE + LENGTH_ENTRY_SIZE * count)
    if data < 0 or data % (2 * count):
        raise _Reject("rejected", f"size {record.size} is not a raw block of {count} layers (§4.3)")
    if replica_digest(digests) != record.digest:
        raise _Reject("rejected", "the record's digest is not the replica digest of its layer digests")
    return digests, data // (2 * count)


def _assemble(record: ReplicaRecord, digests: tuple[bytes, ...], tokens: int,
              layers: list[tuple[object, object]], attempts: tuple[Attempt, ...]) -> Retrieved:
    """The verified layers as the KVB1 container an HTTP GET would have returned (§4.3)."""
    container = encode_container(record.codec, 0, tokens, layers)  # type: ignore[arg-type]
    if len(container) != record.size:
        raise _Reject("rejected", f"{len(container)} octets, the record says {record.size}")
    decoded = decode_container(container)
    # The digests were verified by the sink on these very octets (binding §4.1).
    out = tuple(DecodedLayer(lv.index, lv.k, lv.v, digests[lv.index]) for lv in decoded.layers())
    return Retrieved(record, decoded.header, out, hashlib.sha256(container).digest(), attempts)


def _block_key(replicas: Sequence[ReplicaRecord]) -> bytes:
    return replicas[0].block_key if replicas else b""


def _all_layers(replicas: Sequence[ReplicaRecord]) -> tuple[int, int] | None:
    for record in replicas:
        if record.layer_digests is not None:
            return (0, len(record.layer_digests) - 1)
    return None


async def retrieve_block(replicas: Sequence[ReplicaRecord], *, config: TransportConfig | None = None,
                         timeout: float = 30.0, connect_timeout: float = 5.0) -> Retrieved:
    """The prefetch hook with a session pool of its own (closed before returning):
    :class:`MoqtBlockRetriever` for one call."""
    retriever = MoqtBlockRetriever(config, timeout=timeout, connect_timeout=connect_timeout)
    try:
        return await retriever(replicas)
    finally:
        await retriever.close()
