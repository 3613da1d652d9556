"""vLLM's paged KV cache <-> kvsp-layout-1 (kvsp-draft §4.3), per attention backend.

vLLM hands a connector one tensor per attention layer (``register_kv_caches``), the logical
per-layer view ``[num_blocks, kv_heads, block_size, C]``; what ``C`` holds is the backend's:

- ``CPU_ATTN`` (vLLM's CPU backend, the only layout it supports, ``LBHNC``): C = 2 x head_dim,
  but the backend reads the block interior as ``view(B, H, 2 * N, D).chunk(2, dim=2)``: per
  head, the K rows of all N tokens, then the V rows. So K[b, h, t] = ``view(B, H, 2, N, D)[b, h, 0, t]``
  (:data:`HEAD_MAJOR_HALVES`);
- FlashAttention and the other GPU backends of vLLM 0.32/0.33: C = K || V of each token
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``): K[b, h, t] = ``kv[b, h, t, :D]``
  (:data:`SPLIT_CONTENT`);
- the older ``(2, num_blocks, block_size, kv_heads, D)`` tensor (:data:`KV_FIRST`).

kvsp-layout-1 is, per layer and block, a K section and a V section, each ``[tokens, kv_heads,
head_dim]`` C-ordered little-endian (§4.3). :class:`PagedLayout` copies one block out
(:meth:`~PagedLayout.read`: numpy arrays in that form, ready for ``BlockWriter.write_layer``)
and in (:meth:`~PagedLayout.write`), or the pages of a KVSP block of several vLLM blocks in one
indexed copy per section (:meth:`~PagedLayout.read_pages`, :meth:`~PagedLayout.write_pages`);
these copies are the only work the connector does on vLLM's forward path.

Bit-exact in every dtype (DESIGN.md §9): the elements move as integers of their size, never
through a float conversion. Out, the paged tensor is viewed as ``int32``/``int16``/``uint8``
(fp32; fp16 and bf16; fp8) before it reaches numpy (numpy has no bfloat16 or fp8: ``.numpy()``
of such a tensor raises); in, the section's integers are viewed back as the cache's dtype
before the copy. A section whose element size is not the cache's is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["HEAD_MAJOR_HALVES", "KV_FIRST", "PagedLayout", "SPLIT_CONTENT", "layout_for"]

HEAD_MAJOR_HALVES = "head-major-halves"
SPLIT_CONTENT = "split-content"
KV_FIRST = "kv-first"

#: Backends whose layout is known by name; others are recognised by the tensor's shape.
_BY_BACKEND = {"CPU_ATTN": HEAD_MAJOR_HALVES}


class LayoutError(ValueError):
    """The paged cache is not one this connector can convert."""


@dataclass(frozen=True)
class PagedLayout:
    """One layer's paged tensor as blocks of K and V sections (module notes)."""

    kind: str
    kv_heads: int
    head_dim: int
    block_tokens: int

    def _kv(self, kv: Any, block_id: int) -> tuple[Any, Any]:
        """Views [tokens, kv_heads, head_dim] of block ``block_id``'s K and V."""
        h, n, d = self.kv_heads, self.block_tokens, self.head_dim
        if self.kind == HEAD_MAJOR_HALVES:
            blk = kv[block_id].view(h, 2, n, d)
            return blk[:, 0].permute(1, 0, 2), blk[:, 1].permute(1, 0, 2)
        if self.kind == SPLIT_CONTENT:
            blk = kv[block_id]
            return blk[:, :, :d].permute(1, 0, 2), blk[:, :, d:].permute(1, 0, 2)
        return kv[0, block_id], kv[1, block_id]

    def read(self, kv: Any, block_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of block ``block_id``'s K and V in kvsp-layout-1 (host numpy arrays of the
        cache's element size, bit for bit: module notes)."""
        k, v = self._kv(kv, block_id)
        return _host_bits(k), _host_bits(v)

    def write(self, kv: Any, block_id: int, k: np.ndarray, v: np.ndarray) -> None:
        """Block ``block_id``'s K and V from kvsp-layout-1 arrays ``[tokens, kv_heads, head_dim]``
        of the cache's element size (any dtype of that size: the bits are copied)."""
        import torch  # present: vLLM runs on it

        dst_k, dst_v = self._kv(kv, block_id)
        for dst, src in ((dst_k, k), (dst_v, v)):
            if src.shape != (self.block_tokens, self.kv_heads, self.head_dim):
                raise LayoutError(f"a section of shape {src.shape} is not one block of this layout")
            size = dst.element_size()
            if src.dtype.itemsize != size:
                raise LayoutError(f"a section of {src.dtype.itemsize}-octet elements for a cache of {dst.dtype} "
                                  f"({size}-octet elements)")
            bits = np.require(src, requirements=("C", "W")).view(_NUMPY_BITS[size])
            dst.copy_(torch.from_numpy(bits).view(dst.dtype))


    def _pages(self, kv: Any, block_ids: Any) -> tuple[Any, Any, Any]:
        """(view, K index, V index): ``view[K index]`` is the K of pages ``block_ids`` as
        ``[pages, kv_heads, tokens, head_dim]`` (HEAD_MAJOR_HALVES, SPLIT_CONTENT) or ``[pages,
        tokens, kv_heads, head_dim]`` (KV_FIRST), readable and assignable in one indexed op."""
        h, n, d = self.kv_heads, self.block_tokens, self.head_dim
        if self.kind == HEAD_MAJOR_HALVES:
            view = kv.view(kv.shape[0], h, 2, n, d)
            return view, (block_ids, slice(None), 0), (block_ids, slice(None), 1)
        if self.kind == SPLIT_CONTENT:
            return kv, (block_ids, Ellipsis, slice(None, d)), (block_ids, Ellipsis, slice(d, None))
        return kv, (0, block_ids), (1, block_ids)

    def read_pages(self, kv: Any, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The K and V of pages ``block_ids``, in that order, as one kvsp-layout-1 section each
        ``[pages x tokens, kv_heads, head_dim]`` (one gather per section, bit for bit)."""
        import torch  # present: vLLM runs on it

        view, k_at, v_at = self._pages(kv, torch.tensor(block_ids, device=kv.device))
        out = []
        for at in (k_at, v_at):
            pages = view[at]
            if self.kind != KV_FIRST:
                pages = pages.permute(0, 2, 1, 3)
            out.append(_host_bits(pages).reshape(len(block_ids) * self.block_tokens, self.kv_heads, self.head_dim))
        return out[0], out[1]

    def write_pages(self, kv: Any, block_ids: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """Pages ``block_ids`` from kvsp-layout-1 sections ``[pages x tokens, kv_heads,
        head_dim]`` of the cache's element size (one indexed copy per section)."""
        import torch  # present: vLLM runs on it

        p, n, h, d = len(block_ids), self.block_tokens, self.kv_heads, self.head_dim
        view, k_at, v_at = self._pages(kv, torch.tensor(block_ids, device=kv.device))
        size = kv.element_size()
        for at, src in ((k_at, k), (v_at, v)):
            if src.shape != (p * n, h, d):
                raise LayoutError(f"a section of shape {src.shape} is not {p} pages of this layout")
            if src.dtype.itemsize != size:
                raise LayoutError(f"a section of {src.dtype.itemsize}-octet elements for a cache of {kv.dtype} "
                                  f"({size}-octet elements)")
            bits = torch.from_numpy(np.require(src, requirements=("C", "W")).view(_NUMPY_BITS[size]))
            pages = bits.view(kv.dtype).reshape(p, n, h, d).to(kv.device)
            view[at] = pages if self.kind == KV_FIRST else pages.permute(0, 2, 1, 3)


#: numpy integer dtype holding one element of each size (little-endian, as §4.3's sections are).
_NUMPY_BITS: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


def _host_bits(t: Any) -> np.ndarray:
    """A C-ordered host copy of tensor ``t`` as integers of its element size (module notes)."""
    import torch  # present: vLLM runs on it

    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if integer is None:
        raise LayoutError(f"KV elements of {t.element_size()} octets ({t.dtype}) have no integer view")
    out: np.ndarray = t.detach().to("cpu").contiguous().view(integer).numpy()
    return out


def layout_for(backend: str, shape: tuple[int, ...], *, kv_heads: int, head_dim: int, block_tokens: int) -> PagedLayout:
    """The layout of a layer tensor of ``shape`` under attention backend ``backend``;
    :class:`LayoutError` for one the connector does not know (MLA, hybrid...)."""
    kind = _BY_BACKEND.get(backend)
    if kind is None:
        if len(shape) == 4 and shape[1:] == (kv_heads, block_tokens, 2 * head_dim):
            kind = SPLIT_CONTENT
        elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_tokens, kv_heads, head_dim):
            kind = KV_FIRST
        else:
            raise LayoutError(f"backend {backend}: a KV tensor of shape {shape} is not a known layout "
                              f"for {kv_heads} KV heads x {head_dim} at block size {block_tokens}")
    elif len(shape) != 4 or shape[1:] != (kv_heads, block_tokens, 2 * head_dim):
        raise LayoutError(f"backend {backend}: shape {shape} is not [blocks, {kv_heads}, {block_tokens}, "
                          f"{2 * head_dim}]")
    return PagedLayout(kind, kv_heads, head_dim, block_tokens)
