"""Rotary math against closed forms: complex multiplication, relative positions, norms, layouts."""

import pytest
import torch
from helpers import apply_rotary, rotary_cos_sin, rotate_pairs

from roformer_hf.rotary import (
    check_layout,
    interleaved_to_half_permutation,
    inverse_frequencies,
    rotary_phases,
    rotate,
)


def phases_of(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    return rotary_phases(positions, inverse_frequencies(head_dim, base))


def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Seed 000's formula: adjacent dims (2i, 2i+1) are a complex number multiplied by e^{i m theta_i}."""
    d = x.shape[-1]
    theta = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * theta  # (L, d/2)
    rotation = torch.polar(torch.ones_like(angles), angles)
    as_complex = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], d // 2, 2))
    return torch.view_as_real(as_complex * rotation).flatten(-2)


@pytest.mark.parametrize("base", [10000.0, 1e6])
def test_interleaved_equals_complex_multiplication(base):
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 5, 100, 2047, 5000])
    x = torch.randn(6, 16, dtype=torch.float64)
    cos, sin = rotary_cos_sin(positions, 16, base, "interleaved")
    ours = apply_rotary(x, cos, sin, "interleaved")
    torch.testing.assert_close(ours, complex_rope(x, positions, base), atol=1e-6, rtol=0)


def test_inverse_frequencies_closed_form():
    d = 64
    expected = torch.tensor([10000.0 ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    torch.testing.assert_close(inverse_frequencies(d), expected)


def test_cos_sin_match_transformers_sinusoidal_table():
    """transformers' RoFormer stores sin in columns [:d/2] and cos in [d/2:] of a frozen table."""
    from transformers.models.roformer.modeling_roformer import RoFormerSinusoidalPositionalEmbedding

    d, n = 16, 3000
    table = RoFormerSinusoidalPositionalEmbedding(n, d).create_weight()
    cos, sin = rotary_cos_sin(torch.arange(n), d, layout="interleaved")
    torch.testing.assert_close(sin[:, 0::2], table[:, : d // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(cos[:, 0::2], table[:, d // 2 :], atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_scores_depend_only_on_relative_position(layout):
    torch.manual_seed(1)
    d = 32
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        cos, sin = rotary_cos_sin(torch.tensor([m, n]), d, layout=layout)
        return apply_rotary(q, cos[0], sin[0], layout) @ apply_rotary(k, cos[1], sin[1], layout)

    for offset in (1, 17, 900):
        torch.testing.assert_close(score(3, 10), score(3 + offset, 10 + offset), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(3, 10), score(3, 11))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rotation_preserves_norm(layout):
    torch.manual_seed(2)
    x = torch.randn(50, 4, 24)
    cos, sin = rotary_cos_sin(torch.arange(50), 24, layout=layout)
    rotated = apply_rotary(x, cos[:, None], sin[:, None], layout)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rotated[1:], x[1:])  # position 0 is the identity, the others really rotate


def test_position_zero_is_identity():
    x = torch.randn(3, 8)
    cos, sin = rotary_cos_sin(torch.zeros(3, dtype=torch.long), 8)
    torch.testing.assert_close(apply_rotary(x, cos, sin), x)


def test_interleaved_equals_half_after_permutation():
    """Permuting q and k by [0,2,4,...,1,3,5,...] turns interleaved rotary into rotate-half rotary."""
    torch.manual_seed(3)
    d = 16
    q, k = torch.randn(10, d), torch.randn(10, d)
    perm = interleaved_to_half_permutation(d)
    cos_i, sin_i = rotary_cos_sin(torch.arange(10), d, layout="interleaved")
    cos_h, sin_h = rotary_cos_sin(torch.arange(10), d, layout="half")
    scores_interleaved = apply_rotary(q, cos_i, sin_i) @ apply_rotary(k, cos_i, sin_i).T
    scores_half = apply_rotary(q[:, perm], cos_h, sin_h, "half") @ apply_rotary(k[:, perm], cos_h, sin_h, "half").T
    torch.testing.assert_close(scores_half, scores_interleaved, atol=1e-5, rtol=1e-5)
    # Without the permutation the two layouts disagree.
    scores_unpermuted = apply_rotary(q, cos_h, sin_h, "half") @ apply_rotary(k, cos_h, sin_h, "half").T
    assert not torch.allclose(scores_unpermuted, scores_interleaved, atol=1e-3)


def test_rotate_pairs_is_a_quarter_turn():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_pairs(x, "interleaved").tolist() == [-2.0, 1.0, -4.0, 3.0]
    assert rotate_pairs(x, "half").tolist() == [-3.0, -4.0, 1.0, 2.0]


def test_half_precision_inputs_keep_their_dtype_and_accuracy():
    x = torch.randn(20, 2, 16)
    cos, sin = rotary_cos_sin(torch.arange(20), 16)
    full = apply_rotary(x, cos[:, None], sin[:, None])
    half = apply_rotary(x.bfloat16(), cos[:, None], sin[:, None])
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, atol=5e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_rotate_equals_the_real_formula(layout, dtype):
    """The model's kernel (one complex multiplication) against `apply_rotary`'s cos/sin arithmetic: values, dtype
    and gradients, at positions far past any table."""
    torch.manual_seed(3)
    positions = torch.tensor([0, 1, 7, 511, 4095, 20000])
    x = torch.randn(6, 4, 32).to(dtype).requires_grad_()
    cos, sin = rotary_cos_sin(positions, 32, layout=layout)
    fast = rotate(x, phases_of(positions, 32)[:, None], layout)
    reference = apply_rotary(x, cos[:, None], sin[:, None], layout)
    assert fast.dtype == dtype
    exact = dtype == torch.float32
    torch.testing.assert_close(fast, reference, atol=1e-5 if exact else 1e-2, rtol=1e-5 if exact else 1e-2)
    grad = torch.randn_like(reference)
    (fast_grad,), (reference_grad,) = (torch.autograd.grad(y, x, grad) for y in (fast, reference))
    torch.testing.assert_close(fast_grad, reference_grad, atol=1e-5 if exact else 1e-2, rtol=1e-5 if exact else 1e-2)


def test_rotate_takes_any_memory_layout_and_phase_dtype():
    """Views at odd offsets, transposed phases and bf16 phases cannot be read as complex numbers in place; rotate
    must still give the real formula's result."""
    positions = torch.arange(3)
    cos, sin = rotary_cos_sin(positions, 8)
    x = torch.randn(25)[1:].view(3, 8)  # contiguous, storage offset 1
    expected = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotate(x, phases_of(positions, 8)), expected)
    transposed = phases_of(positions, 8).transpose(-1, -2).contiguous().transpose(-1, -2)  # last stride 4
    torch.testing.assert_close(rotate(x, transposed), expected)
    torch.testing.assert_close(rotate(x, phases_of(positions, 8).bfloat16()), expected, atol=2e-2, rtol=2e-2)


def test_phases_are_cos_and_sin_of_the_rotation_angles():
    positions = torch.tensor([0, 3, 1000])
    phases = phases_of(positions, 8, base=100.0)
    assert phases.shape == (3, 4, 2) and phases.dtype == torch.float32
    angles = positions[:, None].double() * torch.tensor([100.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64)
    torch.testing.assert_close(phases[..., 0].double(), angles.cos(), atol=1e-7, rtol=0)
    torch.testing.assert_close(phases[..., 1].double(), angles.sin(), atol=1e-7, rtol=0)
    torch.testing.assert_close(torch.view_as_complex(phases).abs(), torch.ones(3, 4))  # unit complex numbers


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_compiled_rotate_equals_the_real_formula(layout):
    """Under torch.compile `rotate` takes its real-arithmetic branch; it must agree with eager `apply_rotary`."""
    torch.manual_seed(4)
    positions = torch.arange(0, 3000, 100)
    x = torch.randn(30, 2, 16)
    cos, sin = rotary_cos_sin(positions, 16, layout=layout)
    compiled = torch.compile(rotate, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, phases_of(positions, 16)[:, None], layout),
                               apply_rotary(x, cos[:, None], sin[:, None], layout), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: inverse_frequencies(7), "head_dim=7"),
        (lambda: inverse_frequencies(8, base=0), "base=0"),
        (lambda: check_layout("spiral"), "layout='spiral'"),
        (lambda: interleaved_to_half_permutation(5), "head_dim=5"),
        (lambda: rotate(torch.zeros(2, 8), torch.ones(2, 4, 2), "spiral"), "layout='spiral'"),
    ],
)
def test_invalid_arguments_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
