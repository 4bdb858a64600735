"""Grouped-query attention (`num_key_value_heads`): every way of attending gives what the same model gives with its
key/value heads repeated out to one per query head (plain multi-head attention, written independently here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import padded_batch, tiny_config
from transformers import AttentionInterface

import roformer_hf
from roformer_hf import RoFormerConfig, attention, blocked_dropout, kernels

HEADS = 4


def repeated_state(model: torch.nn.Module, groups: int, head_dim: int) -> dict[str, torch.Tensor]:
    """`model`'s weights with each key/value head's rows repeated for the `groups` query heads that share it
    (query head i reads key/value head i // groups)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if ".attention.self.key." in name or ".attention.self.value." in name:
            rows = tensor.unflatten(0, (-1, head_dim))  # (nkv, d, ...)
            tensor = rows.repeat_interleave(groups, dim=0).flatten(0, 1)
        state[name] = tensor
    return state


def grouped_and_repeated(kv_heads: int, model_class=roformer_hf.RoFormerForMaskedLM, **overrides):
    torch.manual_seed(0)
    config = tiny_config(num_attention_heads=HEADS, num_key_value_heads=kv_heads, initializer_range=0.2, **overrides)
    grouped = model_class(config)
    full = model_class(tiny_config(num_attention_heads=HEADS, initializer_range=0.2, **overrides))
    full.load_state_dict(repeated_state(grouped, HEADS // kv_heads, config.head_dim))
    return grouped, full


def test_key_value_projections_shrink():
    config = tiny_config(num_attention_heads=HEADS, num_key_value_heads=2)
    attention_module = roformer_hf.RoFormerModel(config).encoder.layer[0].attention.self
    assert attention_module.query.weight.shape == (32, 32)
    assert attention_module.key.weight.shape == attention_module.value.weight.shape == (2 * config.head_dim, 32)
    assert attention_module.num_key_value_groups == 2


@pytest.mark.parametrize("kv_heads", [5, 3, 0, -2, 8, 2.0])
def test_num_key_value_heads_must_divide_the_heads(kv_heads):
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config(num_attention_heads=HEADS, num_key_value_heads=kv_heads)


def test_default_is_one_key_value_head_per_query_head():
    assert RoFormerConfig(num_attention_heads=6, hidden_size=48).num_key_value_heads == 6


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("implementation, unpad, lengths", [
    ("sdpa", True, [9, 4, 7]),  # real tokens side by side, SDPA per sequence (enable_gqa, no mask)
    ("sdpa", False, [9, 4, 7]),  # padded with the key mask (heads repeated)
    ("sdpa", True, [8, 8]),  # no padding, no mask
    ("eager", True, [9, 4, 7]),
])
def test_grouped_heads_equal_repeated_heads(kv_heads, implementation, unpad, lengths):
    grouped, full = grouped_and_repeated(kv_heads, unpad_inputs=unpad)
    for model in (grouped, full):
        model.set_attn_implementation(implementation)
    ids, mask = padded_batch(lengths)
    labels = ids.masked_fill(mask == 0, -100)
    out_grouped, out_full = (model(ids, attention_mask=mask, labels=labels) for model in (grouped, full))
    torch.testing.assert_close(out_grouped.logits, out_full.logits, atol=1e-5, rtol=1e-5)
    # Gradients: a shared key/value head gets the sum of what its repeated copies get.
    out_grouped.loss.backward()
    out_full.loss.backward()
    for name in ("key", "value"):
        shared = getattr(grouped.roformer.encoder.layer[0].attention.self, name).weight.grad
        copies = getattr(full.roformer.encoder.layer[0].attention.self, name).weight.grad
        summed = copies.unflatten(0, (kv_heads, HEADS // kv_heads, -1)).sum(1).flatten(0, 1)
        torch.testing.assert_close(shared, summed, atol=1e-5, rtol=1e-4)


def test_attention_weights_are_returned_per_query_head():
    grouped, full = grouped_and_repeated(2)
    ids, mask = padded_batch([9, 4])
    with torch.no_grad():
        weights = grouped(ids, attention_mask=mask, output_attentions=True).attentions
        expected = full(ids, attention_mask=mask, output_attentions=True).attentions
    assert weights[0].shape == (2, HEADS, 9, 9)
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)


def test_packed_sequences_equal_repeated_heads():
    grouped, full = grouped_and_repeated(2)
    ids = padded_batch([12])[0]
    offsets = torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        torch.testing.assert_close(grouped(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets).logits,
                                   full(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets).logits, atol=1e-5, rtol=1e-5)


BLOCKED = 2 * attention.DROPOUT_BLOCK_ROWS + 8  # long enough for attention dropout in blocks of queries


@pytest.mark.parametrize("length", [40, BLOCKED])  # SDPA's own dropout, and blocked_dropout_attention_forward's
def test_attention_dropout_in_training_equals_repeated_heads(length):
    """Same seed, same dropout masks: the masks are drawn per query head in both models."""
    grouped, full = grouped_and_repeated(2, attention_probs_dropout_prob=0.3, unpad_inputs=False)
    ids, mask = padded_batch([length, length // 2])
    results = []
    for model in (grouped, full):
        model.train()
        torch.manual_seed(1)
        results.append(model(ids, attention_mask=mask).logits)
    torch.testing.assert_close(*results, atol=1e-5, rtol=1e-5)
    torch.manual_seed(2)
    assert not torch.allclose(grouped(ids, attention_mask=mask).logits, results[0], atol=1e-3)  # dropout is on


def test_kernels_on_tensors_equal_repeated_heads(monkeypatch):
    """The kernels of attention.py, called directly: (B, nh, L, d) queries with (B, nkv, L, d) keys and values."""
    blocks = []
    row_blocks = blocked_dropout._row_blocks
    monkeypatch.setattr(blocked_dropout, "_row_blocks", lambda *args: blocks.append(1) or row_blocks(*args))

    class Module(torch.nn.Module):
        def __init__(self, groups: int):
            super().__init__()
            self.num_key_value_groups = groups

    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, BLOCKED, 8, generator=gen) for h in (HEADS, 1, 1))
    key_mask = torch.ones(2, 1, 1, BLOCKED, dtype=torch.bool)
    key_mask[1, ..., 200:] = False
    repeated = [t.expand(2, HEADS, BLOCKED, 8) for t in (key, value)]
    for kernel in (attention.eager_attention_forward, attention.blocked_dropout_attention_forward):
        grouped_module, full_module = Module(HEADS).train(), Module(1).train()
        torch.manual_seed(3)
        got = kernel(grouped_module, query, key, value, key_mask, scaling=0.3, dropout=0.2)[0]
        torch.manual_seed(3)
        expected = kernel(full_module, query, *repeated, key_mask, scaling=0.3, dropout=0.2)[0]
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert blocks  # the blocked kernel did run in blocks


def flash_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stands in for flash-attn, which takes fewer key/value heads natively: it must receive them unrepeated."""
    assert key.shape[1] == value.shape[1] == query.shape[1] // module.num_key_value_groups < query.shape[1]
    flash_stand_in.calls += 1
    if "cu_seq_lens_q" in kwargs:
        bounds = kwargs["cu_seq_lens_q"].tolist()
        output = torch.cat([F.scaled_dot_product_attention(*(t[:, :, start:end] for t in (query, key, value)),
                                                           scale=scaling, enable_gqa=True)
                            for start, end in zip(bounds, bounds[1:])], dim=2)
    else:
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2), None


@pytest.mark.parametrize("unpad", [True, False])
def test_flash_path_gets_the_key_value_heads_unrepeated(monkeypatch, unpad):
    # (a registered name with "flash" in it would make transformers look for the real kernel)
    AttentionInterface.register("test_gqa_varlen_stand_in", flash_stand_in)
    monkeypatch.setattr(kernels, "is_flash_attention_requested",  # where the forward chooses its kernel
                        lambda requested_attention_implementation: requested_attention_implementation ==
                        "test_gqa_varlen_stand_in")
    flash_stand_in.calls = 0
    grouped, full = grouped_and_repeated(2, unpad_inputs=unpad)
    grouped.set_attn_implementation("test_gqa_varlen_stand_in")
    ids, mask = padded_batch([9, 4, 7])
    with torch.no_grad():
        torch.testing.assert_close(grouped(ids, attention_mask=mask).logits, full(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)
    assert flash_stand_in.calls == grouped.config.num_hidden_layers


def test_round_trip(tmp_path):
    grouped, _ = grouped_and_repeated(1, model_class=roformer_hf.RoFormerForSequenceClassification)
    grouped.save_pretrained(tmp_path)
    reloaded = roformer_hf.RoFormerForSequenceClassification.from_pretrained(tmp_path)
    assert reloaded.config.num_key_value_heads == 1
    ids, mask = padded_batch([6, 3])
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(ids, attention_mask=mask).logits,
                                   grouped.eval()(ids, attention_mask=mask).logits, atol=0, rtol=0)
