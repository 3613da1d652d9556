"""What a transcoding relay is given (:class:`Transcoder`): a protocol with no relay imports, so
that the configuration can name it without importing the FETCH machinery
(:mod:`.transcode` runs it; docs/relay.md "Transcoding")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Properties", "Transcoder"]

#: Track Properties as (type, value) pairs.
Properties = tuple[tuple[int, int | bytes], ...]


class Transcoder(Protocol):
    """What the relay is given to make one track of a namespace from another."""

    def source_track(self, namespace: tuple[bytes, ...], track_name: bytes) -> bytes | None:
        """The name of the track ``track_name`` is made from, or None when this transcoder
        does not make it (the FETCH then goes upstream as any other)."""
        ...

    def transcode(self, namespace: tuple[bytes, ...], track_name: bytes, source_properties: Properties,
                  payloads: Sequence[bytes]) -> list[bytes]:
        """The coded payload of each source payload (same order). Runs on a worker thread;
        ``ValueError`` when the source cannot be coded."""
        ...
