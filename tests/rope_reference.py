"""The closed-form rotary math, written independently of `roformer_hf.rotary`, as the tests' reference.

Pair i of a d-vector at position m turns by m * base ** (-2i / d): out = x * cos + rotate_pairs(x) * sin, where
rotate_pairs maps each pair (a, b) to (-b, a).
"""

from __future__ import annotations

import torch


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
                   layout: str = "interleaved") -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of every dimension's angle, float32 (angles formed in float64). Shape (*P, d)."""
    if layout not in ("interleaved", "half"):
        raise ValueError(f"layout={layout!r}: expected one of ('interleaved', 'half')")
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq  # (*P, d/2)
    if layout == "interleaved":
        angles = angles.repeat_interleave(2, dim=-1)  # theta_0, theta_0, theta_1, theta_1, ...
    else:
        angles = torch.cat((angles, angles), dim=-1)  # theta_0 ... theta_{d/2-1}, theta_0 ...
    return angles.cos().float(), angles.sin().float()


def rotate_pairs(x: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Each pair (a, b) -> (-b, a): a quarter turn."""
    if layout == "interleaved":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotates every pair of x by its angle, in float32; returned in x.dtype."""
    xf = x.float()
    return (xf * cos + rotate_pairs(xf, layout) * sin).to(x.dtype)
