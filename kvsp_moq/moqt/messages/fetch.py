"""FETCH and FETCH_OK (draft-20 §"FETCH", §"FETCH_OK"; draft-18 §"FETCH", §"FETCH_OK").

FETCH has two shapes (moqt-reference §3):

* **20+** (:class:`Fetch`) — the SUBSCRIBE layout; the range is the LOCATION_FILTER parameter
  (omitted: ``{0, 0}`` to Largest Object)::

      FETCH { Type = 0x16, Length (16), Request ID (vi64), Track Namespace (..),
              Track Name Length (vi64), Track Name (..), Number of Parameters (vi64),
              Parameters (..) ... }

* **18** (:class:`StandaloneFetch`, :class:`JoiningFetch`, both :class:`FetchWithType`)::

      FETCH { Type = 0x16, Length (16), Request ID (vi64), Fetch Type (vi64),
              [Standalone { Track Namespace, Track Name Length, Track Name,
                            Start Location (Location), End Location (Location) }],  -- type 0x1
              [Joining { Joining Request ID (vi64), Joining Start (vi64) }],       -- 0x2, 0x3
              Number of Parameters (vi64), Parameters (..) ... }

  A Fetch Type other than 0x1-0x3 → PROTOCOL_VIOLATION. The Standalone End Location is "the
  last Object, plus 1" (Object 0: the whole group) — kept as sent.

FETCH_OK is the same in both::

    FETCH_OK { Type = 0x18, Length (16), End Of Track (8), End Location (Location),
               Number of Parameters (vi64), Parameters (..) ..., Track Properties (..) }

End Of Track is 1 or 0; we treat other values as PROTOCOL_VIOLATION (the draft defines only
those two). No parameter names FETCH_OK among the messages it may appear in, so any
parameter there is a PROTOCOL_VIOLATION. "End Location smaller than the Start Location" is a
session check (it needs the FETCH).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ...wire.buffer import Reader, Writer
from ...wire.kvp import KeyValuePair
from ..version import Version
from ._base import FETCH_TYPE, Message, Sender, TrackRequest
from ._fields import (
    Location,
    TrackProperties,
    check_vi64,
    read_location,
    read_track_properties,
    violation,
    write_location,
    write_track_properties,
)
from .names import (
    TrackNamespace,
    check_track_namespace,
    read_full_track_name,
    write_full_track_name,
)
from .params import MessageParameters, ParamContext, read_parameters, write_parameters

__all__ = ["Fetch", "FetchOk", "FetchType", "FetchWithType", "JoiningFetch", "StandaloneFetch"]

_D18 = frozenset({Version.DRAFT_18})


class FetchType(IntEnum):
    """Draft-18 Fetch Type (removed in 20)."""

    STANDALONE = 0x1
    RELATIVE_JOINING = 0x2
    ABSOLUTE_JOINING = 0x3


@dataclass(frozen=True, slots=True)
class Fetch(TrackRequest):
    """FETCH, drafts 20+ (range in ``parameters.location_filter``)."""

    TYPE = FETCH_TYPE
    NAME = "FETCH"
    VERSIONS = frozenset({Version.DRAFT_20, Version.DRAFT_22})
    PARAMS = ParamContext.FETCH


class FetchWithType(Message):
    """FETCH of draft 18, which starts with a Fetch Type; decoding yields a subclass."""

    __slots__ = ()
    TYPE = FETCH_TYPE
    NAME = "FETCH"
    VERSIONS = _D18
    FIRST = True
    PARAMS = ParamContext.FETCH

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> FetchWithType:
        request_id = r.pull_vi64()
        raw = r.pull_vi64()
        if raw == FetchType.STANDALONE:
            namespace, name = read_full_track_name(r)
            start = read_location(r)
            end = read_location(r)
            params = read_parameters(r, version, cls.PARAMS)
            return StandaloneFetch(request_id, namespace, name, start, end, params)
        if raw in (FetchType.RELATIVE_JOINING, FetchType.ABSOLUTE_JOINING):
            joining_request_id = r.pull_vi64()
            joining_start = r.pull_vi64()
            params = read_parameters(r, version, cls.PARAMS)
            return JoiningFetch(
                request_id, FetchType(raw), joining_request_id, joining_start, params
            )
        raise violation(f"unknown Fetch Type {raw:#x}")


@dataclass(frozen=True, slots=True)
class StandaloneFetch(FetchWithType):
    """Draft-18 Standalone Fetch (Fetch Type 0x1)."""

    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    start_location: Location
    end_location: Location
    parameters: MessageParameters = MessageParameters()

    def __post_init__(self) -> None:
        check_vi64("Request ID", self.request_id)
        object.__setattr__(self, "track_namespace", check_track_namespace(self.track_namespace))
        object.__setattr__(self, "track_name", bytes(self.track_name))
        object.__setattr__(self, "start_location", Location(*self.start_location))
        object.__setattr__(self, "end_location", Location(*self.end_location))

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.request_id)
        w.push_vi64(FetchType.STANDALONE)
        write_full_track_name(w, self.track_namespace, self.track_name)
        write_location(w, self.start_location)
        write_location(w, self.end_location)
        write_parameters(w, version, self.PARAMS, self.parameters)


@dataclass(frozen=True, slots=True)
class JoiningFetch(FetchWithType):
    """Draft-18 Relative (0x2) or Absolute (0x3) Joining Fetch."""

    request_id: int
    fetch_type: FetchType
    joining_request_id: int
    joining_start: int
    parameters: MessageParameters = MessageParameters()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fetch_type", FetchType(self.fetch_type))
        if self.fetch_type is FetchType.STANDALONE:
            raise ValueError("a JoiningFetch is Relative or Absolute Joining")
        check_vi64("Request ID", self.request_id)
        check_vi64("Joining Request ID", self.joining_request_id)
        check_vi64("Joining Start", self.joining_start)

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_vi64(self.request_id)
        w.push_vi64(self.fetch_type)
        w.push_vi64(self.joining_request_id)
        w.push_vi64(self.joining_start)
        write_parameters(w, version, self.PARAMS, self.parameters)


@dataclass(frozen=True, slots=True)
class FetchOk(Message):
    """FETCH_OK: the publisher's first response on a FETCH stream."""

    TYPE = 0x18
    NAME = "FETCH_OK"
    PARAMS = ParamContext.FETCH_OK
    ON_REQUESTS = {FETCH_TYPE: Sender.RESPONDER}

    end_of_track: bool
    end_location: Location
    parameters: MessageParameters = MessageParameters()
    track_properties: TrackProperties = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "end_of_track", bool(self.end_of_track))
        object.__setattr__(self, "end_location", Location(*self.end_location))
        object.__setattr__(
            self, "track_properties", tuple(KeyValuePair(*kv) for kv in self.track_properties)
        )

    def encode_body(self, w: Writer, version: Version) -> None:
        w.push_uint8(int(self.end_of_track))
        write_location(w, self.end_location)
        write_parameters(w, version, self.PARAMS, self.parameters)
        write_track_properties(w, self.track_properties)

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> FetchOk:
        end_of_track = r.pull_uint8()
        if end_of_track > 1:
            raise violation(f"End Of Track {end_of_track} is neither 0 nor 1")
        end = read_location(r)
        params = read_parameters(r, version, cls.PARAMS)
        return cls(bool(end_of_track), end, params, read_track_properties(r))
