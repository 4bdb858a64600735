"""Rotary position embeddings (RoPE) as pure tensor math: no config, no modules.

Notation: ``d`` is the head dimension, ``m`` a position. Pair ``i`` of a vector (``i < d/2``) rotates by the angle
``m * theta_i`` with ``theta_i = base ** (-2i / d)``. Two layouts say which two dimensions form pair ``i``:

- ``"interleaved"``: dimensions ``(2i, 2i+1)``; RoFormer's layout and that of its published checkpoints.
- ``"half"``: dimensions ``(i, i + d/2)``; the "rotate-half" layout of GPT-NeoX, Llama-HF and ModernBERT.

The two give the same attention scores once each head's query/key projection rows are permuted by
`interleaved_to_half_permutation`.
"""

from __future__ import annotations

import torch

LAYOUTS = ("interleaved", "half")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")


def inverse_frequencies(head_dim: int, base: float = 10000.0, device: torch.device | None = None) -> torch.Tensor:
    """The rotation speeds ``theta_i = base ** (-2i / head_dim)``, in float64. Shape ``(head_dim // 2,)``."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim}: expected a positive even number")
    if not base > 0:
        raise ValueError(f"base={base}: expected a number > 0")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return base ** -exponents


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, base: float = 10000.0, layout: str = "interleaved"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotation angles for any positions, in float32.

    Angles are formed in float64: at position 2000 a float32 angle is already off by ~1e-4 rad.

    Args:
        position_ids: integer positions, any shape ``(*P)``.
        head_dim: ``d``, the size of each rotated vector.
        base: the frequency base (RoFormer: 10000).
        layout: ``"interleaved"`` or ``"half"``; decides how the ``d/2`` angles spread over ``d`` dimensions.

    Returns:
        ``(cos, sin)``, each of shape ``(*P, d)``.
    """
    _check_layout(layout)
    inv_freq = inverse_frequencies(head_dim, base, device=position_ids.device)
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq  # (*P, d/2)
    if layout == "interleaved":
        angles = angles.repeat_interleave(2, dim=-1)  # theta_0, theta_0, theta_1, theta_1, ...
    else:
        angles = torch.cat((angles, angles), dim=-1)  # theta_0 ... theta_{d/2-1}, theta_0 ...
    return angles.cos().float(), angles.sin().float()


def rotate_pairs(x: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Maps each pair ``(a, b)`` to ``(-b, a)``: a quarter turn, the ``i``-part of the complex product."""
    _check_layout(layout)
    if layout == "interleaved":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotates every pair of ``x`` by its angle. Computed in float32, returned in ``x.dtype``.

    Args:
        x: ``(..., d)``; for attention ``(*tokens, heads, d)``.
        cos, sin: from `rotary_cos_sin`, broadcastable to ``x`` (e.g. ``(*tokens, 1, d)``).
    """
    xf = x.float()
    return (xf * cos + rotate_pairs(xf, layout) * sin).to(x.dtype)


def rotary_phases(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """The rotation of every pair as ``(cos, sin)`` side by side, for `rotate`: shape ``(*P, d/2, 2)``, float32.

    The same angles as `rotary_cos_sin` (formed in float64), one entry per pair instead of one per dimension. The
    layout is that of a complex tensor: ``torch.view_as_complex`` reads it as ``exp(i * m * theta_i)``, no copy.
    """
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inverse_frequencies(head_dim, base, position_ids.device)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def rotate(x: torch.Tensor, phases: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """`apply_rotary` as a complex multiplication: each pair ``(a, b)`` becomes ``(a + ib) * exp(i * angle)``.

    Equal to `apply_rotary` up to float32 rounding. In eager mode it is one complex product, several times faster
    than the real form's five passes over ``x`` (negate, interleave, two products, sum); under `torch.compile`,
    whose code generator has no complex numbers, it is written out in real arithmetic, which the compiler fuses
    into one kernel. Computed in float32, returned in ``x.dtype``.

    Args:
        x: ``(..., d)``; for attention ``(*tokens, heads, d)``.
        phases: from `rotary_phases`, broadcastable to ``(..., d/2, 2)`` (e.g. ``(*tokens, 1, d/2, 2)``).
    """
    _check_layout(layout)
    xf = x.float()
    if layout == "interleaved":
        pairs = xf.unflatten(-1, (-1, 2))  # (..., d/2, 2): pairs are adjacent, as in a complex tensor
    else:
        pairs = torch.stack(xf.chunk(2, dim=-1), dim=-1)
    if torch.compiler.is_compiling():
        (real, imag), (cos, sin) = pairs.unbind(-1), phases.unbind(-1)
        turned = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    else:
        turned = torch.view_as_real(_as_complex(pairs) * _as_complex(phases.float()))
    if layout == "interleaved":
        return turned.flatten(-2).to(x.dtype)
    return torch.cat(turned.unbind(-1), dim=-1).to(x.dtype)


def _as_complex(pairs: torch.Tensor) -> torch.Tensor:
    """``(..., 2)`` float32 -> ``(...)`` complex64: a view when the memory allows one (adjacent pairs, even strides
    and offset), else a copy."""
    if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(stride % 2 for stride in pairs.stride()[:-1]):
        pairs = pairs.clone(memory_format=torch.contiguous_format)
    return torch.view_as_complex(pairs)


def interleaved_to_half_permutation(head_dim: int) -> torch.Tensor:
    """Index ``p`` with ``x_half = x_interleaved[..., p]``: ``[0, 2, 4, ..., 1, 3, 5, ...]``.

    Applied to each head's rows of the query and key projections, it turns a model built for one layout into
    the same model for the other.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim}: expected a positive even number")
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
