"""Transcoding at the holder (kvsp-draft §6.7: "The query parameter "codec=n" requests a codec;
a holder MAY transcode"; docs/http-api.md "Holder", docs/container.md "Codecs").

A GET with ``codec=n`` other than the replica's codec is answered with a container in codec
``n`` made from the stored replica: each layer is decoded from its codec into the descriptor's
element type and encoded in ``n`` (:mod:`kvsp_moq.kvsp.codecs`). The transcoded container is
made once per (replica, layer range, codec) and kept for later GETs in a cache bounded in
octets (least recently used first out); concurrent GETs of the same representation wait on
the one transcoding in flight. Its SHA-256 is computed once, for the ``Repr-Digest`` that
protects it (§6.7: "Transcoded representations are protected only by Repr-Digest"); its layer
digests are over its coded sections (§4.3), and a client cannot check them against the
Replica Record, which lists the stored codec's.

The holder needs the geometry (``kv_heads``, ``head_dim``, ``kv_dtype``, §4.1) to decode and
encode: it transcodes only blocks whose Compatibility ID is one of the descriptors in
``[holder] descriptors``; for others (and codecs that refuse the element type) the answer is
404 ``kvsp-layers-unavailable``, as for a codec the holder does not have.

Encoding runs on a worker thread (numpy and zstd release the GIL for most of it), so the
event loop keeps serving other requests meanwhile; at most two transcodings run at once.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ...kvsp.codecs import layer_codec
from ...kvsp.compat import compat_id as compute_compat_id
from ...kvsp.container import encode_container
from ...kvsp.errors import ContainerError
from ...kvsp.layout import Geometry
from ...storage import BlockReader, RecordKey
from ..common.errors import LayersNotHeld

__all__ = ["Transcoded", "Transcoder", "geometries_of"]


@dataclass(frozen=True)
class Transcoded:
    """A container in the requested codec and its SHA-256 (the ``Repr-Digest``, §6.7)."""

    body: bytes
    sha256: bytes
    codec: int


def geometries_of(descriptors: Iterable[Mapping[str, object]]) -> dict[bytes, Geometry]:
    """Compatibility ID -> section geometry of validated descriptor documents (§4.1)."""
    out: dict[bytes, Geometry] = {}
    for doc in descriptors:
        kv_heads, head_dim, kv_dtype = doc["kv_heads"], doc["head_dim"], doc["kv_dtype"]
        assert isinstance(kv_heads, int) and isinstance(head_dim, int) and isinstance(kv_dtype, str)
        out[compute_compat_id(doc)] = Geometry.from_descriptor_fields(kv_heads, head_dim, kv_dtype)
    return out


_CacheKey = tuple[bytes, int, int, int]  # replica id, first layer, last layer, codec


class Transcoder:
    """Transcodes stored replicas into other codecs, once per replica, range and codec."""

    def __init__(self, geometries: Mapping[bytes, Geometry], cache_octets: int, max_running: int = 2) -> None:
        self.geometries = dict(geometries)
        #: Transcodings running at once (each holds a block's decoded layers on a worker
        #: thread): a flood of distinct ``codec=n`` / ``layers`` GETs queues here instead of
        #: taking every core and its memory.
        self._running = asyncio.Semaphore(max_running)
        #: Bound on the cached transcoded containers' octets (0: nothing kept).
        self.cache_octets = cache_octets
        self._cache: OrderedDict[_CacheKey, Transcoded] = OrderedDict()
        self._cached_octets = 0
        self._inflight: dict[_CacheKey, asyncio.Future[Transcoded]] = {}
        #: Transcodings performed (each is one pass over the replica), by target codec value.
        self.transcodes: dict[int, int] = {}
        self.on_transcode: Callable[[int, int], None] | None = None  # (codec, octets)

    def geometry(self, key: RecordKey) -> Geometry:
        """The geometry of ``key``'s compat; ``LayersNotHeld`` when no descriptor names it."""
        geometry = self.geometries.get(key.compat_id)
        if geometry is None:
            raise LayersNotHeld(
                f"this holder does not transcode blocks of compat {key.compat_id.hex()}: "
                "no [holder] descriptors entry has that Compatibility ID")
        return geometry

    async def transcode(self, reader: BlockReader, source_codec: int, codec: int) -> Transcoded:
        """The container of ``reader``'s layers in ``codec``; ``LayersNotHeld`` (404
        ``kvsp-layers-unavailable``) when the codec or the geometry does not allow it."""
        geometry = self.geometry(reader.key)
        try:
            layer_codec(codec)
        except ContainerError:
            raise LayersNotHeld(f"codec {codec} is not a registered codec this holder has") from None
        cache_key = (reader.replica_id, reader.first_layer, reader.last_layer, codec)
        hit = self._cache.get(cache_key)
        if hit is not None:
            self._cache.move_to_end(cache_key)
            return hit
        pending = self._inflight.get(cache_key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Transcoded] = asyncio.get_running_loop().create_future()
        self._inflight[cache_key] = future
        try:
            async with self._running:
                result = await asyncio.to_thread(_transcode, reader, source_codec, codec, geometry)
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, Exception) else RuntimeError("cancelled"))
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        else:
            future.set_result(result)
            self.transcodes[codec] = self.transcodes.get(codec, 0) + 1
            if self.on_transcode is not None:
                self.on_transcode(codec, len(result.body))
            self._keep(cache_key, result)
            return result
        finally:
            del self._inflight[cache_key]

    def _keep(self, cache_key: _CacheKey, result: Transcoded) -> None:
        size = len(result.body)
        if size > self.cache_octets:
            return
        self._cache[cache_key] = result
        self._cached_octets += size
        while self._cached_octets > self.cache_octets:
            _, old = self._cache.popitem(last=False)
            self._cached_octets -= len(old.body)


def _transcode(reader: BlockReader, source_codec: int, codec: int, geometry: Geometry) -> Transcoded:
    """Decode every layer from ``source_codec`` and encode it in ``codec`` (worker thread)."""
    source, target = layer_codec(source_codec), layer_codec(codec)
    tokens = reader.header.token_count
    sections = []
    try:
        for (_, payload), (k_len, v_len) in zip(reader.layer_payloads(), reader.header.lengths, strict=True):
            k, v = source.decode_layer(payload[:k_len], payload[k_len:k_len + v_len], geometry, tokens)
            sections.append(target.encode_layer(k, v, geometry, tokens))
    except ContainerError as exc:
        raise LayersNotHeld(f"codec {codec} is not available for this replica: {exc}") from None
    body = encode_container(codec, reader.first_layer, tokens, sections)
    return Transcoded(body, hashlib.sha256(body).digest(), codec)
