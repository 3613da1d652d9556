"""The layer sink contract: receive a block's layers straight into preallocated buffers,
verify each against its layer digest, and hand verified layers to compute one by one.

Binding v1 (DESIGN.md §4): one MOQT object per layer, Object ID = layer index, payload = the
layer's K section followed by its V section (kvsp-layout-1, kvsp-draft §4.3), so
SHA-256(payload) is the layer digest. The expected digests come from the Replica Record
(``layer_digests``, layer ``l`` at index ``l``) or from the track properties.

Transport side, per layer ``l`` (all calls on the event-loop thread; sinks are not thread-safe)::

    dest = sink.begin_layer(l, length)   # writable memoryview of exactly `length` octets
    sink.feed(l, chunk)                  # either: the sink copies the chunk in and hashes it
    sink.chunk_written(l, n)             # or: the transport wrote n octets into dest itself
    sink.end_layer(l)                    # finish the hash, verify, publish -> True / False
    await sink.end_layer_async(l)        # the same, awaiting a digest computed off the loop
    sink.abort(l, reason)                # the delivery is gone (stream reset, fetch error)

Consumer side: ``await sink.wait_for_layer(l)`` returns the layer's (K, V) once it is verified
and usable, so compute on layer ``l`` starts while ``l + 1`` is still in flight (§4.3: a
receiver can start using layer ``l`` as soon as it has been received), or raises
:class:`LayerFailed`. ``missing_layers()`` lists what to recompute.

Rules (docs/sinks.md):

- a layer is exposed only after its digest matched; the octets of a failed layer are never
  reachable through :meth:`LayerSink.layer` / :meth:`LayerSink.wait_for_layer`;
- layers may arrive in any order and several may be in flight at once (a FETCH delivers a
  range in ascending order, but a retry from another source can re-deliver a layer later);
- a failed layer may be delivered again (``begin_layer`` on a failed layer starts over;
  ``retry`` first, to let waiters wait for that delivery); a verified layer is final: a
  second delivery is a :class:`SinkError`.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Generic, TypeVar

from ..kvsp.container import DIGEST_SIZE
from ..kvsp.layout import Geometry
from ._reception import HashFactory, Reception, hash_worker
from .errors import LayerFailed, SinkError

__all__ = ["Digests", "LayerSink", "LayerState"]

KV = TypeVar("KV")

#: Expected layer digests: a sequence indexed by absolute layer (the Replica Record's
#: ``layer_digests``, §4.4) or a mapping from absolute layer to digest. Each is 32 octets,
#: or ``None`` for a layer of a block still being computed whose digest is announced later
#: (:meth:`LayerSink.set_expected_digest`; binding v1 per-object digest property).
Digests = Sequence[bytes | None] | Mapping[int, bytes | None]

_UINT32_LIMIT = 1 << 32

#: Default of ``hash_offload_bytes``: None, every layer is hashed on the event loop's thread,
#: per chunk as it lands. Measured (docs/perf/README.md): with a CPU-bound receive loop on a
#: 2-core host, handing 256 KiB batches to the hash worker made block loads slower (the
#: worker waits for the GIL up to the switch interval after each batch, and competes with the
#: sender for the cores); set it (e.g. 1 MiB) on hosts with idle cores.
DEFAULT_HASH_OFFLOAD_BYTES: int | None = None


class LayerState(enum.Enum):
    EXPECTED = "expected"  # nothing received yet (its destination may be handed out ahead)
    RECEIVING = "receiving"  # begin_layer was called; octets are arriving
    READY = "ready"  # digest verified; the layer is usable (final)
    FAILED = "failed"  # digest mismatch, truncation, bad length or abort; may be re-delivered


@dataclass(slots=True)
class _Layer:
    index: int
    digest: bytes | None  # None: not announced yet (no delivery can begin)
    state: LayerState = LayerState.EXPECTED
    reception: Reception | None = None
    reason: str | None = None
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(layers: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(layers, tuple)
        or len(layers) != 2
        or not all(_is_int(x) for x in layers)
        or not 0 <= layers[0] <= layers[1] < _UINT32_LIMIT
    ):
        raise SinkError(f"layers must be an inclusive range (first, last) of uint32, got {layers!r}")
    return layers


def _check_digest(layer: int, digest: object) -> bytes:
    if not isinstance(digest, (bytes, bytearray)) or len(digest) != DIGEST_SIZE:
        raise SinkError(f"digest of layer {layer} is not {DIGEST_SIZE} octets: {digest!r}")
    return bytes(digest)


def _expected_digests(digests: Digests, first: int, last: int) -> list[bytes | None]:
    """The digest of every layer first..last from a record-style sequence or a mapping
    (``None``: announced later)."""
    out: list[bytes | None] = []
    for layer in range(first, last + 1):
        try:
            digest = digests[layer]  # a Replica Record lists layer l at index l (§4.4)
        except (KeyError, IndexError):
            raise SinkError(f"no expected digest for layer {layer}") from None
        out.append(None if digest is None else _check_digest(layer, digest))
    return out


class LayerSink(ABC, Generic[KV]):
    """Receives layers ``first..last`` of one block (``tokens`` tokens of ``geometry``).

    Subclasses own the memory: :meth:`_acquire` hands out the destination of a delivery,
    :meth:`_publish` makes a verified layer usable, :meth:`_release` takes a destination back
    after a failure, :meth:`_view` builds the consumer's (K, V).
    """

    def __init__(
        self,
        geometry: Geometry,
        tokens: int,
        layers: tuple[int, int],
        digests: Digests,
        *,
        hash_factory: HashFactory = sha256,
        hash_offload_bytes: int | None = DEFAULT_HASH_OFFLOAD_BYTES,
    ) -> None:
        """``hash_offload_bytes``: layers of at least this size are hashed on the process's
        hash worker thread (in parallel with the event loop; DESIGN.md §6); None: always on
        the caller's thread."""
        if not isinstance(geometry, Geometry):
            raise SinkError(f"geometry must be a kvsp.layout.Geometry, got {geometry!r}")
        if not _is_int(tokens) or tokens < 0:
            raise SinkError(f"tokens must be an integer >= 0, got {tokens!r}")
        self.geometry = geometry
        self.tokens = tokens
        self.first_layer, self.last_layer = _check_range(layers)
        # kvsp-layout-1 (§4.3): K and V each hold tokens x kv_heads x head_dim elements.
        self.section_bytes = geometry.section_bytes(tokens)
        self.payload_bytes = 2 * self.section_bytes  # binding v1: payload = K || V
        expected = _expected_digests(digests, self.first_layer, self.last_layer)
        self._layers = [_Layer(self.first_layer + i, d) for i, d in enumerate(expected)]
        self._hash_factory = hash_factory
        self._offload = hash_offload_bytes
        self._aborted: str | None = None

    # -- description ----------------------------------------------------------------------

    @property
    def layer_count(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def layer_range(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    def expected_digest(self, layer: int) -> bytes | None:
        """The digest ``layer`` is verified against (None: not announced yet)."""
        return self._slot(layer).digest

    def set_expected_digest(self, layer: int, digest: bytes) -> None:
        """Announce the digest of a layer constructed with ``None`` (a block still being
        computed: binding v1 carries each layer's digest in its object). Setting the same
        digest again is a no-op; SinkError for another digest (a digest never changes once
        announced) or a malformed one."""
        slot = self._slot(layer)
        digest = _check_digest(layer, digest)
        if slot.digest is None:
            slot.digest = digest
        elif slot.digest != digest:
            raise SinkError(f"layer {layer}: expected digest already set to another value")

    # -- transport side ---------------------------------------------------------------------

    def begin_layer(self, layer: int, length: int, *, digest_later: bool = False,
                    ahead: bool = False) -> memoryview:
        """Start a delivery of ``layer`` whose payload is ``length`` octets; return where the
        payload goes (a writable flat memoryview of exactly ``length`` octets).

        ``ahead``: the destination is handed out before the object exists (the native data
        plane registers a SUBSCRIBE's live layers before their producer wrote them): the layer
        stays EXPECTED ("nothing received yet") until :meth:`land_verified` settles it, and
        :meth:`delivering` says its destination is taken (no other delivery may begin).

        SinkError: the sink was aborted, ``layer`` is outside the range, the layer is already
        verified or being delivered, no expected digest is known (unless ``digest_later``: the
        native data plane hands out destinations before the objects, and their LAYER_DIGEST,
        arrive; :meth:`set_expected_digest` must come before :meth:`land_verified`, or the
        layer fails), or ``length`` is not 2 x the section size (the layer is then marked
        failed: this source cannot deliver it).
        """
        if self._aborted is not None:
            raise SinkError(f"layer {layer}: the sink was aborted ({self._aborted})")
        slot = self._slot(layer)
        if slot.state is LayerState.READY:
            raise SinkError(f"layer {layer} was already received and verified")
        if slot.reception is not None:
            raise SinkError(f"layer {layer} is already being received")
        if slot.digest is None and not digest_later:
            raise SinkError(f"layer {layer}: no expected digest announced (set_expected_digest)")
        if length != self.payload_bytes:
            reason = (
                f"payload length {length!r} != {self.payload_bytes} "
                f"(K || V of {self.tokens} tokens, kvsp-layout-1)"
            )
            self._fail(slot, reason)
            raise SinkError(f"layer {layer}: {reason}")
        dest = self._acquire(layer - self.first_layer)
        assert dest.nbytes == length and not dest.readonly
        worker = hash_worker() if self._offload is not None and length >= self._offload else None
        slot.reception = Reception(layer, dest, self._hash_factory, worker=worker)
        slot.state = LayerState.EXPECTED if ahead else LayerState.RECEIVING
        slot.reason = None
        return dest

    def feed(self, layer: int, chunk: bytes | bytearray | memoryview) -> None:
        """Copy the next ``chunk`` of ``layer``'s payload into place and hash it. Too many
        octets fail the layer and raise SinkError."""
        reception = self._receiving(layer)
        view = memoryview(chunk)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")  # flat octets (C-contiguous buffers of any format)
        try:
            reception.feed(view)
        except SinkError as exc:
            self._fail(self._slot(layer), str(exc))
            raise

    def chunk_written(self, layer: int, n: int) -> None:
        """The transport wrote the next ``n`` octets into the destination itself; they are
        hashed now (incremental SHA-256). Too many octets fail the layer and raise SinkError."""
        reception = self._receiving(layer)
        try:
            reception.advance(n)
        except SinkError as exc:
            self._fail(self._slot(layer), str(exc))
            raise

    def end_layer(self, layer: int) -> bool:
        """The payload of ``layer`` is complete: finish its digest and compare (§4.3).

        True: verified and published (waiters resume). False: the layer failed (digest
        mismatch or truncation); its octets are never exposed and it may be delivered again.
        """
        slot = self._slot(layer)
        reception = self._receiving(layer)
        try:
            digest = reception.finish()
        except SinkError as exc:
            self._fail(slot, str(exc))
            return False
        return self._settle(slot, layer, digest)

    async def end_layer_async(self, layer: int) -> bool:
        """:meth:`end_layer` for a layer hashed off the loop: awaits the hash worker's last
        update instead of blocking the event loop on it. False also when the delivery was
        aborted or failed meanwhile."""
        reception = self._receiving(layer)
        pending = reception.flush()
        if pending is not None and not pending.done():
            await asyncio.wrap_future(pending)
        if self._slot(layer).reception is not reception:
            return False  # aborted (or failed) while the digest was being computed
        return self.end_layer(layer)

    def destinations_at_once(self) -> bool:
        """Whether :meth:`begin_layer` can hand out every layer's destination at once, before
        any octet arrives (the native data plane registers them before its FETCH leaves,
        DESIGN.md §6): True where each layer has CPU memory of its own; a sink that stages
        through a bounded ring of slots says False."""
        return True

    def land_verified(self, layer: int, digest: bytes) -> bool:
        """The transport wrote the whole payload of a delivery begun with :meth:`begin_layer`
        into its destination and computed its SHA-256 while the octets landed (the native data
        plane: the same one pass over the same octets :meth:`chunk_written` would make).
        Compare with the expected digest (§4.3) and publish, as :meth:`end_layer` does: True
        verified, False failed (its octets are never exposed). A delivery begun ``ahead``
        goes from EXPECTED to READY or FAILED here."""
        slot = self._slot(layer)
        if slot.reception is None:
            raise SinkError(f"layer {layer} is not being received ({slot.state.value})")
        return self._settle(slot, layer, bytes(digest))

    def _settle(self, slot: _Layer, layer: int, digest: bytes) -> bool:
        """A delivery whose digest is known: compare it with the expected one (§4.3) and
        publish the layer (True), or fail it, its octets never exposed (False)."""
        if slot.digest is None:  # begun with digest_later, and none was announced
            self._fail(slot, "no expected digest announced: the layer cannot be verified")
            return False
        if digest != slot.digest:
            self._fail(
                slot, f"digest mismatch: received {digest.hex()}, expected {slot.digest.hex()}"
            )
            return False
        slot.reception = None
        try:
            self._publish(layer - self.first_layer)
        except Exception as exc:
            self._fail(slot, f"could not publish the layer: {exc!r}")
            raise
        slot.state = LayerState.READY
        self._wake(slot, None)
        return True

    def accept_verified(self, layer: int, digest: bytes) -> None:
        """A delivery of ``layer`` was written into this sink's memory by another process and
        verified there (a worker of a parallel load, ``kvsp_moq.bridge.parallel``: it received
        the payload into a view of this sink's shared storage and computed its SHA-256 as the
        octets landed, DESIGN.md §6). ``digest`` is the digest that process computed; it must
        equal the expected one (kvsp-draft §4.3), else the layer fails and SinkError is
        raised. The layer becomes usable at once (waiters resume); the writer has already
        published it in place, so :meth:`_publish` is not called again (CPU memory only).

        SinkError also for a layer being received here, already verified, without an
        expected digest, or after :meth:`abort_all`."""
        if self._aborted is not None:
            raise SinkError(f"layer {layer}: the sink was aborted ({self._aborted})")
        slot = self._slot(layer)
        if slot.state is LayerState.READY or slot.reception is not None:
            raise SinkError(f"layer {layer} is {_busy(slot)}: it cannot be accepted")
        if slot.digest is None:
            raise SinkError(f"layer {layer}: no expected digest announced (set_expected_digest)")
        if _check_digest(layer, digest) != slot.digest:
            reason = (f"digest mismatch: the worker computed {bytes(digest).hex()}, "
                      f"expected {slot.digest.hex()}")
            self._fail(slot, reason)
            raise SinkError(f"layer {layer}: {reason}")
        slot.state = LayerState.READY
        slot.reason = None
        self._wake(slot, None)

    def abort(self, layer: int, reason: str) -> None:
        """The delivery of ``layer`` will not complete (or will not happen): fail it, so that
        waiters learn it and :meth:`missing_layers` lists it. No-op on a verified layer and on
        a layer that already failed (its first reason is kept)."""
        slot = self._slot(layer)
        if slot.state is LayerState.EXPECTED or slot.state is LayerState.RECEIVING:
            self._fail(slot, reason)

    def retry(self, layer: int) -> None:
        """Announce a new delivery of a failed layer (from another source): it goes back to
        expected, so that :meth:`wait_for_layer` waits for that delivery instead of raising.
        (``begin_layer`` on a failed layer also starts a new delivery; ``retry`` lets waiters
        wait before it begins.) No-op on an expected layer; SinkError on a verified or
        layer being delivered (:meth:`delivering`), or after :meth:`abort_all`."""
        if self._aborted is not None:
            raise SinkError(f"layer {layer}: the sink was aborted ({self._aborted})")
        slot = self._slot(layer)
        if slot.state is LayerState.READY or slot.reception is not None:
            raise SinkError(f"layer {layer} is {_busy(slot)}: nothing to retry")
        slot.state = LayerState.EXPECTED
        slot.reason = None

    def abort_all(self, reason: str) -> None:
        """Stop receiving: every layer not yet verified fails and no delivery starts again.
        Verified layers stay usable."""
        if self._aborted is None:
            self._aborted = reason
        for slot in self._layers:
            if slot.state in (LayerState.EXPECTED, LayerState.RECEIVING):
                self._fail(slot, f"sink aborted: {reason}")

    # -- consumer side ----------------------------------------------------------------------

    def state(self, layer: int) -> LayerState:
        return self._slot(layer).state

    def delivering(self, layer: int) -> bool:
        """Whether a delivery of ``layer`` has begun and not ended: RECEIVING, or EXPECTED
        with its destination handed out ahead (``begin_layer(..., ahead=True)``). Such a layer
        belongs to that delivery: a second one is refused, and only its end settles it."""
        return self._slot(layer).reception is not None

    def failure_reason(self, layer: int) -> str | None:
        """Why ``layer`` failed (None unless it is failed)."""
        slot = self._slot(layer)
        return slot.reason if slot.state is LayerState.FAILED else None

    def layers_in(self, state: LayerState) -> tuple[int, ...]:
        """The layers in ``state``, ascending."""
        return tuple(s.index for s in self._layers if s.state is state)

    @property
    def ready_layers(self) -> tuple[int, ...]:
        """Verified layers, ascending."""
        return self.layers_in(LayerState.READY)

    @property
    def failed_layers(self) -> tuple[int, ...]:
        """Failed layers, ascending (see :meth:`failure_reason`)."""
        return self.layers_in(LayerState.FAILED)

    @property
    def aborted(self) -> str | None:
        """The reason given to :meth:`abort_all`, or None."""
        return self._aborted

    @property
    def complete(self) -> bool:
        return all(s.state is LayerState.READY for s in self._layers)

    def missing_layers(self) -> tuple[int, ...]:
        """Layers not verified (yet): expected, in flight or failed, ascending. After the
        transfer has ended, what the engine recomputes."""
        return tuple(s.index for s in self._layers if s.state is not LayerState.READY)

    def layer(self, layer: int) -> KV:
        """(K, V) of a verified layer. LayerFailed if it failed, SinkError if not ready yet."""
        slot = self._slot(layer)
        if slot.state is LayerState.READY:
            return self._view(layer - self.first_layer)
        if slot.state is LayerState.FAILED:
            raise LayerFailed(layer, slot.reason or "failed")
        raise SinkError(f"layer {layer} is not ready ({slot.state.value})")

    async def wait_for_layer(self, layer: int) -> KV:
        """Wait until ``layer`` is verified; return its (K, V) as :meth:`layer` does.

        LayerFailed when the layer is failed now, or fails (or the sink is aborted) while
        waiting. A waiter registered before a failure sees that failure even if a re-delivery
        starts right after it.
        """
        slot = self._slot(layer)
        if slot.state is LayerState.EXPECTED or slot.state is LayerState.RECEIVING:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            slot.waiters.append(future)
            try:
                await future  # resolved by end_layer / abort, never by polling
            finally:
                if future in slot.waiters:
                    slot.waiters.remove(future)
        return self.layer(layer)  # READY: the view; FAILED: LayerFailed

    async def ascending(self) -> AsyncIterator[tuple[int, KV]]:
        """Yield (layer, (K, V)) in ascending layer order as each becomes ready (the order an
        engine loads a prefix, DESIGN.md §1); LayerFailed at the first failed layer."""
        for layer in self.layer_range:
            yield layer, await self.wait_for_layer(layer)

    # -- subclass hooks ---------------------------------------------------------------------

    @abstractmethod
    def _acquire(self, position: int) -> memoryview:
        """Writable flat ``uint8`` memoryview of exactly :attr:`payload_bytes` octets where the
        payload of the layer at ``position`` (0-based in the range) is received."""

    @abstractmethod
    def _publish(self, position: int) -> None:
        """The layer's payload is verified: make it usable (CUDA: enqueue the copy)."""

    def _release(self, position: int) -> None:
        """The delivery at ``position`` failed: take its destination back."""

    @abstractmethod
    def _view(self, position: int) -> KV:
        """The consumer's (K, V) of a verified layer."""

    # -- internals --------------------------------------------------------------------------

    def _slot(self, layer: int) -> _Layer:
        if not _is_int(layer) or not self.first_layer <= layer <= self.last_layer:
            raise SinkError(
                f"layer {layer!r} is outside this sink's range "
                f"{self.first_layer}-{self.last_layer}"
            )
        return self._layers[layer - self.first_layer]

    def _receiving(self, layer: int) -> Reception:
        slot = self._slot(layer)
        if slot.state is not LayerState.RECEIVING or slot.reception is None:
            raise SinkError(f"layer {layer} is not being received ({slot.state.value})")
        return slot.reception

    def _fail(self, slot: _Layer, reason: str) -> None:
        if slot.reception is not None:  # a delivery in progress (RECEIVING, or ahead)
            self._release(slot.index - self.first_layer)
        slot.reception = None
        slot.state = LayerState.FAILED
        slot.reason = reason
        self._wake(slot, LayerFailed(slot.index, reason))

    @staticmethod
    def _wake(slot: _Layer, error: LayerFailed | None) -> None:
        waiters, slot.waiters = slot.waiters, []
        for future in waiters:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(LayerFailed(error.layer, error.reason))


def _busy(slot: _Layer) -> str:
    """How a layer that cannot take another delivery reads in an error message."""
    if slot.state is LayerState.EXPECTED and slot.reception is not None:
        return "expected, its destination handed out ahead"
    return slot.state.value
