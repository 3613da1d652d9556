"""Retrieving a block from the holders of its Replica Records (kvsp-draft §6.1, §6.7).

:func:`retrieve_block` tries the replicas in the given order and returns the first container
that passes every check; a 404 from a holder is a cache miss (§6.1: "treat a 404 from a
holder as a cache miss and continue with the next replica or with recomputation"), and so is
any other failure. When every replica fails, :class:`RetrievalFailed` reports the attempts and
the layers to recompute.

Verification (§6.7), while the body streams through the incremental KVB1 decoder
(:class:`~kvsp_moq.kvsp.container.ContainerDecoder`, which hashes each layer as its octets
arrive):

1. ``Repr-Digest`` (RFC 9530) MUST be present with ``sha-256``, and equal the SHA-256 of the
   octets received (checked at the end; the whole body is hashed as it streams, on a worker
   thread for large chunks, in parallel with the layer digests the decoder computes on the
   event loop: two SHA-256 passes are required, §6.7, but each byte is hashed by both while
   the chunk is hot and neither waits for the other — ``hashlib`` releases the GIL);
2. when the returned codec equals the replica's, every returned layer's digest MUST equal the
   record's ``layer_digests`` entry, checked as soon as the layer is complete, so a bad layer
   stops the transfer at once (a range of a replica whose record lists no layer digests
   cannot be verified and is not requested);
3. when all layers were retrieved (and the codec is the replica's), the replica digest (§4.3)
   MUST equal the record's ``digest``;
4. the container must be what was asked for: its first and last layer, its codec, and for a
   whole block the record's ``size``.

Any failure discards what was received (a :class:`LayerSink` is told to ``discard``) and the
next replica is tried. Layers reach the sink only after their own digest was checked; a sink
still must not act irrevocably on them before ``retrieve_block`` returns (the final
``Repr-Digest`` check may discard them).

Transport: a :class:`BlockFetcher` performs the GET; ``client.http`` provides
``HttpBlockFetcher`` (aiohttp). This module does no I/O of its own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Protocol

from ...kvsp.container import (
    DEFAULT_LIMITS,
    ContainerDecoder,
    ContainerHeader,
    ContainerLimits,
    DecodedLayer,
    SectionGeometry,
)
from ...kvsp.errors import ContainerError
from ...kvsp.records import ReplicaRecord
from ...storage import ReplicaInfo
from ..common.media import BLOCK_MEDIA_TYPE

__all__ = [
    "Attempt",
    "BRIDGE_MODULE",
    "BlockFetcher",
    "BlockResponse",
    "Landed",
    "LayerSink",
    "MoqtRetriever",
    "RetrievalFailed",
    "Retrieved",
    "block_url",
    "parse_repr_digest",
    "retrieve_block",
    "retrieve_via_moqt",
]

#: Chunks at least this large have their Repr-Digest update done on the body-hash worker
#: (smaller ones: the hand-off would cost more than the hash).
PARALLEL_HASH_MIN = 64 * 1024

_body_worker: ThreadPoolExecutor | None = None
_body_worker_lock = threading.Lock()


def _body_hash_worker() -> ThreadPoolExecutor:
    """One thread for the Repr-Digest updates of every retrieval (FIFO: per-body order)."""
    global _body_worker
    with _body_worker_lock:
        if _body_worker is None:
            _body_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsp-repr-digest")
        return _body_worker


# ---------------------------------------------------------------------------------------------
# Transport interface


class BlockResponse(Protocol):
    """A holder's answer to a block GET, its body not yet read."""

    status: int
    content_type: str | None
    content_length: int | None
    repr_digest: str | None  # the Repr-Digest field value
    problem: str | None  # the KVSP problem name of a problem details body, if any

    def chunks(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk."""
        ...


class BlockFetcher(Protocol):
    """Performs ``GET {holder}blocks/{compat}/{scope}/{key}[?layers=a-b][&codec=n]``."""

    def get(self, url: str) -> AbstractAsyncContextManager[BlockResponse]:
        ...


class LayerSink(Protocol):
    """Receives verified layers as they arrive (§4.3: usable as soon as received)."""

    def layer(self, record: ReplicaRecord, layer: DecodedLayer) -> None:
        ...

    def discard(self, record: ReplicaRecord) -> None:
        """Everything received from ``record``'s holder is void (a later check failed)."""
        ...


def block_url(holder: str, record: ReplicaRecord, layers: tuple[int, int] | None = None, codec: int | None = None) -> str:
    """The block resource of a record at its holder (§6.7), with the query parameters."""
    base = holder if holder.endswith("/") else holder + "/"
    url = f"{base}blocks/{record.compat_id.hex()}/{record.scope_id.hex()}/{record.block_key.hex()}"
    query = []
    if layers is not None:
        query.append(f"layers={layers[0]}-{layers[1]}")
    if codec is not None:
        query.append(f"codec={codec}")
    return url + ("?" + "&".join(query) if query else "")


def parse_repr_digest(value: str | None) -> bytes | None:
    """The ``sha-256`` member of a ``Repr-Digest`` field value (RFC 9530 §3: a dictionary of
    byte sequences ``alg=:base64:``); None when absent or malformed."""
    if not value:
        return None
    for member in value.split(","):
        name, sep, item = member.strip().partition("=")
        if not sep or name.strip().lower() != "sha-256":
            continue
        item = item.strip().split(";", 1)[0]  # drop parameters
        if len(item) < 2 or item[0] != ":" or item[-1] != ":":
            return None
        try:
            digest = base64.b64decode(item[1:-1], validate=True)
        except (binascii.Error, ValueError):
            return None
        return digest if len(digest) == 32 else None
    return None


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Attempt:
    """One replica tried: ``outcome`` is ``miss`` (404), ``rejected`` (verification failed),
    ``error`` (another status or a transport failure) or ``skipped`` (not tried)."""

    holder: str
    outcome: str
    detail: str


@dataclass(frozen=True)
class Retrieved:
    """A verified container: its header, its layers (ascending) and where it came from."""

    record: ReplicaRecord
    header: ContainerHeader
    layers: tuple[DecodedLayer, ...]
    container_sha256: bytes
    attempts: tuple[Attempt, ...] = ()  # the failed attempts before this one

    @property
    def first_layer(self) -> int:
        return self.header.first_layer

    @property
    def last_layer(self) -> int:
        return self.header.last_layer


@dataclass(frozen=True)
class Landed:
    """A block a MOQT retriever stored in the caller's store itself, layer by layer as it
    arrived (``MoqtBlockRetriever.land``): the record it was verified against, the stored
    replica (None: the store already held the block when the answer came, stored meanwhile
    by another load) and the failed attempts before."""

    record: ReplicaRecord
    info: ReplicaInfo | None
    attempts: tuple[Attempt, ...] = ()


class RetrievalFailed(Exception):
    """No replica delivered a verified container. ``layers`` is the inclusive range to
    recompute (None: every layer of the block, whose count no record stated)."""

    def __init__(self, block_key: bytes, layers: tuple[int, int] | None, attempts: Sequence[Attempt]) -> None:
        self.block_key = block_key
        self.layers = layers
        self.attempts = tuple(attempts)
        which = "all layers" if layers is None else f"layers {layers[0]}-{layers[1]}"
        tried = "; ".join(f"{a.holder}: {a.outcome} ({a.detail})" for a in self.attempts) or "no replicas"
        super().__init__(f"block {block_key.hex()}: recompute {which}; {tried}")


class _Reject(Exception):
    """A replica's answer failed a check; ``outcome`` classifies it for the report."""

    def __init__(self, outcome: str, detail: str) -> None:
        self.outcome = outcome
        super().__init__(detail)


# ---------------------------------------------------------------------------------------------
# Retrieval


@dataclass
class _Expect:
    record: ReplicaRecord
    first: int | None  # None: whatever the replica holds (a whole block)
    last: int | None
    codec: int
    check_layers: bool
    max_octets: int | None
    seen: list[DecodedLayer] = field(default_factory=list)


async def retrieve_block(
    fetcher: BlockFetcher,
    replicas: Sequence[ReplicaRecord],
    *,
    layers: tuple[int, int] | None = None,
    codec: int | None = None,
    sink: LayerSink | None = None,
    geometry: SectionGeometry | None = None,
    limits: ContainerLimits = DEFAULT_LIMITS,
    max_octets: int | None = None,
) -> Retrieved:
    """Fetch the block (or the inclusive layer range ``layers``) from the first replica that
    passes verification; see the module docstring. ``codec`` asks for another codec than the
    replica's (only Repr-Digest then protects it, §6.7). ``max_octets`` caps a response
    (a whole block is also capped at the record's ``size``, in another codec at that size plus
    a lossless coder's worst-case expansion). Raises :class:`RetrievalFailed`."""
    if layers is not None and (layers[0] < 0 or layers[0] > layers[1]):
        raise ValueError(f"invalid layer range {layers!r}")
    attempts: list[Attempt] = []
    block_key = replicas[0].block_key if replicas else b""
    for record in replicas:
        holder = record.holder
        if not holder.startswith(("http://", "https://")):
            attempts.append(Attempt(holder, "skipped", "not an HTTP holder"))
            continue
        if layers is not None and not record.holds_layers(*layers):
            attempts.append(Attempt(holder, "skipped", f"the record does not list layers {layers[0]}-{layers[1]}"))
            continue
        same_codec = codec is None or codec == record.codec
        if layers is not None and same_codec and record.layer_digests is None:
            attempts.append(Attempt(holder, "skipped", "the record lists no layer digests to verify a range with"))
            continue
        expect = _Expect(
            record,
            layers[0] if layers is not None else None,
            layers[1] if layers is not None else None,
            record.codec if codec is None else codec,
            same_codec and record.layer_digests is not None,
            _cap(max_octets, _size_bound(record, layers, same_codec)),
        )
        try:
            header, digest = await _fetch_one(fetcher, block_url(holder, record, layers, codec), expect, sink, geometry, limits)
        except _Reject as exc:
            attempts.append(Attempt(holder, exc.outcome, str(exc)))
            if sink is not None and expect.seen:
                sink.discard(record)
            continue
        except Exception as exc:  # transport failures: the next replica
            attempts.append(Attempt(holder, "error", f"{type(exc).__name__}: {exc}"))
            if sink is not None and expect.seen:
                sink.discard(record)
            continue
        return Retrieved(record, header, tuple(expect.seen), digest, tuple(attempts))
    raise RetrievalFailed(block_key, layers if layers is not None else _all_layers(replicas), attempts)


def _size_bound(record: ReplicaRecord, layers: tuple[int, int] | None, same_codec: bool) -> int | None:
    """The most octets a whole block's answer may have: the record's ``size`` in its codec; in
    another codec (transcoded, §6.7) that size plus a lossless coder's worst-case expansion
    (Zstandard's bound is under 1/128 more, plus framing), so a holder cannot stream without
    end; a layer range: None (the container's own limits apply)."""
    if layers is not None:
        return None
    return record.size if same_codec else record.size + record.size // 128 + 65536


def _cap(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _all_layers(replicas: Sequence[ReplicaRecord]) -> tuple[int, int] | None:
    for record in replicas:
        if record.layer_digests is not None:
            return (0, len(record.layer_digests) - 1)
    return None


async def _fetch_one(
    fetcher: BlockFetcher,
    url: str,
    expect: _Expect,
    sink: LayerSink | None,
    geometry: SectionGeometry | None,
    limits: ContainerLimits,
) -> tuple[ContainerHeader, bytes]:
    async with fetcher.get(url) as response:
        if response.status == 404:
            raise _Reject("miss", f"404 {response.problem or ''}".strip())
        if response.status != 200:
            raise _Reject("error", f"status {response.status} {response.problem or ''}".strip())
        if (response.content_type or "").split(";")[0].strip().lower() != BLOCK_MEDIA_TYPE:
            raise _Reject("rejected", f"media type {response.content_type!r}, not {BLOCK_MEDIA_TYPE}")
        announced = parse_repr_digest(response.repr_digest)
        if announced is None:
            raise _Reject("rejected", "no valid sha-256 Repr-Digest (RFC 9530), which §6.7 requires")
        if expect.max_octets is not None and response.content_length is not None and response.content_length > expect.max_octets:
            raise _Reject("rejected", f"Content-Length {response.content_length} exceeds {expect.max_octets} octets")
        decoder = ContainerDecoder(geometry=geometry, limits=limits)
        body_hash = sha256()
        pending: Future[None] | None = None  # the last Repr-Digest update on the worker
        received = 0
        try:
            async for chunk in response.chunks():
                received += len(chunk)
                if expect.max_octets is not None and received > expect.max_octets:
                    raise _Reject("rejected", f"the body exceeds {expect.max_octets} octets")
                if len(chunk) >= PARALLEL_HASH_MIN:
                    # Repr-Digest on the worker while the decoder hashes the layers here.
                    pending = _body_hash_worker().submit(body_hash.update, bytes(chunk) if not isinstance(chunk, bytes) else chunk)
                else:
                    if pending is not None:  # keep the body's order
                        await asyncio.wrap_future(pending)
                        pending = None
                    body_hash.update(chunk)
                had_header = decoder.header is not None
                completed = decoder.feed(chunk)
                if not had_header and decoder.header is not None:
                    _check_header(decoder.header, expect)
                for layer in completed:
                    _check_layer(layer, expect)
                    expect.seen.append(layer)
                    if sink is not None:
                        sink.layer(expect.record, layer)
            header = decoder.finish()
        except ContainerError as exc:
            raise _Reject("rejected", str(exc)) from None
        if pending is not None:
            await asyncio.wrap_future(pending)
        digest = body_hash.digest()
        if digest != announced:
            raise _Reject("rejected", "the body does not match its Repr-Digest")
        if expect.first is None and expect.codec == expect.record.codec:
            # All layers retrieved: the replica digest MUST match (§6.7).
            if decoder.replica_digest() != expect.record.digest:
                raise _Reject("rejected", "the replica digest does not match the record")
            if expect.record.size != received:
                raise _Reject("rejected", f"{received} octets, the record says {expect.record.size}")
        return header, digest


def _check_header(header: ContainerHeader, expect: _Expect) -> None:
    if header.codec != expect.codec:
        raise _Reject("rejected", f"codec {header.codec}, asked for {expect.codec}")
    if expect.first is not None and (header.first_layer, header.last_layer) != (expect.first, expect.last):
        raise _Reject("rejected", f"layers {header.first_layer}-{header.last_layer}, asked for {expect.first}-{expect.last}")
    digests = expect.record.layer_digests
    if expect.first is None and digests is not None and expect.codec == expect.record.codec:
        if (header.first_layer, header.last_layer) != (0, len(digests) - 1):
            raise _Reject("rejected", f"layers {header.first_layer}-{header.last_layer}, the record lists {len(digests)}")


def _check_layer(layer: DecodedLayer, expect: _Expect) -> None:
    if not expect.check_layers:
        return
    digests = expect.record.layer_digests
    assert digests is not None
    if layer.index >= len(digests) or digests[layer.index] != layer.digest:
        raise _Reject("rejected", f"layer {layer.index} does not match its digest in the record")


#: The module of the MOQT retrieval (DESIGN.md §4; docs/binding.md §5). It defines
#: ``async def retrieve_block(replicas: Sequence[ReplicaRecord]) -> Retrieved`` with the
#: verification of ``client.retrieval.retrieve_block`` (raising ``RetrievalFailed``). It is on the
#: control side, over ``kvsp_moq.bridge.load_block``, because ``Retrieved`` is control's type
#: and the bridge may not import control (tests/test_layering.py). Imported lazily: an
#: instance without the MOQT stack (aioquic) still serves HTTP sources.
BRIDGE_MODULE = "kvsp_moq.control.client.moqt"

MoqtRetriever = Callable[[Sequence[ReplicaRecord]], Awaitable[Retrieved]]


def _bridge_retriever() -> MoqtRetriever | None:
    try:
        module = importlib.import_module(BRIDGE_MODULE)
    except ImportError:
        return None
    return getattr(module, "retrieve_block", None)


async def retrieve_via_moqt(replicas: Sequence[ReplicaRecord], retriever: MoqtRetriever | None = None) -> Retrieved:
    """Retrieve a block from ``moqt://`` replicas through the bridge (hook): the bridge
    module's ``retrieve_block`` when it is importable, else :class:`RetrievalFailed`."""
    retriever = retriever if retriever is not None else _bridge_retriever()
    if retriever is None:
        block_key = replicas[0].block_key if replicas else b""
        raise RetrievalFailed(block_key, None, [Attempt(r.holder, "skipped", f"{BRIDGE_MODULE} is not installed") for r in replicas])
    return await retriever(replicas)
