"""Attention dropout on CPU (roformer_hf/blocked_dropout.py, through the kernel
`attention.blocked_dropout_attention_forward`), in blocks of queries (`BlockedDropoutAttention`) and with every weight
at once (`DropoutAttention`, sequences of up to two blocks): the same dropped weights as explicit attention, at the
rate asked."""

from __future__ import annotations

import pytest
import torch
from helpers import KernelModule as Training
from helpers import random_qkv as qkv

from roformer_hf import attention, blocked_dropout
from roformer_hf.attention import blocked_dropout_attention_forward, eager_attention_forward
from roformer_hf.blocked_dropout import BlockedDropoutAttention, DropoutAttention

KERNELS = {"blocks": BlockedDropoutAttention, "whole": DropoutAttention}


def take(kernel: str, monkeypatch, block_rows: int) -> list[type]:
    """Makes the attention function take `kernel` for this test's lengths: blocks of `block_rows` queries, or every
    weight at once (the default block size, past the lengths here). Returns the kernels that then run, in order."""
    if kernel == "blocks":
        monkeypatch.setattr(attention, "DROPOUT_BLOCK_ROWS", block_rows)
    ran = []
    for function in KERNELS.values():
        monkeypatch.setattr(function, "apply", lambda *args, _function=function, _apply=function.apply:
                            ran.append(_function) or _apply(*args))
    return ran


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropout_drops_single_weights_and_rescales_the_kept_ones(kernel, monkeypatch):
    """With values = the identity, the output *is* the dropped weight matrix: every weight is either 0 or its
    softmax value / (1 - p), and about a fraction p are zero."""
    ran = take(kernel, monkeypatch, 64)
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
    assert ran == [KERNELS[kernel]]


class GroupedQueryModule(Training):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def key_masks(kind: str, batch: int, length: int) -> torch.Tensor | None:
    """No mask, right padding ``(B, 1, 1, L)``, or packed rows ``(B, 1, L, L)`` (block-diagonal)."""
    if kind == "none":
        return None
    lengths = torch.tensor([length, length * 2 // 3])[:batch]
    if kind == "padding":
        return (torch.arange(length) < lengths[:, None])[:, None, None, :]
    segments = (torch.arange(length)[None] >= lengths[:, None] // 2).long() + (torch.arange(length) >= 60)
    return (segments[:, :, None] == segments[:, None, :])[:, None]


def explicit_dropout_attention(query, key, value, mask, scaling, dropped, p):
    """The reference: ``softmax(q k^T * scaling, masked) * keep / (1 - p) @ v`` with every weight in memory."""
    scores = query @ key.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1).masked_fill(dropped, 0) / (1 - p) @ value).transpose(1, 2)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mask_kind", ["none", "padding", "packed"])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("queries", ["all", "every other"])
def test_dropout_attention_equals_explicit_attention_with_the_same_mask(kernel, mask_kind, groups, queries,
                                                                        monkeypatch):
    """Output and gradients of q, k, v equal autograd through the explicit formula with the dropout mask the kernel
    drew. Values carry an identity matrix beside the real values, so the output also holds every dropped weight
    matrix: the mask is read off the output, whatever order the kernel draws it in. The backward pass draws no
    random numbers (it reads the forward's mask back). Every other token as the only queries: fewer queries than
    keys, as a last layer that computes the labelled tokens only."""
    ran = take(kernel, monkeypatch, 16)
    batch, heads, length, dim, scaling, p = 2, 6, 77, 8, 0.3, 0.2  # 77: blocks and bytes of bits left over
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, length, dim, dtype=torch.float64, generator=generator)
    rows = slice(None) if queries == "all" else slice(None, None, 2)  # 39 queries: three blocks of 16 rows
    query = query[:, :, rows].contiguous().requires_grad_()
    key = torch.randn(batch, heads // groups, length, dim, dtype=torch.float64, generator=generator,
                      requires_grad=True)
    value = torch.cat([torch.randn(batch, heads // groups, length, dim, dtype=torch.float64, generator=generator),
                       torch.eye(length, dtype=torch.float64).expand(batch, heads // groups, length, length)], dim=-1)
    value.requires_grad_()
    mask = key_masks(mask_kind, batch, length)
    if mask is not None and mask.shape[2] > 1:
        mask = mask[:, :, rows]
    grad = torch.randn(batch, query.shape[2], heads, dim + length, dtype=torch.float64, generator=generator)

    torch.manual_seed(1)
    output, _ = blocked_dropout_attention_forward(GroupedQueryModule(groups).train(), query, key, value, mask,
                                                  scaling=scaling, dropout=p)
    state = torch.get_rng_state()
    grads = torch.autograd.grad(output, (query, key, value), grad)
    assert torch.equal(torch.get_rng_state(), state)

    kept_weights = output[..., dim:].transpose(1, 2)  # (B, nh, L, L): weights / (1 - p), or 0 where dropped
    repeated = [t.repeat_interleave(groups, dim=1) for t in (key, value)]
    weights = explicit_dropout_attention(query, *repeated, mask, scaling, torch.zeros((), dtype=torch.bool), 0.0)
    attended = weights[..., dim:].transpose(1, 2) != 0  # the weights of masked keys are 0, dropped or not
    dropped = (kept_weights == 0) & attended
    assert 0.15 < dropped.sum() / attended.sum() < 0.25
    expected = explicit_dropout_attention(query, *repeated, mask, scaling, dropped, p)
    torch.testing.assert_close(output, expected, atol=1e-12, rtol=1e-10)
    for got, want in zip(grads, torch.autograd.grad(expected, (query, key, value), grad)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert ran == [KERNELS[kernel]]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_attention_in_float32_and_bfloat16_equals_explicit_attention(kernel, dtype, monkeypatch):
    """The same in float32, the training dtype, at a tolerance of float32 rounding; bfloat16 inputs are computed in
    float32 and rounded once, output and gradients in the inputs' dtype."""
    ran = take(kernel, monkeypatch, 32)
    length, dim, scaling, p = 100, 16, 0.25, 0.1
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(1, 2, length, dim, generator=generator).to(dtype).requires_grad_() for _ in range(2))
    value = torch.cat([torch.randn(1, 2, length, dim, generator=generator), torch.eye(length).expand(1, 2, -1, -1)],
                      dim=-1).to(dtype).requires_grad_()
    output, _ = blocked_dropout_attention_forward(Training().train(), query, key, value, None, scaling, dropout=p)
    grad = torch.randn(output.shape, generator=generator).to(dtype)
    grads = torch.autograd.grad(output, (query, key, value), grad)
    assert output.dtype == dtype and all(g.dtype == dtype for g in grads)
    dropped = output[..., dim:].transpose(1, 2) == 0
    leaves = [t.detach().float().requires_grad_() for t in (query, key, value)]
    expected = explicit_dropout_attention(*leaves, None, scaling, dropped, p)
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(output.float(), expected, **tolerance)
    for got, want in zip(grads, torch.autograd.grad(expected, leaves, grad.float())):
        torch.testing.assert_close(got.float(), want, **({"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32
                                                         else tolerance))
    assert ran == [KERNELS[kernel]]


def test_dropout_masks_drop_a_fraction_p_of_the_weights_independently():
    """Each weight is dropped with probability p (to 2**-16): over 2**22 draws the fraction is p within 5 standard
    errors, and neighbouring weights are independent (dropped together as often as p**2)."""
    for p in (0.1, 0.5, 0.9):
        dropped = blocked_dropout.draw_dropout_mask(1024, 4096, p)
        n, fraction = dropped.numel(), dropped.double().mean().item()
        assert abs(fraction - p) < 5 * (p * (1 - p) / n) ** 0.5
        together = (dropped[:, 1:] & dropped[:, :-1]).double().mean().item()
        assert abs(together - p * p) < 5 * (p * p * (1 - p * p) / n) ** 0.5
    assert blocked_dropout.draw_dropout_mask(3, 77, 0.1).shape == (3, 80)  # columns up to a multiple of 8


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("backward_under_autocast", [False, True])
def test_dropout_attention_under_autocast_computes_in_float32(kernel, backward_under_autocast, monkeypatch):
    """Under CPU autocast to bfloat16 (a user's mixed-precision training) the kernels compute as without it: the same
    output and gradients with the same seed, whether the backward pass runs under autocast or not."""
    take(kernel, monkeypatch, 16)
    query, key, value = qkv(batch=2, heads=2, length=40, dim=8)
    grad = torch.randn(2, 40, 2, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for autocast in (False, True):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output, _ = blocked_dropout_attention_forward(Training().train(), query, key, value, None, 0.3,
                                                          dropout=0.2)
            if backward_under_autocast:
                grads = torch.autograd.grad(output, (query, key, value), grad)
        if not backward_under_autocast:
            grads = torch.autograd.grad(output, (query, key, value), grad)
        results.append((output, *grads))
    for plain, autocast in zip(*results):
        assert autocast.dtype == torch.float32
        torch.testing.assert_close(autocast, plain, atol=0, rtol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_dropped_output_is_the_undropped_one_on_average(kernel, monkeypatch):
    """Kept weights scaled by 1 / (1 - p): averaged over many draws the output is that of attention without
    dropout, within 5 standard errors of the average."""
    take(kernel, monkeypatch, 8)
    query, key, value = (t.detach() for t in qkv(batch=1, heads=2, length=40, dim=4))
    expected, _ = eager_attention_forward(Training().eval(), query, key, value, None, scaling=0.5)
    torch.manual_seed(0)
    draws = torch.stack([blocked_dropout_attention_forward(Training().train(), query, key, value, None, 0.5,
                                                           dropout=0.3)[0] for _ in range(400)])
    standard_error = draws.std(dim=0) / len(draws) ** 0.5
    assert ((draws.mean(dim=0) - expected).abs() < 5 * standard_error + 1e-6).all()


def test_compiled_blocked_dropout_drops_single_weights(monkeypatch):
    """Under torch.compile (one graph) the kernel traces plain ops: weights still dropped one by one and rescaled,
    and gradients flow."""
    monkeypatch.setattr(attention, "DROPOUT_BLOCK_ROWS", 16)
    torch._dynamo.reset()
    length, p = 40, 0.25
    query, key, _ = qkv(batch=1, heads=1, length=length, dim=4)
    value = torch.eye(length)[None, None].requires_grad_()
    weights = (query @ key.transpose(-1, -2) * 0.5).softmax(-1)[0, 0].detach()
    compiled = torch.compile(blocked_dropout_attention_forward, fullgraph=True, backend="aot_eager")
    dropped = compiled(Training().train(), query, key, value, None, 0.5, dropout=p)[0]
    dropped.sum().backward()
    kept = dropped[0, :, 0] != 0
    torch.testing.assert_close(dropped[0, :, 0][kept], weights[kept] / (1 - p), atol=1e-6, rtol=1e-5)
    assert 0 < (~kept).sum() < length * length / 2 and query.grad.isfinite().all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropout_masks_are_repeated_by_the_seed_whatever_the_thread_count(kernel, monkeypatch):
    """The same seed gives the same output and gradients with 1 thread or 3, and torch's thread count is as it was
    afterwards: in blocks the heads run in parallel, each drawing from its own generator seeded from the default one;
    with every weight at once the mask is one draw from the default generator."""
    take(kernel, monkeypatch, 16)
    query, key, value = qkv(batch=2, heads=3, length=50, dim=8)
    grad = torch.randn(2, 50, 3, 8, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    results = []
    for count in (1, 3, 3):
        torch.set_num_threads(count)
        torch.manual_seed(0 if len(results) < 2 else 1)
        output, _ = blocked_dropout_attention_forward(Training().train(), query, key, value, None, 0.3, dropout=0.5)
        results.append((output, *torch.autograd.grad(output, (query, key, value), grad)))
        assert torch.get_num_threads() == count
    torch.set_num_threads(threads)
    for one_thread, three_threads in zip(*results[:2]):
        torch.testing.assert_close(one_thread, three_threads, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(results[1][0], results[2][0])  # another seed, another mask


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_hidden_dropout_drops_at_the_rate_and_scales_as_nn_dropout(p):
    """Each element zeroed with probability p, the others divided by 1 - p; the gradient passes where the forward
    kept; the same seed draws the same mask. 300 x 257 elements: not a multiple of the four drawn per number."""
    x = torch.randn(300, 257, requires_grad=True)
    module = torch.nn.Dropout(p).train()
    torch.manual_seed(0)
    output = blocked_dropout.dropout(module, x)
    kept = output != 0
    assert abs((~kept).float().mean().item() - p) < 0.01
    torch.testing.assert_close(output[kept], x[kept] / (1 - p), atol=0, rtol=1e-6)
    grad = torch.randn(x.shape)
    output.backward(grad)
    torch.testing.assert_close(x.grad, torch.where(kept, grad / (1 - p), 0), atol=0, rtol=1e-6)
    torch.manual_seed(0)
    assert torch.equal(blocked_dropout.dropout(module, x) != 0, kept)
    rows, columns = kept.float().mean(1), kept.float().mean(0)  # no row or column drawn apart from the rest
    assert rows.std() < 3 * (p * (1 - p) / 257) ** 0.5 and columns.std() < 3 * (p * (1 - p) / 300) ** 0.5


def test_hidden_dropout_is_the_modules_own_call_where_it_must_be(monkeypatch):
    """Evaluation, p 0 or 1, an in-place or hooked module (torchinfo hooks every module): the module's own call."""
    calls = []
    monkeypatch.setattr(blocked_dropout.HiddenDropout, "apply", lambda *args: calls.append(args) or args[0])
    x = torch.randn(4, 6)
    assert torch.equal(blocked_dropout.dropout(torch.nn.Dropout(0.3).eval(), x), x)
    assert torch.equal(blocked_dropout.dropout(torch.nn.Dropout(0.0).train(), x), x)
    assert (blocked_dropout.dropout(torch.nn.Dropout(1.0).train(), x) == 0).all()
    hooked = torch.nn.Dropout(0.3).train()
    hooked.register_forward_hook(lambda module, args, output: calls.append("hook"))
    blocked_dropout.dropout(hooked, x)
    assert calls == ["hook"]
    blocked_dropout.dropout(torch.nn.Dropout(0.3).train(), x)
    assert len(calls) == 2  # the plain module in training: HiddenDropout


def test_a_models_hidden_dropout_in_training_draws_through_hidden_dropout(monkeypatch):
    from helpers import tiny_config

    from roformer_hf import RoFormerForMaskedLM, RoFormerForTokenClassification

    calls = []
    original = blocked_dropout.HiddenDropout.apply
    monkeypatch.setattr(blocked_dropout.HiddenDropout, "apply", lambda x, p: calls.append(p) or original(x, p))
    ids = torch.randint(1, 97, (2, 7))
    for model in (RoFormerForMaskedLM(tiny_config(hidden_dropout_prob=0.2)),
                  RoFormerForTokenClassification(tiny_config(hidden_dropout_prob=0.2))):
        calls.clear()
        model.train()(ids, labels=torch.zeros_like(ids)).loss.backward()
        # the embeddings' and each layer's two sublayers' (and the token head's)
        assert calls == [0.2] * (1 + 2 * model.config.num_hidden_layers + hasattr(model, "classifier"))
        calls.clear()
        model.eval()(ids)
        assert calls == []
