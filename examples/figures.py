"""The demo's pictures (matplotlib, Agg backend): training curves, and rotary position embeddings drawn from
`roformer_hf.rotary` itself.

    python examples/figures.py --output_dir docs     # the two rotary pictures alone, no training

- `plot_loss_curves`: training and validation loss of each run, with the step whose weights were kept marked.
- `plot_rotary_decay`: RoFormer's long-term decay (paper, section 3.4.3): the upper bound of a query-key score
  shrinks with the distance between the two tokens, more slowly for large head sizes and bases.
- `plot_rotary_rotation`: one vector rotated by positions 0, 1, 2, ...: each pair of dimensions turns on its own
  circle, at its own speed.

`pyplot` and `save_figure`: matplotlib without a display, and a figure written and closed, for the examples that draw.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from roformer_hf.rotary import inverse_frequencies, rotary_phases, rotate


def pyplot():
    """matplotlib's pyplot on the Agg backend: the examples write files and need no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    """Lays `fig` out, writes it to `path` and closes it (pyplot keeps every figure open until then)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def relative_upper_bound(head_dim: int, base: float, max_distance: int) -> torch.Tensor:
    """RoFormer's bound on a query-key score at relative distances 0..max_distance, up to a constant.

    With ``S_j = sum_{k<j} exp(i * r * theta_k)`` (paper, eq. 37), the score of two tokens ``r`` apart is bounded
    by ``max_j |h_{j+1} - h_j| * sum_{j=1}^{d/2} |S_j|``; the curve is ``(1 / (d/2)) * sum_j |S_j|``, which starts at
    ``(d/2 + 1) / 2`` for ``r = 0``. The angles ``r * theta_k`` come from `rotary_phases`.

    Returns:
        ``(max_distance + 1,)`` float64.
    """
    phases = rotary_phases(torch.arange(max_distance + 1), inverse_frequencies(head_dim, base))  # (R, d/2, 2)
    terms = torch.view_as_complex(phases.double().contiguous())  # exp(i * r * theta_k)
    partial_sums = terms.cumsum(dim=-1)  # S_1 .. S_{d/2}
    return partial_sums.abs().mean(dim=-1)


def plot_rotary_decay(path: Path, max_distance: int = 512) -> Path:
    """The long-term decay of the relative upper bound: for head sizes 32/64/128 at rope_theta 10000 (RoFormer's
    default), and for rope_theta 500/10^4/10^6 at head size 64."""
    plt = pyplot()
    panels = {"head size (rope_theta=10000)": [(32, 1e4), (64, 1e4), (128, 1e4)],
              "rope_theta (head_dim=64)": [(64, 500.0), (64, 1e4), (64, 1e6)]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (title, settings) in zip(axes, panels.items()):
        for head_dim, base in settings:
            bound = relative_upper_bound(head_dim, base, max_distance)
            # Normalised to 1 at distance 0, so head sizes compare on one axis.
            ax.plot(bound / bound[0], label=f"head_dim={head_dim}, rope_theta={base:g}", linewidth=1)
        ax.set(xlabel="relative distance between query and key (tokens)", title=title, xlim=(0, max_distance),
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("relative upper bound (1 at distance 0)")
    fig.suptitle("RoFormer's long-term decay (paper, section 3.4.3): (1/(d/2)) * sum_j |S_j|, "
                 "S_j = sum_{k<j} exp(i * distance * theta_k)", fontsize=10)
    return save_figure(fig, path)


def plot_rotary_rotation(path: Path, head_dim: int = 8, base: float = 10_000.0, points: int = 12) -> Path:
    """One vector, every pair set to (1, 0), rotated by `rotate` (interleaved layout), one panel per pair.

    Pair i turns by theta_i per token, so the panels sample positions 0, s_i, 2 s_i, ... with s_i near half a
    radian's worth of tokens: the fastest pair turns at every token, the slowest needs thousands of tokens to
    turn as far. That is why a model can tell nearby tokens apart with the fast pairs and distant ones with the
    slow pairs."""
    plt = pyplot()
    inv_freq = inverse_frequencies(head_dim, base)
    x = torch.tensor([1.0, 0.0]).repeat(head_dim // 2)  # (d,): every pair points along the first axis
    fig, axes = plt.subplots(1, head_dim // 2, figsize=(3.2 * head_dim // 2, 3.6))
    circle = torch.linspace(0, 2 * torch.pi, 200)
    for pair, ax in enumerate(axes):
        stride = max(1, round(0.5 / inv_freq[pair].item()))
        positions = torch.arange(points) * stride
        phases = rotary_phases(positions, inv_freq)  # (P, d/2, 2)
        rotated = rotate(x.expand(points, head_dim), phases).unflatten(-1, (-1, 2))[:, pair]  # (P, 2)
        ax.plot(circle.cos(), circle.sin(), color="0.85", linewidth=1)
        ax.plot(rotated[:, 0], rotated[:, 1], "-", color="0.6", linewidth=0.8)
        ax.scatter(rotated[:, 0], rotated[:, 1], c=range(points), cmap="viridis", s=28, zorder=3)
        for index in (0, 1, points - 1):
            ax.annotate(f"m={positions[index]}", rotated[index].tolist(), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
        ax.set(title=f"pair {pair}: dims ({2 * pair}, {2 * pair + 1}), theta={inv_freq[pair]:.3g}\n"
                     f"positions 0, {stride}, {2 * stride}, ..., {positions[-1]}",
               xlim=(-1.3, 1.3), ylim=(-1.3, 1.3), aspect="equal")
        ax.axhline(0, color="k", linewidth=0.5)
        ax.axvline(0, color="k", linewidth=0.5)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"rotary_phases + rotate on (1, 0, 1, 0, ...): pair i at position m turned by m * theta_i "
                 f"(head_dim={head_dim}, rope_theta={base:g})", fontsize=10)
    return save_figure(fig, path)


def plot_loss_curves(runs: dict[str, tuple[list[dict], int | None]], path: Path) -> Path:
    """One panel per run: its training loss, its validation loss, and a marker at `kept_step`.

    Args:
        runs: title -> (Trainer `state.log_history`, the step whose weights were kept).
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (title, (history, kept_step)) in zip(axes[0], runs.items()):
        train = [(h["step"], h["loss"]) for h in history if "loss" in h]
        evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
        if train:
            ax.plot(*zip(*train), label="training loss", linewidth=1)
        if evals:
            ax.plot(*zip(*evals), "o-", label="validation loss")
        if kept_step is not None:
            ax.axvline(kept_step, color="tab:red", linestyle="--", linewidth=1, label=f"kept: step {kept_step}")
        ax.set(title=title, xlabel="step", ylabel="loss")
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="docs")
    args = parser.parse_args()
    folder = Path(args.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for written in (plot_rotary_decay(folder / "rotary_decay.png"),
                    plot_rotary_rotation(folder / "rotary_rotation.png")):
        print(written)


if __name__ == "__main__":
    main()
