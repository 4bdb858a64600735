"""The decoder half: RoFormerForCausalLM against transformers' RoFormerForCausalLM on the same weights, the cache,
generation, cross-attention, and the prefix-LM (UniLM) mask against its definition."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import FIXTURES, TINY, padded_batch, reference_and_ours, tiny_config
from safetensors.torch import load_file
from transformers.cache_utils import DynamicCache

from roformer_hf import RoFormerForCausalLM, RoFormerModel

LENGTHS = [12, 9, 5, 1]
IMPLEMENTATIONS = ["sdpa", "eager"]


def real(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t[mask.bool()]


def causal_pair(tmp_path, attn_implementation="sdpa", **overrides):
    reference, ours = reference_and_ours("RoFormerForCausalLM", tmp_path, is_decoder=True, **overrides)
    ours.set_attn_implementation(attn_implementation)
    return reference, ours


@pytest.mark.parametrize("attn_implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("variant", [{}, {"embedding_size": 24}, {"rotary_value": True}])
def test_causal_lm_matches_transformers_on_a_padded_batch(tmp_path, attn_implementation, unpad, variant):
    """Logits on real tokens within 1e-5 and the same loss (labels: the ids, -100 at padding), right-padded as
    transformers needs (its positions count the padding)."""
    reference, ours = causal_pair(tmp_path, attn_implementation, **variant)
    ours.config.unpad_inputs = unpad
    ids, mask = padded_batch(LENGTHS)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask, labels=labels)
        actual = ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(real(actual.logits, mask), real(expected.logits, mask), atol=1e-5, rtol=0)
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=0)
    assert (actual.logits[mask == 0] == 0).all()


def test_causal_lm_trains_like_transformers(tmp_path):
    """The gradients of the loss agree too (the backward pass of the causal kernels)."""
    reference, ours = causal_pair(tmp_path)
    reference.train(), ours.train()
    ids, mask = padded_batch(LENGTHS)
    labels = ids.masked_fill(mask == 0, -100)
    reference(ids, attention_mask=mask, labels=labels).loss.backward()
    ours(ids, attention_mask=mask, labels=labels).loss.backward()
    expected = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attn_implementation", IMPLEMENTATIONS)
def test_greedy_generation_matches_transformers(tmp_path, attn_implementation):
    reference, ours = causal_pair(tmp_path, attn_implementation)
    prompts, _ = padded_batch([6, 6])
    settings = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False, "num_beams": 1, "pad_token_id": 0}
    expected = reference.generate(prompts, **settings)
    assert torch.equal(ours.generate(prompts, **settings), expected)
    assert torch.equal(ours.generate(prompts, use_cache=False, **settings), expected)


def test_cross_attention_matches_transformers(tmp_path):
    """A decoder with cross-attention (transformers' layer names: `crossattention`), on a padded encoder output."""
    reference, ours = causal_pair(tmp_path, add_cross_attention=True)
    assert "roformer.encoder.layer.0.crossattention.self.query.weight" in dict(ours.named_parameters())
    ids, mask = padded_batch([7, 4])
    encoder_states = torch.randn(2, 5, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    encoder_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    inputs = {"attention_mask": mask, "encoder_hidden_states": encoder_states, "encoder_attention_mask": encoder_mask}
    with torch.no_grad():
        expected, actual = reference(ids, **inputs).logits, ours(ids, **inputs).logits
    torch.testing.assert_close(real(actual, mask), real(expected, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", [{}, {"num_key_value_heads": 2, "norm_position": "pre"},
                                     {"rotary_value": True, "rotary_layout": "half"}])
def test_decoding_with_the_cache_equals_one_forward(variant):
    """Feeding a sequence in pieces through the cache gives the logits of one forward over it, left padding too;
    positions continue from the cache."""
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True, **variant)).eval()
    ids, mask = padded_batch([10, 6], left=True)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, position_ids=positions).logits
        cache, pieces = DynamicCache(), []
        for start, end in ((0, 4), (4, 5), (5, 10)):
            out = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                        past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache and cache.get_seq_length() == end
            pieces.append(out.logits)
    torch.testing.assert_close(real(torch.cat(pieces, dim=1), mask), real(whole, mask), atol=1e-5, rtol=0)


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([7, 3, 5], left=True)
    settings = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    together = model.generate(ids, attention_mask=mask, **settings)
    for row in range(len(ids)):
        alone = model.generate(ids[row:row + 1, mask[row].bool()], **settings)
        assert torch.equal(together[row, -8:], alone[0, -8:])


def test_beam_search_and_sampling_run_through_the_cache():
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    prompt, _ = padded_batch([5])
    beams = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    no_cache = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False,
                              pad_token_id=0, use_cache=False)
    assert torch.equal(beams, no_cache)
    torch.manual_seed(1)
    sampled = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=10, pad_token_id=0)
    assert sampled.shape == (1, 11) and torch.equal(sampled[:, :5], prompt)


def test_causal_lm_is_registered_with_auto_model_for_causal_lm(tmp_path):
    torch.manual_seed(0)
    RoFormerForCausalLM(tiny_config(is_decoder=True)).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is RoFormerForCausalLM and loaded.config.is_decoder


# --- prefix-LM (UniLM): segment 0 bidirectional, segment 1 causal --------------------------------------------------


def prefix_lm_model(**overrides) -> RoFormerForCausalLM:
    torch.manual_seed(0)
    return RoFormerForCausalLM(tiny_config(is_decoder=True, prefix_lm=True, **overrides)).eval()


@pytest.mark.parametrize("attn_implementation", IMPLEMENTATIONS)
def test_prefix_lm_reads_the_prefix_bidirectionally_and_the_rest_causally(attn_implementation):
    """By the definition of the mask: the prefix's states are those of the same weights as an encoder on the prefix
    alone; each later token's state is the last state of a forward that stops at it."""
    model = prefix_lm_model()
    model.set_attn_implementation(attn_implementation)
    ids, _ = padded_batch([11])
    types = torch.tensor([[0] * 6 + [1] * 5])
    with torch.no_grad():
        states = model.roformer(ids, token_type_ids=types).last_hidden_state
        encoder = RoFormerModel(tiny_config()).eval()
        encoder.load_state_dict(model.roformer.state_dict())
        torch.testing.assert_close(states[:, :6], encoder(ids[:, :6]).last_hidden_state, atol=1e-5, rtol=0)
        for end in range(7, 12):
            stopped = model.roformer(ids[:, :end], token_type_ids=types[:, :end]).last_hidden_state
            torch.testing.assert_close(states[:, end - 1], stopped[:, -1], atol=1e-5, rtol=0)


def test_prefix_lm_padded_batch_equals_each_row_alone():
    model = prefix_lm_model()
    ids, mask = padded_batch([9, 5, 7])
    types = torch.zeros_like(ids)
    for row, (n, prefix) in enumerate(zip([9, 5, 7], [4, 2, 7])):
        types[row, prefix:n] = 1
    with torch.no_grad():
        together = model(ids, attention_mask=mask, token_type_ids=types).logits
        for row in range(3):
            keep = mask[row].bool()
            alone = model(ids[row:row + 1, keep], token_type_ids=types[row:row + 1, keep]).logits
            torch.testing.assert_close(together[row, keep], alone[0], atol=1e-5, rtol=0)


def test_prefix_lm_refuses_segments_that_go_back_to_the_prefix():
    model = prefix_lm_model()
    ids, mask = padded_batch([6, 6])
    types = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 1, 1]])
    with pytest.raises(ValueError, match=r"token_type_ids\[1\] = .* goes back from segment 1 to 0"):
        model(ids, attention_mask=mask, token_type_ids=types)
    right_padded = torch.tensor([[0, 1, 1, 0, 0, 0]])  # the zeros after the 1s are padding: fine
    model(ids[:1], attention_mask=torch.tensor([[1, 1, 1, 0, 0, 0]]), token_type_ids=right_padded)


# --- bad inputs -------------------------------------------------------------------------------------------------


def test_labels_of_the_wrong_shape_are_refused():
    model = RoFormerForCausalLM(tiny_config(is_decoder=True))
    ids, mask = padded_batch([5, 3])
    with pytest.raises(ValueError, match=r"labels has shape \(2, 4\); expected \(2, 5\)"):
        model(ids, attention_mask=mask, labels=ids[:, :4])


# --- encoder-decoder ------------------------------------------------------------------------------------------------


def test_encoder_decoder_model_with_a_roformer_hf_decoder_trains_and_generates():
    torch.manual_seed(0)
    encoder = RoFormerModel(tiny_config())
    decoder = RoFormerForCausalLM(tiny_config(is_decoder=True, add_cross_attention=True))
    model = transformers.EncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id, model.config.pad_token_id = 1, 0
    sources, source_mask = padded_batch([6, 4])
    targets, _ = padded_batch([5, 5], seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(input_ids=sources, attention_mask=source_mask, labels=targets).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    settings = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "decoder_start_token_id": 1,
                "pad_token_id": 0}
    generated = model.generate(sources, attention_mask=source_mask, **settings)
    assert generated.shape == (2, 6)
    assert torch.equal(generated, model.generate(sources, attention_mask=source_mask, use_cache=False, **settings))


# --- RoFormer-Sim: a pooler, and generation with the prompt as prefix -------------------------------------------------


def test_pooler_is_available_to_the_encoder():
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config(add_pooling_layer=True, pooler_activation="tanh")).eval()
    ids, mask = padded_batch([6, 3], left=True)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        first = out.last_hidden_state[torch.arange(2), mask.argmax(-1)]  # each row's first real token
    torch.testing.assert_close(out.pooler_output, torch.tanh(model.pooler.dense(first)), atol=1e-6, rtol=0)
    assert RoFormerModel(tiny_config()).forward(ids).pooler_output is None


SIM = FIXTURES / "roformer_sim"


def test_roformer_sim_matches_junnyus_roformer():
    """A RoFormer-Sim folder written by JunnYu's `RoFormerForCausalLM` (roformer 0.4.3; tests/support/fixtures/
    make_sim_fixtures.py) loads as a prefix-LM with a pooler: `pooler_output` and the first pass's logits within
    1e-5 of JunnYu's, and its greedy generations (the prompt read bidirectionally, new tokens as segment 1)."""
    refs = load_file(SIM / "references.safetensors")
    model = RoFormerForCausalLM.from_pretrained(SIM).eval()
    assert model.config.prefix_lm and model.config.add_pooling_layer and model.config.pooler_activation == "linear"
    inputs = {name: refs[name] for name in ("input_ids", "attention_mask", "token_type_ids")}
    mask = refs["attention_mask"]
    with torch.no_grad():
        out = model(**inputs)
    torch.testing.assert_close(out.pooler_output, refs["pooler_output"], atol=1e-5, rtol=0)
    torch.testing.assert_close(real(out.logits, mask), real(refs["logits"], mask), atol=1e-5, rtol=0)
    for row, n in enumerate(mask.sum(-1).tolist()):
        expected = refs[f"greedy.{row}"]
        new_tokens = len(expected) - n
        generated = model.generate(refs["input_ids"][row:row + 1, :n], max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert generated[0].tolist() == expected.tolist()


def test_num_items_in_batch_reaches_the_loss_and_only_the_loss():
    """Trainer's `num_items_in_batch` (gradient accumulation) divides the summed token losses; the encoder never
    sees it (it would be an unexpected input there)."""
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([6, 4])
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        summed = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                   reduction="sum")
        loss = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(20)).loss
    torch.testing.assert_close(loss, summed / 20, atol=1e-6, rtol=1e-6)


