"""TRACK_STATUS (draft-20 and draft-18 §"TRACK_STATUS").

"The TRACK_STATUS message format is identical to the SUBSCRIBE message", type 0xD; it opens a
request stream and is answered by REQUEST_OK (TRACK_STATUS_OK, the only REQUEST_OK that
carries Track Properties) or REQUEST_ERROR, then FIN. It cannot be updated. Only
AUTHORIZATION_TOKEN (and, 20+, INCLUDE_PROPERTIES) name TRACK_STATUS among the messages they
may appear in; "subscriber parameters related to Track delivery ... are not included".
"""

from __future__ import annotations

from dataclasses import dataclass

from ._base import TrackRequest
from .params import ParamContext

__all__ = ["TrackStatus"]


@dataclass(frozen=True, slots=True)
class TrackStatus(TrackRequest):
    """TRACK_STATUS: asks for a track's status (Largest Object, Track Properties)."""

    TYPE = 0x0D
    NAME = "TRACK_STATUS"
    PARAMS = ParamContext.TRACK_STATUS
