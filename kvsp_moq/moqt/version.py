"""MOQT versions spoken by this stack and what differs between them.

Versions are negotiated by ALPN alone (draft 15+, moqt-reference §2.1): ``moqt-NN`` on native
QUIC, the same token in ``WT-Available-Protocols`` on WebTransport. One codec family serves
drafts 18, 20, 21 and 22 (moqt-reference §3); 21 is byte-identical to 20 (editorial release).
Draft 22 is the default.

Code that differs per version asks a property of :class:`Version` rather than comparing
numbers, so every switch is named and documented here. Data-plane switches (used by
``kvsp_moq.moqt.data``):

* ``vi64_seven_byte`` — the 7-byte vi64 form is valid (18+; invalid only in 17).
* ``end_of_timed_out_range`` — fetch serialization value 0x20C exists (20+, fill fetch).

Everything else in the data plane (SUBGROUP_HEADER flags incl. FIRST_OBJECT 0x40, delta-coded
fetch objects, OBJECT_DATAGRAM types, padding) is the same in 18, 20, 21 and 22.

Control-plane switches from moqt-reference §3 are provided for the message codecs.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["DEFAULT_VERSION", "SUPPORTED_ALPNS", "SUPPORTED_VERSIONS", "Version"]

_ALPN_PREFIX = "moqt-"


class Version(IntEnum):
    """A draft-ietf-moq-transport version; the value is the draft number."""

    DRAFT_18 = 18
    DRAFT_20 = 20
    DRAFT_21 = 21
    DRAFT_22 = 22

    # -- negotiation ----------------------------------------------------------------------
    @property
    def alpn(self) -> str:
        """The ALPN token, e.g. ``"moqt-22"``."""
        return f"{_ALPN_PREFIX}{self.value}"

    @classmethod
    def from_alpn(cls, alpn: str | bytes) -> Version:
        """The version an ALPN token selects; ``ValueError`` for tokens we do not speak."""
        token = alpn.decode("ascii", "replace") if isinstance(alpn, bytes) else alpn
        if token.startswith(_ALPN_PREFIX) and token[len(_ALPN_PREFIX) :].isdigit():
            try:
                return cls(int(token[len(_ALPN_PREFIX) :]))
            except ValueError:
                pass
        raise ValueError(f"unsupported MOQT ALPN {token!r}")

    @property
    def wire_version(self) -> Version:
        """The version whose bytes this one uses (21 → 20, others themselves)."""
        return Version.DRAFT_20 if self is Version.DRAFT_21 else self

    # -- data plane -----------------------------------------------------------------------
    @property
    def vi64_seven_byte(self) -> bool:
        """The 7-byte vi64 form (prefix 1111110) is valid: drafts 18+ (draft-18
        §"Variable-Length Integers"; invalid in 17)."""
        return True

    @property
    def end_of_timed_out_range(self) -> bool:
        """Fetch serialization value 0x20C "End of Timed-Out Range" exists (20+, PR #1673)."""
        return self >= Version.DRAFT_20

    # -- control plane (moqt-reference §3) --------------------------------------------------
    @property
    def goaway_has_request_id(self) -> bool:
        """GOAWAY ends with an optional Request ID (18 only; removed in 19)."""
        return self is Version.DRAFT_18

    @property
    def fetch_has_fetch_type(self) -> bool:
        """FETCH carries Fetch Type / joining fields (<= 19); 20+ uses LOCATION_FILTER."""
        return self < Version.DRAFT_20

    @property
    def has_fill_parameters(self) -> bool:
        """FILL_PARAMETERS (0x23), fill fetch streams and PUBLISH_STATE_NOTIFY (20+)."""
        return self >= Version.DRAFT_20

    @property
    def has_range_filters(self) -> bool:
        """Range filters 0x25-0x29, MAX_FILTER_RANGES, MAX_REQUEST_UPDATES (19+)."""
        return self >= Version.DRAFT_20

    @property
    def location_filter_typed(self) -> bool:
        """LOCATION_FILTER is ``Type (vi64), fields`` without a Length (22)."""
        return self >= Version.DRAFT_22


#: Preference order for ALPN offers and selection (newest first).
SUPPORTED_VERSIONS: tuple[Version, ...] = (
    Version.DRAFT_22,
    Version.DRAFT_21,
    Version.DRAFT_20,
    Version.DRAFT_18,
)
SUPPORTED_ALPNS: tuple[str, ...] = tuple(v.alpn for v in SUPPORTED_VERSIONS)
DEFAULT_VERSION = Version.DRAFT_22
