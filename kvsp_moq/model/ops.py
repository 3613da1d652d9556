"""The reference model's building blocks (float32, one sequence, no batch dimension).

Tensors are token-major like the cache layout of kvsp-draft §4.3: activations ``[T, d]``,
per-head tensors ``[T, heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["apply_rope", "attention", "rms_norm", "rope_tables", "swiglu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, 1, head_dim]`` for absolute ``positions`` (RoPE, rotate-half form:
    dimension i pairs with i + head_dim/2, frequency theta^(-2i/head_dim))."""
    half = head_dim // 2
    exponent = torch.arange(half, dtype=torch.float64, device=positions.device) * 2.0 / head_dim
    inv_freq = torch.pow(torch.tensor(theta, dtype=torch.float64, device=positions.device), -exponent)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # float64: exact tables
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(torch.float32)[:, None, :], angles.sin().to(torch.float32)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by its positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> torch.Tensor:
    """Causal grouped-query attention of the new tokens over the whole cache.

    ``q`` ``[T, heads, hd]`` holds the new tokens at positions ``start .. start+T-1``;
    ``k``/``v`` ``[start+T, kv_heads, hd]`` hold the cache including them. Query head ``h``
    reads KV head ``h // (heads / kv_heads)``. Returns ``[T, heads * hd]``.
    """
    t, heads, hd = q.shape
    s, kv_heads, _ = k.shape
    group = heads // kv_heads
    qh = q.transpose(0, 1)  # [heads, T, hd]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, S, hd]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * (hd ** -0.5)  # [heads, T, S]
    query_pos = torch.arange(start, start + t, device=q.device)[:, None]
    key_pos = torch.arange(s, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)  # [heads, T, hd]
    return out.transpose(0, 1).reshape(t, heads * hd)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
