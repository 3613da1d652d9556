"""The per-session token cache (draft-20 §"AUTHORIZATION TOKEN Parameter",
§"MAX_AUTH_TOKEN_CACHE_SIZE", §"AUTHORIZATION TOKEN" Setup Option).

The sans-IO session decodes Token structures but keeps no alias state, so the relay does:
:meth:`TokenCache.resolve` applies the tokens of one message in order and returns the Token
Values they stand for.

* REGISTER: the alias must be free (else session error DUPLICATE_AUTH_TOKEN_ALIAS) and the
  cache must stay within the MAX_AUTH_TOKEN_CACHE_SIZE we advertised, entries counting
  16 + len(Token Value) (else AUTH_TOKEN_CACHE_OVERFLOW); in SETUP a REGISTER that does not
  fit is used as USE_VALUE instead. It is registered even if the message is then refused.
* USE_ALIAS / DELETE of an alias that is not registered: UNKNOWN_AUTH_TOKEN_ALIAS. The draft
  says to "reject the message" with it, but that code exists only among the Session
  Termination codes, so the session is closed with it.
* USE_VALUE: used as given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvsp_moq.moqt.errors import SessionErrorCode
from kvsp_moq.moqt.messages import AliasType, Token, token_cache_size

__all__ = ["TokenCache", "TokenError"]


class TokenError(Exception):
    """A token-cache violation that ends the session with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class TokenCache:
    #: The MAX_AUTH_TOKEN_CACHE_SIZE this end advertised (0: aliases prohibited).
    max_size: int = 0
    _entries: dict[int, Token] = field(default_factory=dict)
    size: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, tokens: Iterable[Token], *, in_setup: bool = False) -> list[bytes]:
        """Apply ``tokens`` (one message's, in order); the Token Values they carry or name."""
        values: list[bytes] = []
        for t in tokens:
            kind = t.alias_type
            if kind is AliasType.USE_VALUE:
                values.append(t.token_value or b"")
            elif kind is AliasType.REGISTER:
                assert t.token_alias is not None
                values.append(t.token_value or b"")
                if t.token_alias in self._entries:
                    if in_setup:
                        continue
                    raise TokenError(SessionErrorCode.DUPLICATE_AUTH_TOKEN_ALIAS,
                                     f"token alias {t.token_alias} already registered")
                need = token_cache_size(t)
                if self.size + need > self.max_size:
                    if in_setup:
                        continue  # §"AUTHORIZATION TOKEN" (Setup): treat as USE_VALUE
                    raise TokenError(SessionErrorCode.AUTH_TOKEN_CACHE_OVERFLOW,
                                     f"token cache would hold {self.size + need} > "
                                     f"{self.max_size} bytes")
                self._entries[t.token_alias] = t
                self.size += need
            else:
                assert t.token_alias is not None
                known = self._entries.get(t.token_alias)
                if known is None:
                    raise TokenError(SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS,
                                     f"token alias {t.token_alias} not registered")
                if kind is AliasType.USE_ALIAS:
                    values.append(known.token_value or b"")
                else:  # DELETE
                    del self._entries[t.token_alias]
                    self.size -= token_cache_size(known)
        return values
