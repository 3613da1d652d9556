"""The AUTHORIZATION TOKEN value: the Token structure (draft-20 and draft-18
§"AUTHORIZATION TOKEN Parameter"; identical bytes).

::

    Token {
      Alias Type (vi64),
      [Token Alias (vi64),]
      [Token Type (vi64),]
      [Token Value (..)]        -- the rest of the enclosing length-prefixed value
    }

==========  =====  ===============================================
Alias Type  value  fields
==========  =====  ===============================================
DELETE      0x0    Token Alias
REGISTER    0x1    Token Alias, Token Type, Token Value
USE_ALIAS   0x2    Token Alias
USE_VALUE   0x3    Token Type, Token Value
==========  =====  ===============================================

The same structure is the value of the Message Parameter 0x03 (length-prefixed) and of the
Setup Option 0x03 (an odd KVP, so also length-prefixed). "If the Token structure cannot be
decoded, the receiver MUST close the Session with KEY_VALUE_FORMATTING_ERROR": an unknown
Alias Type, a missing field, or bytes left after DELETE / USE_ALIAS. Alias bookkeeping
(DUPLICATE_AUTH_TOKEN_ALIAS, UNKNOWN_AUTH_TOKEN_ALIAS, cache size) is session state; the rule
"DELETE or USE_ALIAS in SETUP → PROTOCOL_VIOLATION" is enforced by the SETUP codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ...wire.buffer import Buffer, Reader, Writer
from ...wire.errors import BufferUnderflow, SessionErrorCode, WireError
from ._fields import check_vi64

__all__ = ["AliasType", "Token", "decode_token", "encode_token", "token_cache_size"]

_KVFE = SessionErrorCode.KEY_VALUE_FORMATTING_ERROR


class AliasType(IntEnum):
    """§"Authorization Token Alias Type" registry."""

    DELETE = 0x0
    REGISTER = 0x1
    USE_ALIAS = 0x2
    USE_VALUE = 0x3


_HAS_ALIAS = frozenset({AliasType.DELETE, AliasType.REGISTER, AliasType.USE_ALIAS})
_HAS_VALUE = frozenset({AliasType.REGISTER, AliasType.USE_VALUE})


@dataclass(frozen=True, slots=True)
class Token:
    """One Token. ``token_alias`` is set iff the Alias Type carries one; ``token_type`` and
    ``token_value`` iff it carries a value (REGISTER, USE_VALUE)."""

    alias_type: AliasType
    token_alias: int | None = None
    token_type: int | None = None
    token_value: bytes | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "alias_type", AliasType(self.alias_type))
        has_alias = self.alias_type in _HAS_ALIAS
        has_value = self.alias_type in _HAS_VALUE
        if (self.token_alias is not None) != has_alias:
            raise ValueError(f"{self.alias_type.name} {'needs' if has_alias else 'has no'} alias")
        if (self.token_type is None) == has_value or (self.token_value is None) == has_value:
            raise ValueError(
                f"{self.alias_type.name} {'needs' if has_value else 'has no'} type and value"
            )
        if self.token_alias is not None:
            check_vi64("Token Alias", self.token_alias)
        if self.token_type is not None:
            check_vi64("Token Type", self.token_type)
        if self.token_value is not None:
            object.__setattr__(self, "token_value", bytes(self.token_value))

    # Convenience constructors named after the alias types.
    @classmethod
    def use_value(cls, token_type: int, token_value: Buffer) -> Token:
        return cls(AliasType.USE_VALUE, None, token_type, bytes(token_value))

    @classmethod
    def register(cls, alias: int, token_type: int, token_value: Buffer) -> Token:
        return cls(AliasType.REGISTER, alias, token_type, bytes(token_value))

    @classmethod
    def use_alias(cls, alias: int) -> Token:
        return cls(AliasType.USE_ALIAS, alias)

    @classmethod
    def delete(cls, alias: int) -> Token:
        return cls(AliasType.DELETE, alias)


def token_cache_size(token: Token) -> int:
    """Bytes a registered token occupies in the peer's cache: 16 + len(Token Value)
    (§"MAX_AUTH_TOKEN_CACHE_SIZE")."""
    return 16 + len(token.token_value or b"")


def decode_token(r: Reader) -> Token:
    """Decode a Token filling all of ``r`` (a reader bounded to the enclosing value)."""
    try:
        raw_type = r.pull_vi64()
        try:
            alias_type = AliasType(raw_type)
        except ValueError:
            raise WireError(_KVFE, f"unknown token Alias Type {raw_type:#x}") from None
        alias = r.pull_vi64() if alias_type in _HAS_ALIAS else None
        if alias_type in _HAS_VALUE:
            token_type = r.pull_vi64()
            return Token(alias_type, alias, token_type, bytes(r.pull_rest()))
        if not r.at_end():
            raise WireError(_KVFE, f"{r.remaining} bytes after a {alias_type.name} token")
        return Token(alias_type, alias)
    except BufferUnderflow:
        raise WireError(_KVFE, "truncated Token structure") from None


def encode_token(w: Writer, token: Token) -> None:
    """Append the Token structure (without the enclosing length)."""
    w.push_vi64(token.alias_type)
    if token.token_alias is not None:
        w.push_vi64(token.token_alias)
    if token.token_type is not None:
        w.push_vi64(token.token_type)
        w.push_bytes(token.token_value or b"")
