"""examples/length_extrapolation.py end to end on tiny settings: it trains, scores every rope type at every length,
writes its plot and prints its table."""

from __future__ import annotations

import length_extrapolation
import pytest


def test_writes_the_plot_and_prints_a_table_with_every_type_and_length(tmp_path, capsys):
    losses = length_extrapolation.main(["--output_dir", str(tmp_path), "--steps", "4", "--train_length", "16",
                                        "--batch_size", "4", "--vocab_size", "300", "--eval_tokens", "512",
                                        "--eval_batch_tokens", "256", "--max_lines", "3000"])
    assert list(losses) == list(length_extrapolation.ROPE_TYPES)
    assert all(list(by_length) == [16, 32, 64, 128] for by_length in losses.values())
    # At the training length every type is the unscaled rotation (factor 1, or dynamic/longrope within the
    # original length), so the first column is the same for all. (Four steps teach the model too little for the
    # types to differ beyond it; tests/features/test_rope_scaling.py tests what each type does.)
    at_training_length = [by_length[16] for by_length in losses.values()]
    assert at_training_length == pytest.approx([losses["none"][16]] * len(losses), abs=1e-4)
    printed = capsys.readouterr().out
    table = printed[printed.index("| rope_parameters"):].splitlines()
    assert table[0].startswith("| rope_parameters | 16 (1x) | 32 (2x) | 64 (4x) | 128 (8x)")
    assert [row.split(" | ")[0] for row in table[2:8]] == [f"| {name}" for name in length_extrapolation.ROPE_TYPES]
    assert (tmp_path / "length_extrapolation.png").read_bytes().startswith(b"\x89PNG")
    assert [path.name for path in tmp_path.iterdir()] == ["length_extrapolation.png"]
