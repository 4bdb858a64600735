"""Rotary position embeddings (RoPE) as pure tensor math: no config, no modules.

Notation: ``d`` is the head dimension, ``m`` a position. Pair ``i`` of a vector (``i < d/2``) rotates by the angle
``m * theta_i``; RoFormer's frequencies are ``theta_i = base ** (-2i / d)`` (`inverse_frequencies`), but any
``(d/2,)`` tensor of frequencies works, e.g. those of transformers' ``ROPE_INIT_FUNCTIONS``. Two layouts say which
two dimensions form pair ``i``:

- ``"interleaved"``: dimensions ``(2i, 2i+1)``; RoFormer's layout and that of its published checkpoints.
- ``"half"``: dimensions ``(i, i + d/2)``; the "rotate-half" layout of GPT-NeoX, Llama-HF and ModernBERT.

The two give the same attention scores once each head's query/key projection rows are permuted by
`interleaved_to_half_permutation`.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

RotaryLayout = Literal["interleaved", "half"]  # the type of `RoFormerConfig.rotary_layout`
ROTARY_LAYOUTS = get_args(RotaryLayout)


def check_head_dim(head_dim: int) -> None:
    """Rotation works on pairs of dimensions: the head dimension must be positive and even."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim}: expected a positive even number (dimensions rotate in pairs)")


def check_layout(layout: str) -> None:
    if layout not in ROTARY_LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {ROTARY_LAYOUTS}")


def inverse_frequencies(head_dim: int, base: float = 10000.0, device: torch.device | None = None) -> torch.Tensor:
    """RoFormer's rotation speeds ``theta_i = base ** (-2i / head_dim)``, in float64. Shape ``(head_dim // 2,)``."""
    check_head_dim(head_dim)
    if not base > 0:
        raise ValueError(f"base={base}: expected a number > 0")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return base ** -exponents


def rotary_phases(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The rotation of every pair at every position as ``(cos, sin)`` side by side, for `rotate`.

    Angles ``m * theta_i`` are formed in float64 (at position 2000 a float32 angle is already off by ~1e-4 rad),
    the result is float32. Its memory layout is that of a complex tensor: ``torch.view_as_complex`` reads it as
    ``exp(i * m * theta_i)`` without a copy.

    Args:
        position_ids: integer positions, any shape ``(*P)``.
        inv_freq: the frequencies ``theta``, ``(d/2,)``: `inverse_frequencies`, or any other schedule.

    Returns:
        ``(*P, d/2, 2)`` float32.
    """
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq.to(position_ids.device, torch.float64)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def rotate(x: torch.Tensor, phases: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotates every pair ``(a, b)`` of ``x`` by its angle: ``(a + ib) * exp(i * angle)``.

    Computed in float32, returned in ``x.dtype``. In eager mode this is one complex multiplication (several times
    faster than five real passes over ``x``); while tracing (`torch.compile`, `torch.export`, `torch.jit.trace`),
    whose code generators and ONNX have no complex numbers, the same product is written in real arithmetic.

    Args:
        x: ``(..., d)``; for attention ``(*tokens, heads, d)``.
        phases: from `rotary_phases`, broadcastable to ``(..., d/2, 2)`` (e.g. ``(*tokens, 1, d/2, 2)``); or the same
            as complex64, ``torch.view_as_complex(phases)``, which spares each call that view.
        layout: ``"interleaved"`` or ``"half"``: which dimensions form a pair.
    """
    check_layout(layout)
    xf = x.float()
    if layout == "interleaved":
        pairs = xf.unflatten(-1, (-1, 2))  # (..., d/2, 2): pairs are adjacent, as in a complex tensor
    else:
        pairs = torch.stack(xf.chunk(2, dim=-1), dim=-1)
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # transformers' is_tracing, without its CUDA checks
        phases = torch.view_as_real(phases) if phases.is_complex() else phases.float()
        (real, imag), (cos, sin) = pairs.unbind(-1), phases.unbind(-1)
        turned = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    else:
        turns = phases if phases.is_complex() else _as_complex(phases.float())
        if xf is x:
            turned = torch.view_as_real(_as_complex(pairs) * turns)
        else:  # xf is already our float32 copy of a lower-precision x: rotate it in place, no second buffer
            turned = torch.view_as_real(_as_complex(pairs).mul_(turns))
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
    check_head_dim(head_dim)
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
