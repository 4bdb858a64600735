"""Tests of roformer_hf.summary: torchinfo's layer table with tied weights counted once."""

import pytest

from roformer_hf import (
    RoFormerConfig,
    RoFormerForMaskedLM,
    RoFormerForMultipleChoice,
    RoFormerForSequenceClassification,
    summary,
)

TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


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
