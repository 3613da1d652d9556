"""Prefill→decode streaming: what a request says of it and what each engine's role makes of it.

Disaggregated serving (docs/vllm.md "Prefill→decode"): a router sends one request to a
prefill engine (``kv_producer``) and, at the same time, to one or more decode engines
(``kv_consumer``), naming one **stream** in both requests' ``kv_transfer_params``::

    {"kvsp_stream": {"id": "<32 hex: 16 random octets the router drew>", "as": "producer"}}

- The producer publishes every prompt block it computes for the request as the replica whose
  Replica ID (field 5 of the namespace) is the block's **stream replica id**
  (:func:`stream_replica_id`: the first 16 octets of SHA-256 over a label, the stream id, the
  Compatibility ID and the Block Key: one id per block, as a store and binding §1 want),
  layer by layer as its forward pass computes them (``MoqtHolder.begin``: binding §6).
- A consumer names the same tracks without asking anyone: Compatibility ID, Scope ID and
  Block Keys are its own (the same model and scope give the same ones, kvsp-draft §4.1-§4.2),
  the Replica ID is derived from the stream id as the producer derives it. It SUBSCRIBEs to each block through the relay with
  RENDEZVOUS_TIMEOUT (held until the producer's PUBLISH_NAMESPACE arrives), FETCHes the layers
  produced before its subscription and takes the rest live (binding §6).

What the request names selects no tenant: the scope still comes from the operator's
``cache_salt`` digests (:mod:`.settings`), and the Block Keys from the request's own tokens,
so a stream id only picks which replica of the request's own blocks is read or written. A
producer never overwrites a replica it already holds (``ReplicaExists``): the consumer then
fails those blocks and recomputes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...storage import REPLICA_ID_SIZE, RecordKey

__all__ = ["CONSUMER", "PARAM", "PRODUCER", "StreamError", "StreamParams", "role_of", "stream_replica_id"]

#: The ``kv_transfer_params`` member that names a stream.
PARAM = "kvsp_stream"
PRODUCER, CONSUMER = "producer", "consumer"

#: vLLM's ``kv_role`` -> what the engine may be in a stream (``kv_both``: either, said by the request).
_ROLES = {"kv_producer": (PRODUCER,), "kv_consumer": (CONSUMER,), "kv_both": (PRODUCER, CONSUMER)}


#: The label of :func:`stream_replica_id`'s hash (docs/binding.md §6.1).
_LABEL = b"kvsp-1 stream replica id"


def stream_replica_id(stream_id: bytes, key: RecordKey) -> bytes:
    """The Replica ID of block ``key``'s replica in stream ``stream_id`` (binding §6.1):
    ``SHA-256(label || stream_id || compat_id || block_key)[:16]``."""
    digest = hashlib.sha256(_LABEL + stream_id + key.compat_id + key.block_key).digest()
    return digest[:REPLICA_ID_SIZE]


class StreamError(ValueError):
    """``kv_transfer_params["kvsp_stream"]`` is malformed or does not fit the engine's role."""


def role_of(kv_role: str | None) -> tuple[str, ...]:
    """What an engine of vLLM's ``kv_role`` may be in a stream."""
    roles = _ROLES.get(kv_role or "kv_both")
    if roles is None:
        raise StreamError(f"kv_role {kv_role!r} is not one of {', '.join(_ROLES)}")
    return roles


@dataclass(frozen=True)
class StreamParams:
    """One request's stream: its id (the Replica ID of its blocks) and this engine's part."""

    stream_id: bytes
    part: str  # PRODUCER or CONSUMER

    @classmethod
    def of(cls, params: Mapping[str, Any] | None, kv_role: str | None) -> StreamParams | None:
        """The request's stream (None: it names none); :class:`StreamError` when what it
        names is malformed, or a part this engine's role cannot take."""
        raw = (params or {}).get(PARAM)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise StreamError(f'{PARAM} must be an object {{"id": "<{2 * REPLICA_ID_SIZE} hex>", "as": ...}}')
        ident = raw.get("id")
        if not isinstance(ident, str) or len(ident) != 2 * REPLICA_ID_SIZE \
                or any(c not in "0123456789abcdef" for c in ident):
            raise StreamError(f"{PARAM}.id must be {2 * REPLICA_ID_SIZE} lowercase hex digits")
        roles = role_of(kv_role)
        part = raw.get("as", roles[0] if len(roles) == 1 else None)
        if part not in (PRODUCER, CONSUMER):
            raise StreamError(f'{PARAM}.as must be "producer" or "consumer" on a {kv_role or "kv_both"} engine')
        if part not in roles:
            raise StreamError(f"a {kv_role} engine cannot be the stream's {part}")
        return cls(bytes.fromhex(ident), str(part))

    @property
    def producer(self) -> bool:
        return self.part == PRODUCER

    @property
    def consumer(self) -> bool:
        return self.part == CONSUMER

    def to_json(self) -> dict[str, str]:
        return {"id": self.stream_id.hex(), "as": self.part}
