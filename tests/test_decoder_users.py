"""The decoder as a user meets it: a causal LM built from an encoder's config or folder, `shift_labels`, the BERT2BERT
warm start, generation from embeddings, the text-generation pipeline; and the prefix-LM's left padding and caches of
another model, held against references written from the equations."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import TINY, padded_batch, tiny_config
from safetensors.torch import load_file, save_file

from roformer_hf import RoFormerForCausalLM, RoFormerModel


def changed_after(ids: torch.Tensor, position: int, vocab_size: int = TINY["vocab_size"]) -> torch.Tensor:
    """`ids` with every token from `position` on replaced by another one."""
    changed = ids.clone()
    changed[:, position:] = (changed[:, position:] + 1) % (vocab_size - 1) + 1
    return changed


def assert_causal(model: RoFormerForCausalLM, ids: torch.Tensor) -> None:
    """Changing the last tokens leaves the logits before them unchanged, and changes the logits at them."""
    with torch.no_grad():
        logits = model(ids).logits
        changed = model(changed_after(ids, 3)).logits
    torch.testing.assert_close(changed[:, :3], logits[:, :3], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:, 3:], logits[:, 3:], atol=1e-4)


# --- a causal LM is a decoder, whatever config it is given ----------------------------------------------------------


def test_a_causal_lm_on_an_encoder_config_is_a_decoder_on_its_own_copy(caplog):
    config = tiny_config()  # is_decoder=False, as transformers' tests build every class from one config
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="roformer_hf.modeling"):
        model = RoFormerForCausalLM(config).eval()
    assert "is_decoder=False" in caplog.text  # said, not silent
    assert model.config.is_decoder and not config.is_decoder  # the caller's config is left alone
    assert model.config.to_dict() == {**config.to_dict(), "is_decoder": True}
    assert_causal(model, torch.randint(1, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0)))
    ids = torch.tensor([[2, 15, 27, 9]])
    assert model(ids, use_cache=True).past_key_values.get_seq_length() == 4  # a decoder's cache
    assert model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 7)


def test_auto_model_for_causal_lm_reads_an_encoders_folder_as_a_decoder(tmp_path):
    torch.manual_seed(0)
    encoder = RoFormerModel(tiny_config()).eval()
    encoder.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model) is RoFormerForCausalLM and model.config.is_decoder
    for name, weight in encoder.state_dict().items():  # the encoder's weights, every one of them
        torch.testing.assert_close(model.roformer.state_dict()[name], weight, rtol=0, atol=0)
    assert_causal(model, torch.randint(1, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1)))
    # What a decoder built with is_decoder=True computes on the same weights (test_decoder.py holds that one against
    # transformers' RoFormerForCausalLM).
    decoder = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    decoder.load_state_dict(model.state_dict())
    ids, mask = padded_batch([6, 4])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, decoder(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)


# --- shift_labels: the targets as given -----------------------------------------------------------------------------


@pytest.mark.parametrize("left", [False, True])
def test_shift_labels_are_the_targets_as_given(left):
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([6, 4, 5], left=left)
    gen = torch.Generator().manual_seed(2)
    shift_labels = torch.randint(0, TINY["vocab_size"], ids.shape, generator=gen).masked_fill(mask == 0, -100)
    shift_labels[0, 2] = -100
    labels = torch.randint(0, TINY["vocab_size"], ids.shape, generator=gen)  # not read when shift_labels are given
    out = model(ids, attention_mask=mask, labels=labels, shift_labels=shift_labels)
    logits = model(ids, attention_mask=mask).logits
    expected = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    # Without labels too; and labels shifted by hand give what labels give.
    torch.testing.assert_close(model(ids, attention_mask=mask, shift_labels=shift_labels).loss, expected)
    causal_labels = ids.masked_fill(mask == 0, -100)
    shifted = F.pad(causal_labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(model(ids, attention_mask=mask, shift_labels=shifted).loss,
                               model(ids, attention_mask=mask, labels=causal_labels).loss)
    with pytest.raises(ValueError, match=r"shift_labels has shape \(3, 5\); expected \(3, 6\)"):
        model(ids, attention_mask=mask, shift_labels=shift_labels[:, :5])


# --- BERT2BERT: an encoder's checkpoint warm-starts the decoder of an EncoderDecoderModel ----------------------------


def test_bert2bert_warm_start_initialises_only_the_cross_attention(tmp_path, caplog):
    torch.manual_seed(0)
    encoder = RoFormerModel(tiny_config()).eval()
    encoder.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="roformer_hf.loading"):
        model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path, tmp_path)
    assert "crossattention" in caplog.text and "initialised" in caplog.text
    decoder = model.decoder
    assert type(decoder) is RoFormerForCausalLM and decoder.config.is_decoder and decoder.config.add_cross_attention
    decoder_weights = decoder.roformer.state_dict()
    for name, weight in encoder.state_dict().items():  # every encoder weight carried over, in both halves
        torch.testing.assert_close(decoder_weights[name], weight, rtol=0, atol=0)
        torch.testing.assert_close(model.encoder.state_dict()[name], weight, rtol=0, atol=0)
    cross = [name for name in decoder_weights if ".crossattention." in name]
    assert len(cross) == 2 * 10  # 2 layers: query, key, value, output dense (weight, bias) and LayerNorm
    model.config.decoder_start_token_id, model.config.pad_token_id = 2, 0
    sources = torch.tensor([[2, 15, 27, 9, 3]])
    loss = model(input_ids=sources, labels=torch.tensor([[44, 51, 3]])).loss
    loss.backward()
    assert torch.isfinite(loss) and decoder.roformer.encoder.layer[0].crossattention.self.query.weight.grad.abs().sum()


def _drop_weights(folder, dropped: str) -> None:
    weights = load_file(folder / "model.safetensors")
    save_file({name: w for name, w in weights.items() if dropped not in name}, folder / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("dropped", ["layer.1.attention.self.key.weight", "embeddings.word_embeddings",
                                     "layer.0.intermediate.dense"])
def test_bert2bert_still_refuses_a_checkpoint_lacking_encoder_weights(tmp_path, dropped):
    torch.manual_seed(0)
    RoFormerModel(tiny_config()).save_pretrained(tmp_path)
    _drop_weights(tmp_path, dropped)
    with pytest.raises(ValueError, match=r"lacks \d+ encoder weight.*decoder_allow_missing_encoder_weights=True"):
        transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(
            tmp_path, tmp_path, encoder_allow_missing_encoder_weights=True)
    # The spelling the error names works there.
    model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(
        tmp_path, tmp_path, encoder_allow_missing_encoder_weights=True, decoder_allow_missing_encoder_weights=True)
    assert type(model.decoder) is RoFormerForCausalLM


def test_a_decoder_checkpoint_with_part_of_its_cross_attention_is_refused(tmp_path):
    torch.manual_seed(0)
    RoFormerForCausalLM(tiny_config(is_decoder=True, add_cross_attention=True)).save_pretrained(tmp_path)
    _drop_weights(tmp_path, "layer.1.crossattention.self.value")
    with pytest.raises(ValueError, match=r"lacks 2 encoder weight.*crossattention\.self\.value"):
        RoFormerForCausalLM.from_pretrained(tmp_path)


# --- generate(inputs_embeds=...) --------------------------------------------------------------------------------------


def test_generate_from_embeddings_gives_the_tokens_generated_from_ids(tmp_path):
    torch.manual_seed(0)
    reference = transformers.RoFormerForCausalLM(transformers.RoFormerConfig(**TINY, is_decoder=True)).eval()
    reference.save_pretrained(tmp_path)
    model = RoFormerForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[2, 15, 27, 9, 33, 41]])
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    from_ids = model.generate(ids, **options)[:, ids.shape[1]:]
    from_embeddings = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **options)
    torch.testing.assert_close(from_embeddings, from_ids, rtol=0, atol=0)
    # transformers' RoFormerForCausalLM on the same weights generates the same tokens from its embeddings.
    torch.testing.assert_close(reference.generate(inputs_embeds=reference.get_input_embeddings()(ids), **options),
                               from_ids, rtol=0, atol=0)


def test_generate_from_embeddings_of_a_left_padded_batch():
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([6, 3, 5], left=True)
    options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    from_ids = model.generate(ids, attention_mask=mask, **options)[:, ids.shape[1]:]
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model.generate(inputs_embeds=embeds, attention_mask=mask, **options), from_ids,
                               rtol=0, atol=0)
