"""KVSP codecs over MOQT: the relay's edge transcoder and the consumer's verified load of a
coded track (docs/binding.md §13, docs/relay.md "Transcoding").

Binding v1: the track name is the codec's registry name, another codec of a replica is
another track of its namespace. A consumer asks for a codec by FETCHing that track (or
SUBSCRIBing to it, a block still being computed: :func:`subscribed_coded_layers`);
:class:`KvspTranscoder` is what a relay (``relay.transcode``, ``RelayConfig.transcoder``) is
given to make it from the replica's ``raw`` track, once, for every later subscriber.

Coded object payloads are as raw's: the layer's K section followed by its V section, here in
the codec's section encoding (docs/container.md "Codecs"); only codecs whose section size the
geometry fixes (``fp8-e4m3``, ``int8``) are made, so a consumer splits the payload in two
halves as for raw. The relay declares the SHA-256 of each coded payload (LAYER_DIGESTS of the
coded track, LAYER_DIGEST of each object): :func:`coded_layers` checks every object
against both before it decodes it, and yields each layer as soon as it is decoded.

The transcoder needs each compat's geometry (§4.1 ``kv_heads``, ``head_dim``, ``kv_dtype``):
it makes tracks only for the Compatibility IDs of the descriptors it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
from pathlib import Path
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kvsp.codecs import coded_section_bytes, decode_layer, encode_layer, layer_codec
from ..kvsp.compat import compat_id, validate_descriptor
from ..kvsp.errors import ContainerError, NamingError
from ..kvsp.layout import Geometry
from ..kvsp.naming import BlockName
from ..kvsp.registries import CODEC_RAW, CODECS_BY_NAME
from ..moqt.messages import LocationFilter, LocationFilterType, MessageParameters, SubscribeOk
from ..pubsub import MoqtSession
from ..pubsub.receive import Subscription
from .binding import BLOCK_GROUP, BindingError, TrackInfo, layer_digest_of

__all__ = ["CodedLayer", "KvspTranscoder", "coded_layers", "fetch_coded_layers", "from_descriptor_files", "from_descriptors",
           "streamed_coded_layers", "subscribed_coded_layers"]

RAW = CODEC_RAW.name.encode()


class KvspTranscoder:
    """Makes the ``fp8-e4m3`` / ``int8`` track of a replica from its ``raw`` track
    (``relay.transcode.Transcoder``)."""

    def __init__(self, geometries: Mapping[bytes, Geometry]) -> None:
        self.geometries = dict(geometries)

    def _geometry(self, namespace: tuple[bytes, ...]) -> Geometry | None:
        try:
            name = BlockName.from_fields(namespace)
        except NamingError:
            return None
        return self.geometries.get(name.compat_id)

    def source_track(self, namespace: tuple[bytes, ...], track_name: bytes) -> bytes | None:
        codec = CODECS_BY_NAME.get(track_name.decode("ascii", "replace"))
        geometry = self._geometry(namespace)
        if codec is None or codec.value == CODEC_RAW.value or geometry is None:
            return None
        if coded_section_bytes(codec, geometry, 1) is None:
            return None  # a content-sized section (zstd-planes): no K/V split in the payload
        return RAW

    def transcode(self, namespace: tuple[bytes, ...], track_name: bytes,
                  source_properties: tuple[tuple[int, int | bytes], ...], payloads: Sequence[bytes]) -> list[bytes]:
        geometry = self._geometry(namespace)
        if geometry is None:
            raise ValueError("no geometry for this namespace")
        try:
            tokens = TrackInfo.parse(source_properties).token_count
        except BindingError as exc:
            raise ValueError(str(exc)) from None
        section = geometry.section_bytes(tokens)
        codec = track_name.decode("ascii")
        out = []
        for payload in payloads:
            if len(payload) != 2 * section:
                raise ValueError(f"a raw payload of {len(payload)} octets, not 2 x {section}")
            try:
                k, v = decode_layer("raw", payload[:section], payload[section:], geometry, tokens)
                ks, vs = encode_layer(codec, k, v, geometry, tokens)
            except ContainerError as exc:
                raise ValueError(str(exc)) from None
            out.append(bytes(ks) + bytes(vs))
        return out


def from_descriptors(descriptors: Iterable[Mapping[str, Any]]) -> KvspTranscoder:
    """A transcoder for the compats of validated descriptor documents (§4.1)."""
    return KvspTranscoder({compat_id(d): Geometry.from_descriptor_fields(d["kv_heads"], d["head_dim"], d["kv_dtype"])
                           for d in descriptors})


def from_descriptor_files(paths: Iterable[str]) -> KvspTranscoder:
    """``python -m relay --transcode-descriptor FILE``: descriptor files (JSON, §4.1),
    validated; ``DescriptorError`` naming the member at fault."""
    return from_descriptors(validate_descriptor(json.loads(Path(p).read_bytes())).document for p in paths)


@dataclass(frozen=True)
class CodedLayer:
    """One layer of a coded track, checked and decoded (:func:`coded_layers`)."""

    index: int
    k: np.ndarray
    v: np.ndarray
    #: Octets of the coded payload (what crossed the wire).
    coded_octets: int


async def coded_layers(session: MoqtSession, name: BlockName, codec: str, geometry: Geometry,
                       first: int, last: int, *, timeout: float = 30.0,
                       decode: Callable[[Callable[[], tuple[np.ndarray, np.ndarray]]],
                                        Awaitable[tuple[np.ndarray, np.ndarray]]] | None = None,
                       ) -> AsyncGenerator[CodedLayer, None]:
    """FETCH layers ``first..last`` of the replica ``name`` in ``codec`` (binding v1: the
    track of that name, made by a transcoding relay, docs/binding.md §13) and yield each one,
    in ascending order, as soon as it is checked and decoded to the geometry's element type.
    Every object must hash to its entry of the FETCH_OK's LAYER_DIGESTS and to its own
    LAYER_DIGEST property; ``BindingError`` naming the layer otherwise (a flipped coded
    octet), when the track declares no digests to check against, when a layer is missing or
    out of order, or when a payload is not two sections of the codec. The whole FETCH is
    bounded by ``timeout``.

    ``decode`` runs each layer's check and decoding (e.g. on a worker thread) while the next
    objects are read: the layers are pipelined, never reordered (at most the requested range
    is held). Default: inline, one object at a time."""
    entry = layer_codec(codec).codec
    async with asyncio.timeout(timeout):
        stream = await session.fetch(name.namespace_fields(), entry.name, start=(BLOCK_GROUP, first),
                                     end=(BLOCK_GROUP, last))
        info = TrackInfo.parse(stream.response.track_properties)  # type: ignore[union-attr]
        digests = info.layer_digests
        if digests is None:
            raise BindingError(f"the {codec} track declares no LAYER_DIGESTS to verify its layers with")
        section = coded_section_bytes(entry, geometry, info.token_count)
        if section is None:
            raise BindingError(f"{codec} sections are content-sized: no coded track carries them")

        def checked(index: int, payload: bytes, declared: bytes | None) -> tuple[np.ndarray, np.ndarray]:
            digest = hashlib.sha256(payload).digest()
            if digest != digests.get(index) or digest != declared:
                raise BindingError(f"layer {index}: digest mismatch")
            return decode_layer(entry, payload[:section], payload[section:], geometry, info.token_count)

        # One reader puts each object's check-and-decode in order (a future, or the error that
        # ended the FETCH); the generator yields them as they complete.
        queue: asyncio.Queue[tuple[int, int, asyncio.Future[tuple[np.ndarray, np.ndarray]]] | BaseException | None] \
            = asyncio.Queue()

        async def read() -> None:
            expected = first
            try:
                async for obj in stream:
                    if obj.object_id != expected or obj.object_id > last:
                        raise BindingError(f"layer {obj.object_id} where layer {expected} was due")
                    payload = bytes(obj.payload)
                    if len(payload) != 2 * section:
                        raise BindingError(f"layer {obj.object_id}: {len(payload)} octets, not two {codec} sections")
                    run = functools.partial(checked, obj.object_id, payload, layer_digest_of(obj.properties))
                    if decode is None:
                        done: asyncio.Future[tuple[np.ndarray, np.ndarray]] = asyncio.get_running_loop().create_future()
                        done.set_result(run())
                    else:
                        done = asyncio.ensure_future(decode(run))
                    queue.put_nowait((obj.object_id, len(payload), done))
                    expected += 1
                    if decode is None:
                        await queue.join()  # inline: one object at a time
                if expected != last + 1:
                    raise BindingError(f"{expected - first} layers of {last - first + 1}")
                queue.put_nowait(None)
            except Exception as exc:  # ends the FETCH: the consumer raises it in order
                queue.put_nowait(exc)

        reader = asyncio.ensure_future(read())
        pending: list[asyncio.Future[tuple[np.ndarray, np.ndarray]]] = []
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                index, octets, done = item
                pending.append(done)
                k, v = await done
                queue.task_done()
                yield CodedLayer(index, k, v, octets)
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            while not queue.empty():
                left = queue.get_nowait()
                if isinstance(left, tuple):
                    pending.append(left[2])
            for future in pending:
                if not future.done():
                    future.cancel()


async def fetch_coded_layers(session: MoqtSession, name: BlockName, codec: str, geometry: Geometry,
                             first: int, last: int, *, timeout: float = 30.0
                             ) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`coded_layers`, all of them: (K, V) of layers ``first..last`` in order."""
    return [(layer.k, layer.v) async for layer in
            coded_layers(session, name, codec, geometry, first, last, timeout=timeout)]


async def subscribed_coded_layers(sub: Subscription, codec: str, geometry: Geometry, first: int, last: int, *,
                                  timeout: float = 30.0,
                                  decode: Callable[[Callable[[], tuple[np.ndarray, np.ndarray]]],
                                                   Awaitable[tuple[np.ndarray, np.ndarray]]] | None = None,
                                  ) -> AsyncGenerator[CodedLayer, None]:
    """Layers ``first..last`` of ``sub``, an accepted SUBSCRIBE of a replica's ``codec`` track
    (a block still being computed, binding §6.1; a transcoding relay codes each layer as it
    arrives, docs/binding.md §13), in order, each yielded as soon as it arrived, matched the
    LAYER_DIGEST Object Property the relay computed (no coded LAYER_DIGESTS are declared while
    the block is computed) and was decoded. ``BindingError`` naming the layer when an object
    has no digest or does not match it, is out of order or is not two sections of the codec,
    and when the subscription ends before ``last`` (with its PUBLISH_DONE reason); bounded by
    ``timeout``; the subscription is cancelled when the generator ends. Layers before the
    subscription began are not in it: FETCH them (:func:`coded_layers`). ``decode`` runs each
    layer's decoding (e.g. ``asyncio.to_thread``); default: inline."""
    entry = layer_codec(codec).codec
    try:
        async with asyncio.timeout(timeout):
            info = TrackInfo.parse(sub.response.track_properties)  # type: ignore[union-attr]
            section = coded_section_bytes(entry, geometry, info.token_count)
            if section is None:
                raise BindingError(f"{codec} sections are content-sized: no coded track carries them")
            expected = first
            async for obj in sub:
                if obj.object_id < first:
                    continue  # before the range asked for
                if obj.object_id != expected:
                    raise BindingError(f"layer {obj.object_id} where layer {expected} was due")
                payload = bytes(obj.payload)
                if len(payload) != 2 * section:
                    raise BindingError(f"layer {expected}: {len(payload)} octets, not two {codec} sections")
                declared = layer_digest_of(obj.properties)
                if declared is None or hashlib.sha256(payload).digest() != declared:
                    raise BindingError(f"layer {expected}: digest mismatch")
                run = functools.partial(decode_layer, entry, payload[:section], payload[section:], geometry,
                                        info.token_count)
                k, v = run() if decode is None else await decode(run)
                yield CodedLayer(expected, k, v, len(payload))
                if expected == last:
                    return
                expected += 1
            done = sub.publish_done
            raise BindingError(f"the {codec} subscription ended before layer {expected}"
                               + (f": {done.error_reason}" if done is not None and done.error_reason else ""))
    finally:
        await sub.cancel()


async def streamed_coded_layers(session: MoqtSession, name: BlockName, codec: str, geometry: Geometry,
                                first: int, last: int, *, timeout: float = 30.0, rendezvous_ms: int = 0,
                                decode: Callable[[Callable[[], tuple[np.ndarray, np.ndarray]]],
                                                 Awaitable[tuple[np.ndarray, np.ndarray]]] | None = None,
                                ) -> AsyncGenerator[CodedLayer, None]:
    """SUBSCRIBE (from the next object, ``rendezvous_ms``: RENDEZVOUS_TIMEOUT) to the replica
    ``name`` in ``codec`` and yield its layers ``first..last`` as
    :func:`subscribed_coded_layers` does, all bounded by ``timeout``. ``BindingError`` when the
    producer had begun (the SUBSCRIBE_OK names a Largest Object): the layers before it are not
    in the subscription (the raw path FETCHes them)."""
    async with asyncio.timeout(timeout):
        sub = await session.subscribe(name.namespace_fields(), layer_codec(codec).codec.name,
                                      parameters=MessageParameters(
                                          location_filter=LocationFilter(LocationFilterType.NEXT_OBJECT),
                                          rendezvous_timeout=rendezvous_ms or None))
    largest = sub.response.parameters.largest_object if isinstance(sub.response, SubscribeOk) else None
    if largest is not None and largest.object >= first:
        await sub.cancel()
        raise BindingError(f"the producer had begun (layer {largest.object}): a subscription does not carry it")
    async with contextlib.aclosing(subscribed_coded_layers(sub, codec, geometry, first, last, timeout=timeout,
                                                           decode=decode)) as layers:
        async for layer in layers:
            yield layer
