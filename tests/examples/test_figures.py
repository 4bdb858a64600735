"""The demo's pictures (examples/figures.py): RoFormer's long-term decay bound against the formula written out
with Python's complex numbers, and every plot written as a PNG file."""

import cmath

import pytest
from figures import plot_loss_curves, plot_rotary_decay, plot_rotary_rotation, relative_upper_bound

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _bound_by_hand(head_dim: int, base: float, distance: int) -> float:
    """(1 / (d/2)) * sum_{j=1}^{d/2} |S_j|, S_j = sum_{k=0}^{j-1} exp(i * distance * theta_k)."""
    thetas = [base ** (-2 * k / head_dim) for k in range(head_dim // 2)]
    partial, total = 0j, 0.0
    for theta in thetas:
        partial += cmath.exp(1j * distance * theta)
        total += abs(partial)
    return total / len(thetas)


@pytest.mark.parametrize("head_dim, base", [(8, 10_000.0), (64, 10_000.0), (64, 500.0)])
def test_relative_upper_bound_matches_the_formula(head_dim, base):
    bound = relative_upper_bound(head_dim, base, max_distance=300)
    assert bound.shape == (301,)
    assert bound[0].item() == pytest.approx((head_dim / 2 + 1) / 2)  # every term is 1 at distance 0
    for distance in (1, 7, 50, 300):
        assert bound[distance].item() == pytest.approx(_bound_by_hand(head_dim, base, distance), rel=1e-5)


def test_the_bound_decays_with_distance():
    bound = relative_upper_bound(64, 10_000.0, max_distance=512)
    assert bound[400:].mean() < 0.5 * bound[:20].mean()


def test_plots_are_written(tmp_path):
    history = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "eval_loss": 1.7}]
    paths = [plot_rotary_decay(tmp_path / "decay.png", max_distance=64),
             plot_rotary_rotation(tmp_path / "rotation.png"),
             plot_loss_curves({"run": (history, 2)}, tmp_path / "loss.png")]
    for path in paths:
        assert path.read_bytes().startswith(PNG_SIGNATURE)
