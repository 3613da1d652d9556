"""Landing a fetched block straight in a store (binding v1 §4, §5; DESIGN.md §6).

:class:`StoreLanding` is a :class:`~kvsp_moq.sinks.LayerSink` whose memory is the replica a
:class:`~kvsp_moq.storage.BlockWriter` is filling: each layer's payload (K || V, binding §2) is
received from the QUIC buffer into the tier's own buffer (``BlockWriter.landing_view``),
hashed as its octets land, verified against the Replica Record's layer digest, and committed
with that digest (``BlockWriter.commit_layer``): one copy and one SHA-256 pass per octet, no
container built, nothing hashed again. A tier without a writable view (disk, accelerator
memory) gets a staging buffer of the layer's size, copied once into place on commit.

What it allocates comes from the record only (DESIGN.md: what a peer declares never sizes an
allocation): ``size`` and ``layer_digests`` give the layer count L and the section size S
(``size`` = 20 + 16·L + 2·L·S for codec raw, §4.3), so every payload is 2·S octets and a
source sending another Payload Length is refused. The Token Count is not in the record: it is
read from the Track Properties of the FETCH_OK itself (binding §3.2 TOKEN_COUNT), which arrive
with the first answer, so no TRACK_STATUS round trip precedes the FETCH. The replica is begun
in the store when FETCH_OK is dispatched (:meth:`on_response`, before the objects read behind
it); an object that overtakes its FETCH_OK (another QUIC stream) lands in a staging buffer
and is committed once the writer exists.

FETCH_OK must agree with the record (:func:`track_problem`): FIRST_LAYER 0, LAYER_COUNT L,
LAYER_DIGESTS (when sent) equal to the record's, and a Token Count that divides S. Otherwise
the source lies about the replica or serves another one: the landing is aborted (its objects
are refused) and the source rejected.
"""

from __future__ import annotations

from ..kvsp.layout import Geometry
from ..kvsp.registries import ELEMENT_TYPES
from ..moqt.messages import Message
from ..sinks import LayerSink
from ..storage import BlockStore, BlockWriter, RecordKey, ReplicaInfo, StorageError
from .binding import BindingError, TrackInfo

__all__ = ["OCTET_GEOMETRY", "StoreLanding", "track_problem"]

#: Payloads are handled as octets (any registered one-octet element type; binding §2).
_OCTET = ELEMENT_TYPES["fp8-e4m3"]
#: One head of one octet: ``section_bytes(n)`` = n octets.
OCTET_GEOMETRY = Geometry(1, 1, _OCTET)


def track_problem(info: TrackInfo, digests: tuple[bytes, ...], section: int) -> str | None:
    """Why the Track Properties of FETCH_OK cannot describe the replica of the record (layers
    0..L-1 with ``digests``, sections of ``section`` octets), or None."""
    if (info.first_layer, info.layer_count) != (0, len(digests)):
        return (f"the track holds layers {info.first_layer}+{info.layer_count}, "
                f"the record lists 0-{len(digests) - 1}")
    if info.layer_digests is not None and any(info.layer_digests.get(i) != d for i, d in enumerate(digests)):
        return "the track's LAYER_DIGESTS differ from the record's (another replica)"
    tokens = info.token_count
    if (tokens == 0 and section != 0) or (tokens > 0 and (section == 0 or section % tokens)):
        return f"{section}-octet sections cannot hold {tokens} tokens (kvsp-layout-1)"
    return None


class StoreLanding(LayerSink[memoryview]):
    """Receives the layers 0..L-1 of the replica of one record into ``store`` under ``key``.

    Use: pass :meth:`on_response` and :meth:`check` to ``fetch_layers`` / ``fetch_into`` with
    this sink, then :meth:`finish` (the stored :class:`~kvsp_moq.storage.ReplicaInfo`) or
    :meth:`discard`. :attr:`exists` is set when the store already held the key at FETCH_OK
    (stored meanwhile by another load); nothing is written then.
    """

    def __init__(self, store: BlockStore, key: RecordKey, digests: tuple[bytes, ...], section: int) -> None:
        # tokens = section: with one octet per element, section_bytes(section) = S octets.
        super().__init__(OCTET_GEOMETRY, section, (0, len(digests) - 1), digests)
        self.store = store
        self.key = key
        self.record_digests = digests
        self.section = section
        self.writer: BlockWriter | None = None
        #: The Token Count FETCH_OK announced (None until then).
        self.token_count: int | None = None
        #: Why this source cannot complete the landing (None: nothing wrong yet).
        self.problem: str | None = None
        self.exists = False
        #: Layers received outside the store (no writer yet, or no writable view): position -> buffer.
        self._staged: dict[int, memoryview] = {}
        #: Verified before the writer existed: position -> digest, committed by on_response.
        self._pending: dict[int, bytes] = {}

    # -- the FETCH's answer ---------------------------------------------------------------------

    def on_response(self, msg: Message) -> None:
        """FETCH_OK dispatched (synchronously, before the objects behind it): check the Track
        Properties against the record and begin the replica in the store."""
        props = getattr(msg, "track_properties", None)
        if props is None or self.writer is not None or self.problem is not None:
            return  # REQUEST_ERROR (the fetch raises), or answered already
        try:
            info = TrackInfo.parse(props)
        except BindingError as exc:
            self._refuse(f"track properties: {exc}")
            return
        problem = track_problem(info, self.record_digests, self.section)
        if problem is not None:
            self._refuse(problem)
            return
        tokens = info.token_count
        geometry = Geometry(1, self.section // tokens, _OCTET) if tokens else OCTET_GEOMETRY
        if self.key in self.store:
            self.exists = True
            self._refuse("the store holds this block already")
            return
        try:
            self.writer = self.store.begin(self.key, geometry, range(len(self.record_digests)), tokens)
        except StorageError as exc:  # no room even after eviction, ...
            self._refuse(f"cannot store: {exc}")
            return
        self.token_count = tokens
        for position, digest in sorted(self._pending.items()):
            self._commit(position, digest)
        self._pending.clear()

    def check(self, response: object) -> str | None:
        """The ``check`` of ``fetch_layers``: the problem :meth:`on_response` found, if any."""
        if self.problem is None and self.writer is None and response is not None:
            self.on_response(response)  # type: ignore[arg-type]  # (a hook that did not run)
        return self.problem

    # -- the end --------------------------------------------------------------------------------

    def finish(self) -> ReplicaInfo:
        """Seal the replica (every layer verified and committed); StorageError otherwise."""
        if self.problem is not None:
            raise StorageError(self.problem)
        if self.writer is None:
            raise StorageError("no FETCH_OK: the replica was never begun")
        return self.writer.finish()

    def discard(self, reason: str) -> None:
        """The landing failed: nothing more is received and the partial replica is dropped."""
        self.abort_all(reason)
        if self.writer is not None and self.writer.open:
            self.writer.abort()
        self._staged.clear()
        self._pending.clear()

    # -- LayerSink hooks ------------------------------------------------------------------------

    def _acquire(self, position: int) -> memoryview:
        if self.writer is not None:
            try:
                view = self.writer.landing_view(self.first_layer + position)
            except StorageError as exc:  # the writer was closed under us
                self._refuse(f"cannot store: {exc}")
                view = None
            if view is not None:
                self._staged.pop(position, None)
                return view
        staged = self._staged.get(position)
        if staged is None:
            staged = self._staged[position] = memoryview(bytearray(self.payload_bytes))
        return staged

    def _publish(self, position: int) -> None:
        digest = self.expected_digest(self.first_layer + position)
        assert digest is not None  # the sink verified the layer against it
        if self.writer is None:
            self._pending[position] = digest  # committed once FETCH_OK begins the replica
        else:
            self._commit(position, digest)

    def _view(self, position: int) -> memoryview:
        staged = self._staged.get(position)
        if staged is not None:
            return staged.toreadonly()
        return self.store.layer_payload(self.key, self.first_layer + position, touch=False)

    # -- internals ------------------------------------------------------------------------------

    def _commit(self, position: int, digest: bytes) -> None:
        assert self.writer is not None
        try:
            self.writer.commit_layer(self.first_layer + position, digest, self._staged.pop(position, None))
        except (StorageError, ValueError) as exc:  # closed (evicted, aborted) or a bug
            self._refuse(f"cannot store layer {self.first_layer + position}: {exc}")

    def _refuse(self, problem: str) -> None:
        if self.problem is None:
            self.problem = problem
        self.abort_all(problem)  # objects still to come are refused (the stream is stopped)
