"""The ways of attending (roformer_hf/attention.py) on tensors, against independent references."""

from __future__ import annotations

import pytest
import torch
from helpers import KernelModule as Training
from helpers import random_qkv as qkv

from roformer_hf import attention
from roformer_hf.attention import blocked_dropout_attention_forward, eager_attention_forward
from roformer_hf.blocked_dropout import DropoutAttention
from roformer_hf.kernels import CUDA_VARLEN, SDPA_VARLEN, Kernel, choose_kernel


@pytest.mark.parametrize("training, p", [(True, 0.0), (False, 0.3)])
def test_blocked_dropout_attention_without_dropout_is_plain_attention(training, p):
    """Dropout 0, or evaluation: plain attention, whatever the length."""
    query, key, value = qkv(length=1100)
    mask = torch.rand(2, 1, 1, 1100, generator=torch.Generator().manual_seed(1)) > 0.3
    expected, _ = eager_attention_forward(Training().eval(), query, key, value, mask, scaling=0.3)
    module = Training().train(training)
    actual, _ = blocked_dropout_attention_forward(module, query, key, value, mask, scaling=0.3, dropout=p)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("unpad", [True, False])
def test_models_in_training_use_blocked_dropout_on_cpu(unpad, monkeypatch):
    from helpers import padded_batch, tiny_config

    import roformer_hf

    calls = []
    original = attention.blocked_dropout_attention_forward

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS._global_mapping, attention.SDPA_DROPOUT, spy)
    whole = []
    monkeypatch.setattr(DropoutAttention, "apply", lambda *args, _apply=DropoutAttention.apply:
                        whole.append(args[0].shape) or _apply(*args))
    model = roformer_hf.RoFormerForMaskedLM(tiny_config(attention_probs_dropout_prob=0.1, unpad_inputs=unpad))
    ids, mask = padded_batch([9, 4])
    model.train()(ids, attention_mask=mask).logits.sum().backward()
    assert calls and whole == calls  # short sequences: every weight at once
    calls.clear()
    model.eval()(ids, attention_mask=mask)
    assert not calls


class Causal(Training):
    is_causal = True


class Bidirectional(Training):
    is_causal = False  # transformers' SDPA takes a module without the attribute as causal


def float64_causal_attention(query, key, value, scaling):
    """softmax(q k^T * scaling) v with query i (of Lq, the last of Lk keys) seeing keys up to Lk - Lq + i."""
    q, k, v = (t.detach().double() for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) * scaling
    queries, keys = scores.shape[-2:]
    future = torch.ones(queries, keys, dtype=torch.bool).triu(keys - queries + 1)
    return (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("kernel", [eager_attention_forward, blocked_dropout_attention_forward,
                                    attention.sdpa_varlen_attention_forward])
@pytest.mark.parametrize("queries", [600, 7, 1])  # as many queries as keys, or the last few of them (after a cache)
def test_every_kernel_is_causal_for_a_causal_module_given_no_mask(kernel, queries):
    """transformers' kernels read `module.is_causal` when they are given no mask; these do too, with the queries
    aligned to the last keys, as after a cache."""
    query, key, value = qkv(length=600)
    query = query[:, :, -queries:]
    if kernel is attention.sdpa_varlen_attention_forward:  # packed tokens of one sequence: (1, nh, N, d)
        if queries != 600:
            pytest.skip("varlen kernels attend a sequence to itself: as many queries as keys")
        query, key, value = (t[:1] for t in (query, key, value))
        offsets = {"cu_seq_lens_q": torch.tensor([0, 600], dtype=torch.int32)}
    else:
        offsets = {}
    actual, _ = kernel(Causal().eval(), query, key, value, None, scaling=0.3, **offsets)
    expected = float64_causal_attention(query, key[:len(query)], value[:len(query)], 0.3)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    not_causal, _ = kernel(Bidirectional().eval(), query, key, value, None, scaling=0.3, **offsets)
    if queries > 1:
        assert (not_causal.double() - expected).abs().max() > 1e-2  # the test would see a kernel that ignores it


@pytest.mark.parametrize("block_rows", [64, attention.DROPOUT_BLOCK_ROWS])  # in blocks; every weight at once
def test_dropout_kernels_are_causal_in_training(block_rows, monkeypatch):
    """With dropout, the weights past the diagonal are never kept (values = identity: the output is the dropped
    weight matrix)."""
    monkeypatch.setattr(attention, "DROPOUT_BLOCK_ROWS", block_rows)
    length = 300
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(1, 1, length, 16, generator=generator) for _ in range(2))
    value = torch.eye(length)[None, None]
    dropped, _ = blocked_dropout_attention_forward(Causal().train(), query, key, value, None, 0.25, dropout=0.2)
    weights = dropped[0, :, 0]  # (L, L)
    assert (weights.triu(1) == 0).all() and (weights.tril() != 0).any()


def test_varlen_kernel_attends_each_sequence_to_its_own_keys():
    """Queries and keys delimited apart (as flash-attn's varlen kernel takes them): each sequence's queries see
    exactly its keys; causality with unequal lengths is refused."""
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 2, 5, 4, generator=generator)  # sequences of 3 and 2 queries
    key, value = (torch.randn(1, 2, 7, 4, generator=generator) for _ in range(2))  # ... of 4 and 3 keys
    offsets = {"cu_seq_lens_q": torch.tensor([0, 3, 5]), "cu_seq_lens_k": torch.tensor([0, 4, 7])}
    output, _ = attention.sdpa_varlen_attention_forward(Bidirectional().eval(), query, key, value, None, 0.5,
                                                        **offsets)
    for (q0, q1), (k0, k1) in (((0, 3), (0, 4)), ((3, 5), (4, 7))):
        q, k, v = (t.double() for t in (query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1]))
        expected = ((q @ k.transpose(-1, -2) * 0.5).softmax(-1) @ v).transpose(1, 2)
        torch.testing.assert_close(output[:, q0:q1].double(), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="causal attention on packed sequences needs as many keys as queries"):
        attention.sdpa_varlen_attention_forward(Causal().eval(), query, key, value, None, 0.5, **offsets)


class GroupedBidirectional(Bidirectional):
    num_key_value_groups = 2


@pytest.mark.parametrize("query_lengths", [(4, 3, 5), (2, 0, 3)], ids=["every token", "some sequences without queries"])
def test_nested_kernel_attends_each_sequence_to_its_own_keys(query_lengths):
    """The CUDA varlen kernel (SDPA on nested tensors; PyTorch's math kernel on CPU) against the closed form per
    sequence in float64, forward and gradients: grouped-query heads, and queries of some tokens only, a sequence
    with none among them (the flash and memory-efficient kernels refuse those; the kernel leaves them out)."""
    key_lengths = (4, 3, 5)
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, sum(query_lengths), 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, sum(key_lengths), 8, generator=generator, requires_grad=True) for _ in range(2))
    offsets_q, offsets_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                            for n in (query_lengths, key_lengths))
    output, _ = attention.cuda_varlen_attention_forward(GroupedBidirectional().eval(), query, key, value, None, 0.5,
                                                         cu_seq_lens_q=offsets_q, cu_seq_lens_k=offsets_k)
    pieces = []
    for q0, q1, k0, k1 in zip(offsets_q, offsets_q[1:], offsets_k, offsets_k[1:]):
        q = query[0, :, q0:q1].double()
        k, v = (t[0, :, k0:k1].double().repeat_interleave(2, dim=0) for t in (key, value))
        pieces.append(((q @ k.transpose(-1, -2) * 0.5).softmax(-1) @ v).transpose(0, 1))  # (n, nh, d)
    expected = torch.cat(pieces)[None]
    torch.testing.assert_close(output.double(), expected, atol=1e-6, rtol=1e-6)
    weights = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    actual_grads = torch.autograd.grad((output.double() * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for actual, wanted in zip(actual_grads, expected_grads):
        torch.testing.assert_close(actual.double(), wanted.double(), atol=1e-5, rtol=1e-5)


def test_sdpa_on_cuda_takes_the_cuda_varlen_kernel_for_packed_rows():
    """SDPA's varlen function by device: sequence by sequence on CPU; on CUDA for packed rows only (padded batches
    keep the padded kernel there), with or without attention dropout, which CUDA's kernels draw themselves."""
    assert choose_kernel("sdpa", "cpu").varlen == choose_kernel("sdpa", "cpu", packed_rows=True).varlen == SDPA_VARLEN
    for dropout in (False, True):
        assert choose_kernel("sdpa", "cuda", dropout=dropout, packed_rows=True) == Kernel("sdpa", CUDA_VARLEN)
        assert choose_kernel("sdpa", "cuda", dropout=dropout) == Kernel("sdpa")
    assert choose_kernel("eager", "cuda", packed_rows=True).varlen is None


@pytest.mark.parametrize("module", [Bidirectional(), Causal()], ids=["bidirectional", "causal"])
def test_varlen_kernel_attends_runs_of_equal_lengths_in_one_call_each(module, monkeypatch):
    """Adjacent sequences of one length (a batch sorted by length) share one SDPA call, and each still sees exactly
    its own keys; a sequence without queries between them holds no rows."""
    lengths = [4, 4, 4, 0, 3, 3, 5, 4, 4]  # runs: 4 x3, 0 (no call), 3 x2, 5, 4 x2
    generator = torch.Generator().manual_seed(5)
    query, key, value = (torch.randn(1, 3, sum(lengths), 8, generator=generator) for _ in range(3))
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    calls = []
    sdpa = attention.ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa",
                        lambda *args, **kwargs: calls.append(args[1].shape) or sdpa(*args, **kwargs))
    output, _ = attention.sdpa_varlen_attention_forward(module.eval(), query, key, value, None, 0.5,
                                                        cu_seq_lens_q=offsets)
    assert [shape[0] for shape in calls] == [3, 2, 1, 2]
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        expected = (float64_causal_attention(q, k, v, 0.5) if module.is_causal
                    else ((q.double() @ k.double().transpose(-1, -2) * 0.5).softmax(-1) @ v.double()).transpose(1, 2))
        torch.testing.assert_close(output[:, start:end].double(), expected, atol=1e-6, rtol=1e-6)


def test_varlen_kernel_with_attention_dropout_attends_a_run_of_one_length_per_call(monkeypatch):
    """In training with attention dropout too, adjacent sequences of one length are one call of the dropout kernel
    (which draws every weight's mask independently)."""
    calls = []
    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS._global_mapping, attention.SDPA_DROPOUT,
                        lambda module, q, *args, **kwargs: calls.append(q.shape) or (q.transpose(1, 2), None))
    query = torch.randn(1, 2, 14, 4)
    attention.sdpa_varlen_attention_forward(Bidirectional().train(), query, query, query, None, 0.5, dropout=0.1,
                                            cu_seq_lens_q=torch.tensor([0, 4, 8, 12, 14]))
    assert [tuple(shape) for shape in calls] == [(3, 2, 4, 4), (1, 2, 2, 4)]
