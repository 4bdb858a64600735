"""RoFormerConfig: defaults, validation, and reading transformers' RoFormer configs."""

import json

import numpy as np
import pytest
import transformers

import roformer_hf
from roformer_hf import RoFormerConfig


def test_defaults_match_transformers_roformer():
    ours, theirs = RoFormerConfig(), transformers.RoFormerConfig()
    for field in ("vocab_size", "embedding_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob",
                  "max_position_embeddings", "type_vocab_size", "initializer_range", "layer_norm_eps",
                  "pad_token_id", "rotary_value", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.rope_theta, ours.rotary_layout, ours.norm_position) == (10000.0, "interleaved", "post")
    assert ours.model_type == "roformer_hf"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"hidden_size": 64, "num_attention_heads": 5}, "num_attention_heads"),
        ({"hidden_size": 12, "num_attention_heads": 4}, "num_attention_heads"),  # head_dim 3 is odd
        ({"rotary_layout": "rotate"}, "rotary_layout"),
        ({"norm_position": "middle"}, "norm_position"),
        ({"classifier_pooling": "max"}, "classifier_pooling"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rope_theta": -5.0}, "rope_theta"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob"),
        ({"chunk_size_feed_forward": -1}, "chunk_size_feed_forward"),
        ({"hidden_act": "nonexistent"}, "hidden_act"),
        ({"vocab_size": 97, "pad_token_id": 200}, "pad_token_id"),
        ({"rope_theta": "abc"}, "rope_theta"),
        ({"hidden_dropout_prob": None}, "hidden_dropout_prob"),
        ({"classifier_dropout": 2.0}, "classifier_dropout"),
        ({"layer_norm_eps": -1.0}, "layer_norm_eps"),
        ({"num_labels": 0}, "num_labels"),
        ({"chunk_size_feed_forward": 2.5}, "chunk_size_feed_forward"),
    ],
)
def test_invalid_values_fail_at_construction_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RoFormerConfig(**kwargs)


def test_transformers_roformer_config_json_loads(tmp_path):
    transformers.RoFormerConfig(vocab_size=123, hidden_size=64, embedding_size=32, num_attention_heads=4,
                                rotary_value=True).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "roformer"
    config = RoFormerConfig.from_pretrained(tmp_path)
    assert (config.vocab_size, config.hidden_size, config.embedding_size, config.rotary_value) == (123, 64, 32, True)
    assert config.model_type == "roformer_hf"


def test_round_trip_keeps_new_fields(tmp_path):
    RoFormerConfig(rope_theta=1e6, rotary_layout="half", norm_position="pre",
                   classifier_pooling="mean").save_pretrained(tmp_path)
    config = RoFormerConfig.from_pretrained(tmp_path)
    assert (config.rope_theta, config.rotary_layout, config.norm_position, config.classifier_pooling) == (
        1e6, "half", "pre", "mean")


def test_numpy_scalars_are_numbers():
    config = RoFormerConfig(hidden_dropout_prob=np.float32(0.25), rope_theta=np.int64(500),
                            layer_norm_eps=np.float32(1e-6))
    assert config.rope_theta == 500 and config.hidden_dropout_prob == 0.25


def test_auto_config_is_registered_and_roformer_is_untouched():
    assert isinstance(transformers.AutoConfig.for_model("roformer_hf"), RoFormerConfig)
    assert type(transformers.AutoConfig.for_model("roformer")) is transformers.RoFormerConfig
    assert roformer_hf.RoFormerConfig is RoFormerConfig


def test_decoder_switches_must_be_booleans():
    with pytest.raises(ValueError, match="is_decoder='yes': expected True or False"):
        RoFormerConfig(is_decoder="yes")
