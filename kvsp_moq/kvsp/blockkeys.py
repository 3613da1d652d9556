"""Block Keys (kvsp-draft §4.2): a keyed hash chain over token identifiers.

    K[-1] = 32 zero octets
    K[i]  = HMAC-SHA-256(scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id || K[i-1]
                                    || uint32(t[i*B]) || ... || uint32(t[i*B+B-1]))

Only complete blocks have keys. :class:`BlockKeyChain` extends a chain from its last key,
so a session that grows by one block costs one HMAC, never a rehash of the prefix.

Speed: the HMAC state keyed with the scope key and fed the constant label and compat_id
is built once and copied per block (``hmac.HMAC.copy``), which skips the per-block key
schedule that a one-shot ``hmac.digest`` pays; tokens are packed to big-endian uint32 in
one vectorised step.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Iterable, Sequence

import numpy as np

from .errors import BlockKeyError
from .scope import check_scope_key

KEY_OCTETS = 32
ZERO_KEY = bytes(KEY_OCTETS)
_BLOCK_LABEL = b"KVSP-BLOCK-1\x00"
_UINT32_MAX = 0xFFFFFFFF


def pack_tokens(tokens: Iterable[int] | np.ndarray) -> bytes:
    """Tokens as consecutive uint32 in network byte order; ``BlockKeyError`` unless every
    token is an integer in [0, 2**32)."""
    try:
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
    except (OverflowError, ValueError, TypeError) as exc:
        raise BlockKeyError(f"tokens must be integers in [0, 2**32): {exc}") from None
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise BlockKeyError("tokens must be a flat sequence of integers")
    if arr.dtype.kind not in "iu":
        raise BlockKeyError(f"tokens must be integers in [0, 2**32), got elements of type {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _UINT32_MAX:
        raise BlockKeyError("every token must fit uint32: [0, 2**32)")
    return arr.astype(">u4", copy=False).tobytes()


class BlockKeyChain:
    """The Block Key chain of one token sequence under one scope and Compatibility ID.

    ``previous`` and ``index`` resume a chain: pass K[i-1] and i to continue at block i
    without the tokens of blocks 0..i-1 (kvsp-draft §4.2: K[i] covers K[i-1]).
    Tokens are fed with :meth:`extend`; the tokens after the last complete block wait in
    :attr:`pending` until their block completes.
    """

    def __init__(
        self,
        scope_key: bytes,
        compat_id: bytes,
        block_tokens: int,
        *,
        previous: bytes = ZERO_KEY,
        index: int = 0,
    ) -> None:
        key = check_scope_key(scope_key)
        if not isinstance(compat_id, (bytes, bytearray)) or len(compat_id) != 32:
            raise BlockKeyError("compat_id must be the 32 raw octets of the Compatibility ID")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
            raise BlockKeyError("block_tokens (B) must be a positive integer")
        if len(previous) != KEY_OCTETS:
            raise BlockKeyError("previous must be a 32-octet Block Key")
        if index < 0 or (index == 0) != (bytes(previous) == ZERO_KEY):
            raise BlockKeyError("index 0 starts from K[-1] (zero octets); index i>0 needs K[i-1]")
        self._prefix = hmac.new(key, _BLOCK_LABEL + bytes(compat_id), hashlib.sha256)
        self._block_octets = 4 * block_tokens
        self.block_tokens = block_tokens
        self.last_key: bytes = bytes(previous)
        self.index = index  # number of complete blocks so far, i.e. the index of the next key
        self._pending = bytearray()

    @property
    def pending(self) -> int:
        """Number of tokens after the last complete block."""
        return len(self._pending) // 4

    def extend(self, tokens: Iterable[int] | np.ndarray) -> list[bytes]:
        """Append tokens; return the keys of the blocks they complete, in order."""
        packed = pack_tokens(tokens)
        if self._pending:
            packed = bytes(self._pending) + packed
            self._pending.clear()
        usable = len(packed) - len(packed) % self._block_octets
        keys = self._chain(memoryview(packed)[:usable])
        self._pending += packed[usable:]
        return keys

    def _chain(self, packed: memoryview) -> list[bytes]:
        step = self._block_octets
        prefix = self._prefix
        prev = self.last_key
        keys: list[bytes] = []
        append = keys.append
        for offset in range(0, len(packed), step):
            h = prefix.copy()
            h.update(prev)
            h.update(packed[offset:offset + step])
            prev = h.digest()
            append(prev)
        self.last_key = prev
        self.index += len(keys)
        return keys


def block_keys(
    scope_key: bytes, compat_id: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int
) -> list[bytes]:
    """The Block Keys of every complete block of ``tokens`` (kvsp-draft §4.2)."""
    return BlockKeyChain(scope_key, compat_id, block_tokens).extend(tokens)


def next_block_key(
    scope_key: bytes, compat_id: bytes, previous: bytes, block: Sequence[int] | np.ndarray
) -> bytes:
    """K[i] from K[i-1] and the B tokens of block i (B = len(block))."""
    chain = BlockKeyChain(scope_key, compat_id, len(block), previous=previous,
                          index=0 if bytes(previous) == ZERO_KEY else 1)
    keys = chain.extend(block)
    if len(keys) != 1:
        raise BlockKeyError("a block must hold exactly block_tokens tokens")
    return keys[0]
