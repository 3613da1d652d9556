"""SETUP and GOAWAY (draft-20 §"SETUP", §"GOAWAY"; draft-18 the same sections).

SETUP (0x2F00)
--------------
The first message on each endpoint's unidirectional control stream; its type doubles as the
stream type (§"Unidirectional Stream Types"), so a control stream's bytes start ``af 00``::

    SETUP { Type (vi64) = 0x2F00, Length (16), Setup Options (..) ... }

Setup Options are Key-Value-Pairs filling the body. Their namespace is constant across
versions; "endpoints MUST ignore unknown Setup Options" and "MUST allow duplicates of unknown
Setup Options": unknown (incl. GREASE ``0x7f*N+0x9D``) options are kept, in order, in
``unknown_options`` and otherwise ignored. MAX_FILTER_RANGES (0x06) and MAX_REQUEST_UPDATES
(0x08) are defined from draft 19, so on a draft-18 session they are unknown options.

Errors: a repeated known option other than AUTHORIZATION TOKEN ("one or more tokens") →
PROTOCOL_VIOLATION; a token with Alias Type DELETE or USE_ALIAS → PROTOCOL_VIOLATION (the draft
says so for a server; nothing can have been registered before SETUP, so we apply it to both
roles); an undecodable token → KEY_VALUE_FORMATTING_ERROR; a PATH / AUTHORITY that is not
UTF-8 → MALFORMED_PATH / MALFORMED_AUTHORITY (the errors the draft names for a value that does
not follow RFC 3986; the URI syntax itself, and which role may send them, are checked by the
session, which knows its transport and role).

GOAWAY (0x10)
-------------
On the control stream or on a request stream::

    GOAWAY { New Session URI Length (vi64) <= 8192, New Session URI (..), Timeout (vi64),
             [Request ID (vi64)] }      -- Request ID: draft 18 only, control stream only

A URI longer than 8192 bytes → PROTOCOL_VIOLATION. (A server receiving a non-empty URI, and
a second GOAWAY on one stream, are session rules.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ...wire.buffer import Reader, Writer
from ...wire.errors import SessionErrorCode
from ...wire.kvp import KeyValuePair, read_kvps, write_kvps
from ..version import Version
from ._base import REQUEST_TYPES, Message, Sender, StreamUse
from ._fields import check_vi64, read_uri, violation, write_uri
from .token import AliasType, Token, decode_token, encode_token

__all__ = ["MAX_GOAWAY_URI_LENGTH", "GoAway", "Setup", "SetupOptionType", "known_setup_options"]

#: §"GOAWAY": "The maximum length of the New Session URI is 8,192 bytes."
MAX_GOAWAY_URI_LENGTH = 8192


class SetupOptionType(IntEnum):
    """IANA "Setup Options" (draft-20; draft 18 lacks 0x06 and 0x08)."""

    PATH = 0x01
    AUTHORIZATION_TOKEN = 0x03
    MAX_AUTH_TOKEN_CACHE_SIZE = 0x04
    AUTHORITY = 0x05
    MAX_FILTER_RANGES = 0x06
    MOQT_IMPLEMENTATION = 0x07
    MAX_REQUEST_UPDATES = 0x08


_O = SetupOptionType
_KNOWN_D18 = frozenset({_O.PATH, _O.AUTHORIZATION_TOKEN, _O.MAX_AUTH_TOKEN_CACHE_SIZE,
                        _O.AUTHORITY, _O.MOQT_IMPLEMENTATION})
_KNOWN_D20 = _KNOWN_D18 | {_O.MAX_FILTER_RANGES, _O.MAX_REQUEST_UPDATES}


def known_setup_options(version: Version) -> frozenset[int]:
    """The Setup Option types ``version`` defines; the rest are ignored."""
    return _KNOWN_D18 if version.wire_version is Version.DRAFT_18 else _KNOWN_D20


def _text(raw: bytes, code: int, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise violation(f"{what} is not UTF-8", code) from None


@dataclass(frozen=True, slots=True)
class Setup(Message):
    """SETUP with its options by name; ``None`` / ``()`` = absent (defaults: cache size 0,
    max filter ranges 0, max request updates 0 = unlimited)."""

    TYPE = 0x2F00
    NAME = "SETUP"
    STREAM = StreamUse.CONTROL
    FIRST = True  # first message of the control stream

    path: str | None = None
    authorization_tokens: tuple[Token, ...] = ()
    max_auth_token_cache_size: int | None = None
    authority: str | None = None
    max_filter_ranges: int | None = None
    moqt_implementation: str | None = None
    max_request_updates: int | None = None
    #: Options this version does not define, as received (ignored; sent as given, e.g. GREASE).
    unknown_options: tuple[KeyValuePair, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "authorization_tokens", tuple(self.authorization_tokens))
        object.__setattr__(
            self, "unknown_options", tuple(KeyValuePair(*kv) for kv in self.unknown_options)
        )

    def _options(self, version: Version) -> list[tuple[int, int | bytes]]:
        known = known_setup_options(version)
        out: list[tuple[int, int | bytes]] = []

        def add(option: SetupOptionType, value: int | bytes) -> None:
            if option not in known:
                raise ValueError(f"Setup Option {option.name} is not in draft {int(version)}")
            out.append((option, value))

        if self.path is not None:
            add(_O.PATH, self.path.encode("utf-8"))
        for token in self.authorization_tokens:
            if token.alias_type in (AliasType.DELETE, AliasType.USE_ALIAS):
                raise ValueError(f"{token.alias_type.name} token in SETUP")
            w = Writer()
            encode_token(w, token)
            add(_O.AUTHORIZATION_TOKEN, w.getvalue())
        for option, number in (
            (_O.MAX_AUTH_TOKEN_CACHE_SIZE, self.max_auth_token_cache_size),
            (_O.MAX_FILTER_RANGES, self.max_filter_ranges),
            (_O.MAX_REQUEST_UPDATES, self.max_request_updates),
        ):
            if number is not None:
                add(option, check_vi64(option.name, number))
        if self.authority is not None:
            add(_O.AUTHORITY, self.authority.encode("utf-8"))
        if self.moqt_implementation is not None:
            add(_O.MOQT_IMPLEMENTATION, self.moqt_implementation.encode("utf-8"))
        for kv in self.unknown_options:
            if kv.type in known:
                raise ValueError(f"unknown_options holds the known option {kv.type:#x}")
            out.append((kv.type, kv.value))
        out.sort(key=lambda kv: kv[0])  # stable: the order within one type is kept
        return out

    def encode_body(self, w: Writer, version: Version) -> None:
        write_kvps(w, self._options(version))

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> Setup:
        known = known_setup_options(version)
        fields: dict[str, object] = {}
        tokens: list[Token] = []
        unknown: list[KeyValuePair] = []
        for kv in read_kvps(r):
            if kv.type not in known:
                unknown.append(kv)
                continue
            option = SetupOptionType(kv.type)
            if option is _O.AUTHORIZATION_TOKEN:
                assert isinstance(kv.value, bytes)
                token = decode_token(Reader(kv.value, seven_byte=r.seven_byte))
                if token.alias_type in (AliasType.DELETE, AliasType.USE_ALIAS):
                    raise violation(f"{token.alias_type.name} token in SETUP")
                tokens.append(token)
                continue
            name = option.name.lower()
            if name in fields:
                raise violation(f"Setup Option {option.name} repeated")
            if option is _O.PATH:
                assert isinstance(kv.value, bytes)
                fields[name] = _text(kv.value, SessionErrorCode.MALFORMED_PATH, "PATH")
            elif option is _O.AUTHORITY:
                assert isinstance(kv.value, bytes)
                fields[name] = _text(kv.value, SessionErrorCode.MALFORMED_AUTHORITY, "AUTHORITY")
            elif option is _O.MOQT_IMPLEMENTATION:
                assert isinstance(kv.value, bytes)
                fields[name] = kv.value.decode("utf-8", "replace")  # diagnostic text
            else:
                fields[name] = kv.value
        return cls(
            authorization_tokens=tuple(tokens),
            unknown_options=tuple(unknown),
            **fields,  # type: ignore[arg-type]
        )


@dataclass(frozen=True, slots=True)
class GoAway(Message):
    """GOAWAY. ``request_id`` exists in draft 18 only (sent on the control stream)."""

    TYPE = 0x10
    NAME = "GOAWAY"
    STREAM = StreamUse.CONTROL_OR_REQUEST
    ON_REQUESTS = {t: Sender.EITHER for t in REQUEST_TYPES}

    new_session_uri: str = ""
    timeout: int = 0
    request_id: int | None = None

    def encode_body(self, w: Writer, version: Version) -> None:
        write_uri(w, self.new_session_uri, MAX_GOAWAY_URI_LENGTH, "New Session URI")
        w.push_vi64(check_vi64("Timeout", self.timeout))
        if self.request_id is not None:
            if not version.goaway_has_request_id:
                raise ValueError(f"GOAWAY has no Request ID in draft {int(version)}")
            w.push_vi64(check_vi64("Request ID", self.request_id))

    @classmethod
    def decode_body(cls, r: Reader, version: Version) -> GoAway:
        uri = read_uri(r, MAX_GOAWAY_URI_LENGTH, "New Session URI")
        timeout = r.pull_vi64()
        request_id = r.pull_vi64() if version.goaway_has_request_id and not r.at_end() else None
        return cls(uri, timeout, request_id)
