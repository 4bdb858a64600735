"""Tests of roformer_hf.summary: torchinfo's layer table with tied weights counted once."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from roformer_hf import (
    RoFormerConfig,
    RoFormerForMaskedLM,
    RoFormerForMultipleChoice,
    RoFormerForSequenceClassification,
    summary,
)
from roformer_hf.summary import example_inputs

TINY = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64}


def test_tied_masked_lm_total_counts_the_decoder_once():
    model = RoFormerForMaskedLM(RoFormerConfig(**TINY))
    assert model.cls.predictions.decoder.weight is model.get_input_embeddings().weight
    stats = summary(model, seq_len=16)
    assert stats.total_params == stats.trainable_params == model.num_parameters()
    assert stats.double_counted_params == 100 * 32  # what torchinfo 1.8.0 adds for the tied decoder
    assert stats.total_param_bytes == 4 * model.num_parameters()
    text = repr(stats)
    assert f"Total params: {model.num_parameters():,}\n" in text
    assert "Shared (tied) params" in text


def test_classifier_total_and_trainable_params():
    model = RoFormerForSequenceClassification(RoFormerConfig(**TINY, num_labels=3))
    model.roformer.embeddings.requires_grad_(False)
    stats = summary(model, batch_size=2, seq_len=8)
    assert stats.total_params == model.num_parameters()
    assert stats.trainable_params == model.num_parameters(only_trainable=True) < stats.total_params
    assert stats.double_counted_params == 0
    assert "Shared (tied) params" not in repr(stats)


def test_encoder_layers_are_rows_with_their_output_shape():
    stats = summary(RoFormerForSequenceClassification(RoFormerConfig(**TINY)), batch_size=3, seq_len=8)
    layers = [row for row in stats.summary_list if row.class_name == "RoFormerLayer"]
    assert [row.var_name for row in layers] == ["0", "1"]
    assert all(row.output_size == [3, 8, 32] for row in layers)
    assert "RoFormerLayer (1): 4-2" in repr(stats)  # shown at the default depth


def test_summary_of_a_config_builds_a_masked_lm():
    config = RoFormerConfig(**TINY)
    stats = summary(config, seq_len=16)
    assert stats.summary_list[0].class_name == "RoFormerForMaskedLM"
    assert stats.summary_list[0].output_size == [1, 16, 100]  # logits over the vocabulary
    assert stats.total_params == RoFormerForMaskedLM(config).num_parameters()


def test_multiple_choice_gets_three_dimensional_inputs():
    stats = summary(RoFormerForMultipleChoice(RoFormerConfig(**TINY)), batch_size=2, seq_len=8)
    assert stats.summary_list[0].output_size == [2, 2]  # (batch, num_choices)


def test_bad_arguments_are_rejected():
    config = RoFormerConfig(**TINY)
    with pytest.raises(ValueError, match="seq_len"):
        summary(config, seq_len=0)
    with pytest.raises(ValueError, match="model_or_config"):
        summary({"hidden_size": 32})
    with pytest.raises(ValueError, match="input_data"):
        summary(config, input_data={})


def _matrix_product_macs_by_hand(config: RoFormerConfig, batch_size: int, seq_len: int) -> int:
    """From the config alone: per layer the q, k, v and output projections (4 H²) and the feed-forward (2 H I)
    for every token, the MLM head's transform (H E) and decoder (E V) for every token, and attention's q·kᵀ and
    probabilities·v (2 L² H per sequence and layer)."""
    hidden, inter, emb, vocab = config.hidden_size, config.intermediate_size, config.embedding_size, config.vocab_size
    tokens = batch_size * seq_len
    linear = tokens * (config.num_hidden_layers * (4 * hidden**2 + 2 * hidden * inter) + hidden * emb + emb * vocab)
    attention = config.num_hidden_layers * batch_size * 2 * seq_len**2 * hidden
    return linear + attention


def test_mult_adds_count_every_token_and_attention():
    """torchinfo 1.8.0 counts a Linear on (B, L, H) once per row of the batch; ours counts every token, against a
    count by hand and against torch's FLOP counter on the eager forward (2 FLOPs per multiply-accumulate)."""
    config = RoFormerConfig(**TINY)
    model = RoFormerForMaskedLM._from_config(config, attn_implementation="eager").eval()
    stats = summary(model, batch_size=2, seq_len=16)
    assert stats.total_mult_adds == _matrix_product_macs_by_hand(config, 2, 16) == 724_992
    assert stats.attention_mult_adds == 2 * 2 * 2 * 16**2 * 32
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**example_inputs(model, batch_size=2, seq_len=16))
    assert counter.get_total_flops() == 2 * stats.total_mult_adds
    text = repr(stats)
    assert "Total mult-adds (M): 0.72\n" in text
    assert "Units." not in text


def test_mult_adds_scale_with_the_sequence_length():
    model = RoFormerForSequenceClassification(RoFormerConfig(**TINY, num_labels=3))
    short, long = (summary(model, seq_len=n).total_mult_adds for n in (8, 64))
    # The classifier head runs on one token per sequence: only the encoder grows with the length.
    head = 32 * 32 + 32 * 3
    encoder_per_token = 2 * (4 * 32**2 + 2 * 32 * 64)
    assert short == 8 * encoder_per_token + 2 * 2 * 8**2 * 32 + head
    assert long == 64 * encoder_per_token + 2 * 2 * 64**2 * 32 + head
