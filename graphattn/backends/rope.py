"""Rotary position embedding (NeoX halves), the plain-torch math the fused op follows."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "cos_sin", "inv_frequencies", "rope", "rope_cos_sin"]


def inv_frequencies(head_dim: int, theta: float,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [head_dim / 2]: theta ** (-2i / head_dim)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                         dtype=torch.float32) / head_dim))


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [T, 1, D / 2] cos and sin of the angles positions[t] * inv_freq (float32)."""
    ang = positions.float()[:, None] * inv_freq[None]
    return ang.cos()[:, None], ang.sin()[:, None]


def rope_cos_sin(positions: torch.Tensor, head_dim: int,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos_sin` at `positions` [T] of the frequencies of `head_dim` and `theta`."""
    return cos_sin(positions, inv_frequencies(head_dim, theta, positions.device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x [T, heads, D] by the angles of `rope_cos_sin`."""
    d = x.shape[-1]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] at `positions` [T]."""
    return apply_rope(x, *rope_cos_sin(positions, x.shape[-1], theta))
