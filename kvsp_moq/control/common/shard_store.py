"""An instance's share of sequence-sharded caches (kvsp-draft §6.9), by token range.

A :class:`ShardSlice` is the KV cache of the half-open token range ``tokens`` = [a, b) of one
context: for every layer its K section and its V section, each laid out like a KVB1 section
(§4.3 kvsp-layout-1: token index slowest), so a slice of [a, b) is the concatenation of the
slices of [a, m) and [m, b), layer by layer, and travels between instances as a KVB1
container with Token Count b - a (``GET {ii}shards/...``, docs/http-api.md "Resharding").

:class:`ShardStore` is the seam for the engine: the real one keeps the ranges in its KV cache
tensors; :class:`MemoryShardStore` keeps octets in memory (tests, the control plane alone).
A store holds, per map, the ranges of the authoritative version and, apart from them, the
ranges *staged* (fetched) for a version being prepared, which become held on commit and are
dropped on abort (§6.9).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...kvsp.records.members import merge_ranges
from .errors import NotFound

__all__ = ["MemoryShardStore", "ShardSlice", "ShardStore", "TokenRange", "subtract", "intersect"]

#: A half-open token range [a, b), a < b (§6.9).
TokenRange = tuple[int, int]


class RangeNotHeld(NotFound):
    """The store does not hold (all of) the requested token range (404)."""


@dataclass(frozen=True)
class ShardSlice:
    """The KV cache of tokens [a, b): ``layers[l] = (K, V)`` of layer l."""

    tokens: TokenRange
    layers: tuple[tuple[bytes, bytes], ...]

    def __post_init__(self) -> None:
        n = self.tokens[1] - self.tokens[0]
        if n <= 0:
            raise ValueError(f"empty token range {self.tokens}")
        for k, v in self.layers:
            if len(k) % n or len(v) % n:
                raise ValueError(f"sections of {len(k)}/{len(v)} octets do not split into {n} tokens")

    @property
    def token_count(self) -> int:
        return self.tokens[1] - self.tokens[0]

    @property
    def nbytes(self) -> int:
        """KV octets of the slice (what a transfer moves, without framing)."""
        return sum(len(k) + len(v) for k, v in self.layers)

    def cut(self, a: int, b: int) -> ShardSlice:
        """The part [a, b) of this slice (inside it)."""
        start, end = self.tokens
        if not start <= a < b <= end:
            raise ValueError(f"[{a}, {b}) is not inside {self.tokens}")
        n = self.token_count
        out = []
        for k, v in self.layers:
            kt, vt = len(k) // n, len(v) // n
            out.append((k[(a - start) * kt : (b - start) * kt], v[(a - start) * vt : (b - start) * vt]))
        return ShardSlice((a, b), tuple(out))

    @staticmethod
    def join(parts: Sequence[ShardSlice]) -> ShardSlice:
        """Contiguous slices, in token order, as one."""
        if not parts:
            raise ValueError("nothing to join")
        for x, y in zip(parts, parts[1:]):
            if x.tokens[1] != y.tokens[0] or len(x.layers) != len(y.layers):
                raise ValueError(f"slices {x.tokens} and {y.tokens} are not contiguous")
        if len(parts) == 1:
            return parts[0]
        layers = tuple(
            (b"".join(p.layers[l][0] for p in parts), b"".join(p.layers[l][1] for p in parts))
            for l in range(len(parts[0].layers))
        )
        return ShardSlice((parts[0].tokens[0], parts[-1].tokens[1]), layers)


class ShardStore(Protocol):
    """KV of token ranges per map (§6.9), held for the authoritative version or staged."""

    def held(self, map_id: str) -> tuple[TokenRange, ...]:
        """The ranges held for the authoritative version, sorted and merged."""
        ...

    async def read(self, map_id: str, tokens: TokenRange) -> ShardSlice:
        """The held KV of ``tokens``; :class:`RangeNotHeld` unless all of it is held."""
        ...

    def install(self, map_id: str, data: ShardSlice) -> None:
        """Hold ``data`` (the engine computed it: prefill, decoding)."""
        ...

    async def stage(self, map_id: str, version: int, data: ShardSlice) -> None:
        """Keep fetched ``data`` apart for ``version`` until commit or abort."""
        ...

    def commit(self, map_id: str, version: int, release: Sequence[TokenRange]) -> None:
        """§6.9 commit: the ranges staged for ``version`` become held; ``release`` is dropped."""
        ...

    def discard(self, map_id: str, version: int) -> None:
        """§6.9 abort: drop what was staged for ``version``; what is held stays."""
        ...


def subtract(ranges: Sequence[TokenRange], minus: Sequence[TokenRange]) -> list[TokenRange]:
    """``ranges`` without ``minus`` (both sets of half-open ranges), sorted and merged."""
    out: list[TokenRange] = []
    cuts = [(r.start, r.stop) for r in merge_ranges([range(a, b) for a, b in minus])]
    for a, b in [(r.start, r.stop) for r in merge_ranges([range(a, b) for a, b in ranges])]:
        pos = a
        for c, d in cuts:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out


def intersect(x: Sequence[TokenRange], y: Sequence[TokenRange]) -> list[TokenRange]:
    """The common part of two sets of half-open ranges, sorted and merged."""
    out = []
    for a, b in x:
        for c, d in y:
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append(range(lo, hi))
    return [(r.start, r.stop) for r in merge_ranges(out)]


@dataclass
class _MapShare:
    held: list[ShardSlice] = field(default_factory=list)  # sorted, disjoint
    staged: dict[int, list[ShardSlice]] = field(default_factory=dict)


class MemoryShardStore:
    """:class:`ShardStore` in memory."""

    def __init__(self) -> None:
        self._maps: dict[str, _MapShare] = {}

    def held(self, map_id: str) -> tuple[TokenRange, ...]:
        share = self._maps.get(map_id)
        if share is None:
            return ()
        return tuple((r.start, r.stop) for r in merge_ranges([range(*s.tokens) for s in share.held]))

    def staged(self, map_id: str, version: int) -> tuple[TokenRange, ...]:
        share = self._maps.get(map_id)
        return tuple(s.tokens for s in (share.staged.get(version, []) if share else []))

    async def read(self, map_id: str, tokens: TokenRange) -> ShardSlice:
        return self.read_now(map_id, tokens)

    def read_now(self, map_id: str, tokens: TokenRange) -> ShardSlice:
        a, b = tokens
        share = self._maps.get(map_id)
        parts: list[ShardSlice] = []
        pos = a
        for s in share.held if share else []:
            lo, hi = max(pos, s.tokens[0]), min(b, s.tokens[1])
            if lo < hi and lo == pos:
                parts.append(s.cut(lo, hi))
                pos = hi
        if pos != b:
            raise RangeNotHeld(f"map {map_id!r}: tokens [{a}, {b}) are not all held here")
        return ShardSlice.join(parts)

    def install(self, map_id: str, data: ShardSlice) -> None:
        share = self._maps.setdefault(map_id, _MapShare())
        share.held = self._without(share.held, [data.tokens]) + [data]
        share.held.sort(key=lambda s: s.tokens)

    async def stage(self, map_id: str, version: int, data: ShardSlice) -> None:
        self._maps.setdefault(map_id, _MapShare()).staged.setdefault(version, []).append(data)

    def commit(self, map_id: str, version: int, release: Sequence[TokenRange]) -> None:
        share = self._maps.setdefault(map_id, _MapShare())
        share.held = self._without(share.held, release)
        for data in share.staged.pop(version, []):
            self.install(map_id, data)
        share.staged = {v: s for v, s in share.staged.items() if v > version}

    def discard(self, map_id: str, version: int) -> None:
        share = self._maps.get(map_id)
        if share is not None:
            share.staged.pop(version, None)

    @staticmethod
    def _without(slices: list[ShardSlice], ranges: Sequence[TokenRange]) -> list[ShardSlice]:
        out = []
        for s in slices:
            for a, b in subtract([s.tokens], ranges):
                out.append(s.cut(a, b))
        return out
