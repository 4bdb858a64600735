"""The ways of attending (roformer_hf/attention.py) on tensors, against independent references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roformer_hf import attention
from roformer_hf.attention import blocked_dropout_attention_forward, eager_attention_forward


class Training(nn.Module):
    """Stands in for the attention module: the kernels only read `training`."""


def qkv(batch=2, heads=3, length=600, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=generator, requires_grad=True) for _ in range(3)]


def test_blocked_dropout_attention_without_dropout_is_plain_attention():
    query, key, value = qkv()
    mask = torch.rand(2, 1, 1, 600, generator=torch.Generator().manual_seed(1)) > 0.3
    expected, _ = eager_attention_forward(Training().eval(), query, key, value, mask, scaling=0.3)
    module = Training().train()
    actual, _ = blocked_dropout_attention_forward(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_dropout_drops_single_weights_and_rescales_the_kept_ones(monkeypatch):
    """With values = the identity, the output *is* the dropped weight matrix: every weight is either 0 or its
    softmax value / (1 - p), and about a fraction p are zero."""
    monkeypatch.setattr(attention, "DROPOUT_BLOCK_ROWS", 64)
    length, p = 300, 0.25
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(1, 1, length, 16, generator=generator) for _ in range(2))
    value = torch.eye(length)[None, None]
    weights = (query @ key.transpose(-1, -2) * 0.25).softmax(-1)[0, 0]
    torch.manual_seed(0)
    dropped, _ = blocked_dropout_attention_forward(Training().train(), query, key, value, None, 0.25, dropout=p)
    dropped = dropped[0, :, 0]  # (L, L)
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], weights[kept] / (1 - p), atol=1e-6, rtol=1e-5)
    assert abs((~kept).float().mean().item() - p) < 0.01


def test_the_backward_pass_replays_the_same_dropout_mask(monkeypatch):
    """The blocks are recomputed in the backward pass: their gradients must be those of the same computation kept
    in memory (same random draws), not of a fresh dropout mask."""
    monkeypatch.setattr(attention, "DROPOUT_BLOCK_ROWS", 128)
    query, key, value = qkv(length=500)
    grad = torch.randn(2, 500, 3, 8, generator=torch.Generator().manual_seed(3))

    torch.manual_seed(7)
    blocked, _ = blocked_dropout_attention_forward(Training().train(), query, key, value, None, 0.3, dropout=0.2)
    blocked_grads = torch.autograd.grad(blocked, (query, key, value), grad)

    torch.manual_seed(7)  # the same blocks, kept in memory instead of recomputed
    kept = torch.cat([attention._attend_block(q, key, value, None, 0.3, 0.2) for q in query.split(128, dim=2)],
                     dim=2).transpose(1, 2)
    kept_grads = torch.autograd.grad(kept, (query, key, value), grad)

    torch.testing.assert_close(blocked, kept)
    for got, want in zip(blocked_grads, kept_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("unpad", [True, False])
def test_models_in_training_use_blocked_dropout_on_cpu(unpad, monkeypatch):
    import roformer_hf
    from helpers import padded_batch, tiny_config

    calls = []
    original = attention.blocked_dropout_attention_forward

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS._global_mapping, attention.SDPA_DROPOUT, spy)
    model = roformer_hf.RoFormerForMaskedLM(tiny_config(attention_probs_dropout_prob=0.1, unpad_inputs=unpad))
    ids, mask = padded_batch([9, 4])
    model.train()(ids, attention_mask=mask).logits.sum().backward()
    assert calls  # the blocked kernel, with its fallback to SDPA for short sequences
    calls.clear()
    model.eval()(ids, attention_mask=mask)
    assert not calls
