"""What a peer may make one :class:`~.session.MoqtSession` hold: :class:`ReceiveLimits`.

A peer's declarations (an object's Payload Length, how many objects, NAMESPACEs or PUBLISHes
it sends) never decide what we allocate (docs/security.md). Each limit has a default that no
well-behaved peer of this project comes near; a peer that exceeds one gets the error the
draft names:

* an object larger than ``max_object_size`` (library-allocated payloads only: a buffer the
  application hands out from ``on_object_begin`` is its own bound), or a request holding more
  than ``max_buffered_bytes`` / ``max_queued_objects`` not yet taken by the application: the
  data stream is stopped with STOP_SENDING EXCESSIVE_LOAD (draft-ietf-moq-transport-22
  §"Resource Exhaustion": "The publisher and subscriber MUST cancel a stream ... after
  reaching a resource limit"; §"Stream Reset Error Codes": EXCESSIVE_LOAD "The endpoint is
  overloaded and is resetting this stream"); a FETCH whose stream is stopped fails with that
  code; an OBJECT_DATAGRAM beyond the budget is dropped (datagrams are unreliable);
* the peer's PUBLISH_NAMESPACE or PUBLISH while ``max_peer_namespaces`` /
  ``max_incoming_publishes`` are reached: REQUEST_ERROR EXCESSIVE_LOAD (§"REQUEST_ERROR
  Codes": "the endpoint is overloaded");
* NAMESPACE / NAMESPACE_DONE on our SUBSCRIBE_NAMESPACE while ``max_namespace_updates`` are
  waiting unread on :attr:`~.session.MoqtSession.namespace_updates`: the SUBSCRIBE_NAMESPACE
  is cancelled (§"Request Cancellation"), and ``("overflow", prefix)`` is the last update the
  application reads for it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_RECEIVE_LIMITS", "ReceiveLimits"]

MiB = 1 << 20


@dataclass(frozen=True)
class ReceiveLimits:
    """Receive-side bounds of one session (``connect(..., receive_limits=...)``,
    ``serve(..., receive_limits=...)``)."""

    #: Largest object payload this layer allocates for (no ``on_object_begin`` buffer).
    max_object_size: int = 64 * MiB
    #: Payload bytes one subscription / fetch may hold that the application has not taken
    #: yet (objects queued plus the object being received).
    max_buffered_bytes: int = 256 * MiB
    #: Objects one subscription / fetch may hold that the application has not taken yet.
    max_queued_objects: int = 65536
    #: An object payload up to this size is allocated whole when its header arrives;
    #: a larger one grows as its bytes arrive (never the declared length up front).
    preallocate: int = 16 * 1024
    #: Unread entries of ``namespace_updates``.
    max_namespace_updates: int = 4096
    #: Namespaces the peer may have published (PUBLISH_NAMESPACE) on this session at once.
    max_peer_namespaces: int = 4096
    #: Unread entries of ``incoming_publishes``.
    max_incoming_publishes: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_object_size", "max_buffered_bytes", "max_queued_objects",
                     "preallocate", "max_namespace_updates", "max_peer_namespaces",
                     "max_incoming_publishes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


DEFAULT_RECEIVE_LIMITS = ReceiveLimits()
