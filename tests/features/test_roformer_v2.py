"""RoFormer-V2 and RoFormer against JunnYu's `roformer` 0.4.3, the port that published the V2 checkpoints.

The fixtures under tests/support/fixtures/roformer_{v1,v2}/ were written once by that package (tests/support/fixtures/
make_v2_fixtures.py): a checkpoint folder per head, as its `save_pretrained` writes them, and its outputs on a padded
batch, on a padded batch several times longer than `max_position_embeddings`, and on a multiple-choice batch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import FIXTURES
from safetensors import safe_open
from safetensors.torch import load_file

import roformer_hf
from roformer_hf import RoFormerConfig

VARIANTS = ("v1", "v2")
TOKEN_HEADS = ("RoFormerForMaskedLM", "RoFormerForSequenceClassification", "RoFormerForTokenClassification",
               "RoFormerForQuestionAnswering")
ALL_HEADS = (*TOKEN_HEADS, "RoFormerForMultipleChoice")
TOLERANCE = 1e-5
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Set to the Python of an environment with JunnYu's package (tests/support/fixtures/make_v2_fixtures.py says how to make
# one) to check that it loads what roformer_hf saves.
REFERENCE_PYTHON = os.environ.get("ROFORMER_V2_REFERENCE_PYTHON")


def folder(variant: str, head: str) -> Path:
    return FIXTURES / f"roformer_{variant}" / head


def references(variant: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"roformer_{variant}" / "references.safetensors")


def batch(refs: dict[str, torch.Tensor], split: str) -> dict[str, torch.Tensor]:
    return {name: refs[f"{split}.{name}"] for name in INPUTS}


def outputs(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    if hasattr(out, "start_logits"):
        return torch.stack((out.start_logits, out.end_logits), dim=-1)
    return out.logits


def assert_close_on_real_tokens(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    if actual.dim() >= 3:  # per token: padding is garbage in JunnYu's model, zeros in ours
        actual, expected = actual[mask.bool()], expected[mask.bool()]
    torch.testing.assert_close(actual, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head", TOKEN_HEADS)
@pytest.mark.parametrize("split", ["short", "long"])
@pytest.mark.parametrize("attn_implementation, unpad", [("sdpa", True), ("sdpa", False), ("eager", True)])
def test_outputs_match_junnyu_roformer(variant, head, split, attn_implementation, unpad):
    """Every head, on a padded batch within `max_position_embeddings` and on one 3x longer than it (JunnYu's model
    run with an enlarged, computed sinusoidal table), in every attention layout."""
    refs = references(variant)
    model = getattr(roformer_hf, head).from_pretrained(folder(variant, head), attn_implementation=attn_implementation,
                                                       unpad_inputs=unpad).eval()
    inputs = batch(refs, split)
    if split == "long":
        assert inputs["input_ids"].shape[1] > 3 * model.config.max_position_embeddings
    assert_close_on_real_tokens(outputs(model, inputs), refs[f"{split}.{head}"], inputs["attention_mask"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_multiple_choice_matches_junnyu_roformer(variant):
    refs = references(variant)
    model = roformer_hf.RoFormerForMultipleChoice.from_pretrained(folder(variant, "RoFormerForMultipleChoice")).eval()
    torch.testing.assert_close(outputs(model, batch(refs, "choices")), refs["choices.RoFormerForMultipleChoice"],
                               atol=TOLERANCE, rtol=0)


def test_v2_config_fields_are_read_unchanged():
    raw = json.loads((folder("v2", "RoFormerForMaskedLM") / "config.json").read_text())
    assert (raw["model_type"], raw["use_bias"], raw["norm_type"]) == ("roformer", False, "rms_norm")
    config = RoFormerConfig.from_pretrained(folder("v2", "RoFormerForMaskedLM"))
    assert config.model_type == "roformer_hf"
    for field in ("use_bias", "norm_type", "hidden_act", "pooler_activation", "layer_norm_eps", "vocab_size"):
        assert getattr(config, field) == raw[field], field
    assert not config.uses_layer_norm


def test_rms_norm_is_the_parameter_free_rms_norm():
    x = torch.randn(3, 5, 16) * 4 + 1
    model = roformer_hf.RoFormerModel(RoFormerConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=24,
                                                     norm_type="rms_norm", layer_norm_eps=1e-6))
    norm = model.embeddings.LayerNorm
    assert not list(norm.parameters())
    torch.testing.assert_close(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("norm_type", ["layernorm", "LayerNorm", "rmsnorm", "RMSNorm", "norm", "", None, 1])
def test_other_norm_types_are_refused_with_the_list(norm_type):
    """A misspelt norm_type would otherwise build another model (LayerNorm or RMS norm) without a word."""
    with pytest.raises(ValueError, match=r"norm_type=.*expected one of \('layer_norm', 'rms_norm'\)"):
        RoFormerConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=24, norm_type=norm_type)


@pytest.mark.parametrize("head", ALL_HEADS)
def test_v2_weights_and_saved_layout_are_junnyus(tmp_path, head):
    """What roformer_hf builds for a V2 config has JunnYu's parameter names and shapes (no norm weights, no encoder
    biases, heads with biases), and what it saves is that layout again, with the config that describes it."""
    source = folder("v2", head)
    with safe_open(source / "model.safetensors", "pt") as theirs:
        expected = {name: tuple(theirs.get_slice(name).get_shape()) for name in theirs.keys()}
    model = getattr(roformer_hf, head).from_pretrained(source)
    assert not any("LayerNorm" in name for name in expected)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as ours:
        saved = {name: tuple(ours.get_slice(name).get_shape()) for name in ours.keys()}
    assert saved == expected
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["use_bias"], config["norm_type"], config["hidden_act"]) == (False, "rms_norm", "relu")
    reloaded = getattr(roformer_hf, head).from_pretrained(tmp_path).eval()
    refs = references("v2")
    split = "choices" if head == "RoFormerForMultipleChoice" else "short"
    inputs = batch(refs, split)
    assert_close_on_real_tokens(outputs(reloaded, inputs), refs[f"{split}.{head}"], inputs["attention_mask"])


def test_v2_mlm_head_is_the_tied_decoder_alone():
    model = roformer_hf.RoFormerForMaskedLM.from_pretrained(folder("v2", "RoFormerForMaskedLM"))
    head = model.cls.predictions
    assert [name for name, _ in head.named_parameters()] == ["decoder.weight"]
    assert head.decoder.weight is model.roformer.embeddings.word_embeddings.weight
    model.resize_token_embeddings(60)
    assert head.decoder.weight is model.roformer.embeddings.word_embeddings.weight
    assert head.decoder.bias is None and model(torch.tensor([[5, 59, 7]])).logits.shape == (1, 3, 60)


def test_v2_mlm_head_needs_hidden_states_of_the_embeddings_size():
    config = RoFormerConfig(vocab_size=50, hidden_size=16, embedding_size=8, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=24, norm_type="rms_norm")
    roformer_hf.RoFormerForSequenceClassification(config)  # only the MLM head lacks a projection
    for build in (config.check_mlm_head, lambda: roformer_hf.RoFormerForMaskedLM(config)):
        with pytest.raises(ValueError, match="embedding_size=8: expected hidden_size=16 with norm_type='rms_norm'"):
            build()


def _without_fields(source: Path, destination: Path, *fields: str) -> Path:
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    for field in fields:
        del config[field]
    (destination / "config.json").write_text(json.dumps(config))
    return destination


@pytest.mark.parametrize("model_class", ["RoFormerForSequenceClassification", "RoFormerModel"])
def test_v2_checkpoint_whose_config_lost_the_v2_fields_is_refused(tmp_path, model_class):
    """A V2 folder whose config.json says nothing of V2 (e.g. rewritten by a tool that drops unknown fields) would
    load as RoFormer with fresh norms and biases: the error names both mismatches."""
    broken = _without_fields(folder("v2", "RoFormerForSequenceClassification"), tmp_path / "v2", "use_bias",
                             "norm_type")
    with pytest.raises(ValueError, match=r"lacks 10 LayerNorm weights.*norm_type='layer_norm'.*lacks 12 biases.*"
                                         r"use_bias=True"):
        getattr(roformer_hf, model_class).from_pretrained(broken)


@pytest.mark.parametrize("overrides, message", [
    ({"norm_type": "rms_norm"}, r"holds 10 LayerNorm weights .*norm_type='rms_norm'"),
    ({"use_bias": False}, r"holds 12 biases of the encoder's dense layers .*use_bias=False"),
])
@pytest.mark.parametrize("model_class", ["RoFormerForTokenClassification", "RoFormerModel"])
def test_v1_checkpoint_read_with_a_v2_config_is_refused(overrides, message, model_class):
    with pytest.raises(ValueError, match=message):
        getattr(roformer_hf, model_class).from_pretrained(folder("v1", "RoFormerForTokenClassification"), **overrides)


def test_missing_norms_stay_allowed_when_asked_for():
    model = roformer_hf.RoFormerModel.from_pretrained(folder("v2", "RoFormerForMaskedLM"), norm_type="layer_norm",
                                                      use_bias=True, allow_missing_encoder_weights=True)
    assert model.config.uses_layer_norm and model.embeddings.LayerNorm.weight is not None


@pytest.mark.skipif(not REFERENCE_PYTHON, reason="set ROFORMER_V2_REFERENCE_PYTHON to an environment with JunnYu's "
                                                 "roformer 0.4.3 (see tests/support/fixtures/make_v2_fixtures.py)")
@pytest.mark.parametrize("head", ["RoFormerForMaskedLM", "RoFormerForSequenceClassification"])
def test_junnyus_package_loads_what_roformer_hf_saves(tmp_path, head):
    model = getattr(roformer_hf, head).from_pretrained(folder("v2", head))
    model.save_pretrained(tmp_path / "saved")
    script = textwrap.dedent(f"""
        import torch, roformer
        from safetensors.torch import load_file
        refs = load_file({str(FIXTURES / "roformer_v2" / "references.safetensors")!r})
        model = roformer.{head}.from_pretrained({str(tmp_path / "saved")!r}).eval()
        inputs = {{name: refs["short." + name] for name in {INPUTS!r}}}
        with torch.no_grad():
            logits = model(**inputs).logits
        expected = refs["short.{head}"]
        mask = inputs["attention_mask"].bool()
        if logits.dim() == 3:
            logits, expected = logits[mask], expected[mask]
        print(float((logits - expected).abs().max()))
    """)
    result = subprocess.run([REFERENCE_PYTHON, "-c", script], capture_output=True, text=True, check=True)
    assert float(result.stdout.split()[-1]) < TOLERANCE
