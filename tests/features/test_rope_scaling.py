"""RoPE scaling (`rope_parameters`): the config reads and saves them as transformers 5's decoder configs do, and the
model rotates by transformers' own frequencies and attention factor, checked against Llama's rotary embedding."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import padded_batch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import roformer_hf
from roformer_hf import RoFormerConfig

SIZES = {"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 48, "max_position_embeddings": 16, "hidden_dropout_prob": 0.0,
         "attention_probs_dropout_prob": 0.0,
         "initializer_range": 0.3}  # weights large enough for sharp, position-dependent attention
HALF = SIZES["hidden_size"] // SIZES["num_attention_heads"] // 2  # frequencies per head
ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 500.0},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0},
    "yarn-tuned": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0,
                   "mscale_all_dim": 0.5, "original_max_position_embeddings": 8},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0 + i / 10 for i in range(HALF)],
                 "long_factor": [1.0 + i for i in range(HALF)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "rope_theta": 1000.0},
}


def config(rope_parameters: dict | None = None, **overrides) -> RoFormerConfig:
    return RoFormerConfig(**{**SIZES, **overrides}, rope_parameters=copy.deepcopy(rope_parameters))


def models(*rope_cases: dict | None, **overrides) -> list[roformer_hf.RoFormerForMaskedLM]:
    """MLM models with the same weights (rotation has none) and different rope parameters."""
    torch.manual_seed(0)
    first = roformer_hf.RoFormerForMaskedLM(config(rope_cases[0], **overrides)).eval()
    built = [first]
    for case in rope_cases[1:]:
        model = roformer_hf.RoFormerForMaskedLM(config(case, **overrides)).eval()
        model.load_state_dict(first.state_dict())
        built.append(model)
    return built


def logits(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def ids_of_length(length: int, batch_size: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, SIZES["vocab_size"], (batch_size, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("length", [6, 16, 40])
def test_attention_equals_llamas_rotary_embedding(case, length):
    """Layer 0's attention weights, recomputed from its input with Llama's rotary module (transformers' frequencies,
    its cos/sin scaled by the attention factor, rotate-half pairs): the same angles and the same attention factor,
    within and beyond the training length (where "dynamic" and "longrope" change their frequencies)."""
    model = roformer_hf.RoFormerModel(config(ROPE_CASES[case], rotary_layout="half")).eval()
    ids = ids_of_length(length)
    positions = torch.arange(length).expand(2, length)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_attentions=True)
        hidden, attention = out.hidden_states[0], model.encoder.layer[0].attention.self
        heads = (2, length, attention.num_heads, attention.head_dim)
        query, key = (proj(hidden).view(heads).transpose(1, 2) for proj in (attention.query, attention.key))
        llama = LlamaRotaryEmbedding(LlamaConfig(**{name: SIZES[name] for name in (
            "hidden_size", "num_attention_heads", "max_position_embeddings")},
            rope_parameters=copy.deepcopy(ROPE_CASES[case])))  # fresh: Llama's dynamic rope caches lengths
        cos, sin = llama(hidden, positions)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        expected = (query @ key.transpose(-1, -2) * attention.head_dim**-0.5).softmax(-1)
    torch.testing.assert_close(out.attentions[0], expected, atol=2e-6, rtol=1e-4)
    assert expected.max() > 0.5  # far from uniform: the angles matter

def test_yarn_attention_factor_is_not_one():
    """The test above would not notice a dropped attention factor if it were 1."""
    rotary = roformer_hf.modeling.RoFormerRotaryEmbedding(config(ROPE_CASES["yarn"]))
    assert rotary.frequencies(torch.device("cpu"))[1] > 1.1


def test_linear_scaling_by_two_at_even_positions_equals_no_scaling():
    plain, linear = models(None, {"rope_type": "linear", "factor": 2.0})
    ids = ids_of_length(24)
    mask = torch.ones_like(ids)  # else positions that skip would mark every token a sequence of its own (packing)
    positions = torch.arange(24)
    torch.testing.assert_close(logits(linear, ids, attention_mask=mask, position_ids=2 * positions),
                               logits(plain, ids, attention_mask=mask, position_ids=positions), atol=1e-5, rtol=0)
    assert (logits(linear, ids) - logits(plain, ids)).abs().max() > 1e-2


def test_dynamic_scaling_equals_none_up_to_the_training_length_and_differs_beyond():
    plain, dynamic = models(None, ROPE_CASES["dynamic"])
    for length in (5, 16):  # max_position_embeddings = 16
        ids = ids_of_length(length)
        torch.testing.assert_close(logits(dynamic, ids), logits(plain, ids), atol=1e-5, rtol=0)
    for length in (17, 40):
        ids = ids_of_length(length)
        assert (logits(dynamic, ids) - logits(plain, ids)).abs().max() > 1e-2, length


def test_dynamic_scaling_with_a_cache_keeps_each_steps_frequencies_in_its_keys():
    """As in transformers: a sequence fed in two pieces through a cache equals one forward up to the training length;
    beyond it the first piece's keys keep the frequencies of their (shorter) forward, and the two differ."""
    torch.manual_seed(0)
    decoder = roformer_hf.RoFormerForCausalLM(config(ROPE_CASES["dynamic"], is_decoder=True)).eval()
    for length, same in ((16, True), (40, False)):  # max_position_embeddings = 16
        ids = ids_of_length(length)
        whole = logits(decoder, ids)
        with torch.no_grad():
            cache = decoder(ids[:, :8], use_cache=True).past_key_values
            pieces = decoder(ids[:, 8:], past_key_values=cache).logits
        assert torch.allclose(pieces, whole[:, 8:], atol=1e-5, rtol=0) == same, length


@pytest.mark.parametrize("unpad", [True, False])
def test_dynamic_scaling_follows_the_longest_real_sequence_of_the_batch(unpad):
    """Padding does not count: a sequence gives the same logits alone and padded in a batch whose sequences are all
    within the training length; a longer sequence in its batch changes them (the batch's length grew)."""
    (dynamic,) = models(ROPE_CASES["dynamic"], unpad_inputs=unpad)
    short, mask = padded_batch([12, 12, 3])
    alone = logits(dynamic, short[:1, :12])
    padded = torch.cat([short, torch.zeros(3, 20, dtype=torch.long)], dim=1)  # padded to 32 > 16
    mask = torch.cat([mask, torch.zeros(3, 20, dtype=torch.long)], dim=1)
    torch.testing.assert_close(logits(dynamic, padded, attention_mask=mask)[0, :12], alone[0], atol=1e-5, rtol=0)
    long_ids, long_mask = padded_batch([12, 30], seed=1)
    long_ids[0, :12] = short[0, :12]
    with_long = logits(dynamic, long_ids, attention_mask=long_mask)[0, :12]
    assert (with_long - alone[0]).abs().max() > 1e-2


@pytest.mark.parametrize("given", [
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "dynamic", "factor": 3.0}, "rope_theta": 1e5},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8}, "rope_theta": 5e5},
    {"rope_theta": 1234.0},
    {},
])
def test_rope_parameters_are_read_as_transformers_decoders_read_them(tmp_path, given):
    """The same config.json fields give Llama's `rope_parameters` (without the legacy `type` spelling), and saving
    writes `rope_parameters` alone, which reads back the same."""
    ours, llama = RoFormerConfig(**SIZES, **copy.deepcopy(given)), LlamaConfig(**SIZES, **copy.deepcopy(given))
    expected = {key: value for key, value in llama.rope_parameters.items() if key != "type"}
    assert ours.rope_parameters == expected
    assert ours.rope_theta == expected["rope_theta"]
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in saved and "rope_theta" not in saved
    assert RoFormerConfig.from_pretrained(tmp_path).rope_parameters == expected


def test_a_rope_theta_saved_at_the_top_level_moves_into_rope_parameters(tmp_path):
    """config.json files of earlier roformer_hf versions and of other tools keep `rope_theta` beside the others."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roformer_hf", **SIZES, "rope_theta": 1e6}))
    config = RoFormerConfig.from_pretrained(tmp_path)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}


def test_rope_theta_is_a_view_of_rope_parameters():
    config = RoFormerConfig(**SIZES, rope_parameters={"rope_type": "linear", "factor": 2.0})
    assert config.rope_theta == config.rope_parameters["rope_theta"] == 10000.0
    config.rope_theta = 500.0
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}


def test_scaling_a_trained_model_at_load_time_keeps_its_rope_theta(tmp_path):
    """`from_pretrained(folder, rope_parameters=...)` sets them on the loaded config: they are completed (the
    checkpoint's rope_theta, the training length) and checked as at construction."""
    (model,) = models({"rope_type": "default", "rope_theta": 1e5})
    model.save_pretrained(tmp_path)
    scaled = roformer_hf.RoFormerForMaskedLM.from_pretrained(tmp_path, rope_parameters={"rope_type": "yarn",
                                                                                         "factor": 4.0})
    assert scaled.config.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e5,
                                             "original_max_position_embeddings": 16}
    with pytest.raises(ValueError, match="factor"):
        roformer_hf.RoFormerForMaskedLM.from_pretrained(tmp_path, rope_parameters={"rope_type": "linear"})
    config = scaled.config
    with pytest.raises(ValueError, match="rope_theta"):
        config.rope_theta = -1.0
    assert config.rope_theta == 1e5  # a refused assignment changes nothing


@pytest.mark.parametrize("case", ["dynamic", "yarn", "longrope", "llama3"])
def test_scaled_model_round_trip(tmp_path, case):
    (model,) = models(ROPE_CASES[case])
    model.save_pretrained(tmp_path)
    reloaded = roformer_hf.RoFormerForMaskedLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    ids = ids_of_length(40)
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), atol=0, rtol=0)


@pytest.mark.parametrize("given, field", [
    ({"rope_parameters": {"rope_type": "ntk"}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "linear"}}, "factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.5}}, "factor"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": "2"}}, "factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0}}, "attention_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8.5}},
     "original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * HALF}}, "long_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * HALF, "long_factor": [1.0] * 3}},
     "long_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "high_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}, "rope_theta": 200.0}, "rope_theta"),
    ({"rope_parameters": ["linear", 2.0]}, "rope_parameters"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
])
def test_malformed_rope_parameters_fail_naming_the_field(given, field):
    with pytest.raises(ValueError, match=field):
        RoFormerConfig(**SIZES, **given)


@pytest.mark.parametrize("case, unread", [
    ({"rope_type": "default", "rope_theta": 10000.0, "original_max_position_embeddings": 16384},
     "original_max_position_embeddings"),
    ({"rope_type": "default", "rope_theta": 10000.0, "factor": 0.5}, "factor"),  # unread, so not checked either
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "low_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "betta_slow": 1.0}, "betta_slow"),
])
def test_keys_a_rope_type_does_not_read_are_warned_about_and_ignored(tmp_path, caplog, case, unread):
    """As transformers' rope validation (a config that loads there loads here): a warning names the key, the config
    keeps it, and the model rotates exactly as without it."""
    LlamaConfig(hidden_size=32, num_attention_heads=2, rope_parameters=copy.deepcopy(case))  # transformers accepts it
    without = {key: value for key, value in case.items() if key != unread}
    with caplog.at_level("WARNING", logger="roformer_hf.configuration"):
        plain, extra = models(without, case)
    assert [record.getMessage() for record in caplog.records if unread in record.getMessage()], caplog.text
    assert extra.config.rope_parameters[unread] == case[unread]
    ids = ids_of_length(40)  # beyond max_position_embeddings=16, where scaling acts
    torch.testing.assert_close(logits(extra, ids), logits(plain, ids), atol=0, rtol=0)
    extra.save_pretrained(tmp_path)
    reloaded = roformer_hf.RoFormerForMaskedLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters == extra.config.rope_parameters
