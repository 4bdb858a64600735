"""BatchLayout: the modes of a batch, packing real tokens and putting them back."""

import pytest
import torch
from helpers import tiny_config

from roformer_hf.kernels import choose_kernel
from roformer_hf.masks import create_attention_mask
from roformer_hf.modeling import RoFormerLMPredictions
from roformer_hf.padding import BatchLayout, logits_in_padded_layout

MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])


def test_pack_unpack_round_trip_and_layout():
    batch = BatchLayout.from_attention_mask(MASK, 4, 4)
    x = torch.arange(16.0).view(4, 4, 1).expand(4, 4, 3)
    packed = batch.gather_tokens(x)
    assert packed.shape == (9, 3)
    assert packed[:, 0].tolist() == [0, 1, 2, 8, 9, 10, 11, 13, 14]  # row-major real tokens
    assert batch.mode == "varlen"
    assert batch.cu_seqlens.tolist() == [0, 3, 3, 7, 9] and batch.max_seqlen == 4
    unpacked = batch.scatter_tokens(packed)
    assert torch.equal(unpacked[MASK.bool()], x[MASK.bool()])
    assert (unpacked[~MASK.bool()] == 0).all()


def test_gradients_flow_through_pack_and_unpack():
    batch = BatchLayout.from_attention_mask(MASK, 4, 4)
    x = torch.randn(4, 4, 2, requires_grad=True)
    batch.scatter_tokens(batch.gather_tokens(x) * 2).sum().backward()
    assert torch.equal(x.grad, 2 * MASK[..., None].float().expand(4, 4, 2))


def test_no_padding_keeps_tensors_as_they_are():
    for mask in (None, torch.ones(2, 3, dtype=torch.long)):
        batch = BatchLayout.from_attention_mask(mask, 2, 3)
        x = torch.randn(2, 3, 5)
        assert batch.mode == "dense" and create_attention_mask(batch, choose_kernel("sdpa")).dense is None
        assert batch.gather_tokens(x) is x and batch.scatter_tokens(x) is x


def test_blocks_locate_each_sequence_in_the_padded_batch():
    # MASK has right, no, and both-side padding and an empty row: every sequence is still one run of rows.
    assert BatchLayout.from_attention_mask(MASK, 4, 4).blocks() == [(0, 0, 3), (3, 8, 4), (7, 13, 2)]
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert BatchLayout.from_attention_mask(left, 2, 4).blocks() == [(0, 2, 2), (2, 4, 4)]
    holes = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    assert BatchLayout.from_attention_mask(holes, 2, 4).blocks() is None


@pytest.mark.parametrize("unpad", [True, False])
def test_edge_tokens_are_each_sequences_first_and_last_real_token(unpad):
    mask = torch.cat([MASK, torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1]])])  # + holes, + left padding
    batch = BatchLayout.from_attention_mask(mask, 6, 4, unpad=unpad)
    x = torch.randn(6, 4, 3)
    states = batch.gather_tokens(x) if unpad else x
    for last in (False, True):
        expected = []
        for row in range(6):
            real = mask[row].nonzero().flatten().tolist()
            expected.append(x[row, real[-1 if last else 0]] if real else torch.zeros(3))
        assert torch.equal(batch.edge_tokens(states, last=last), torch.stack(expected))
    x = torch.randn(2, 3, 3)
    no_padding = BatchLayout.from_attention_mask(None, 2, 3)
    assert torch.equal(no_padding.edge_tokens(x), x[:, 0]) and torch.equal(no_padding.edge_tokens(x, True), x[:, -1])


@pytest.mark.parametrize("unpad", [True, False])
def test_mean_tokens_is_the_mean_of_each_sequences_real_tokens(unpad):
    mask = torch.cat([MASK, torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1]])])  # + holes, + left padding
    batch = BatchLayout.from_attention_mask(mask, 6, 4, unpad=unpad)
    x = torch.randn(6, 4, 3)
    states = batch.gather_tokens(x) if unpad else x
    expected = [x[row, mask[row].bool()].mean(0) if mask[row].any() else torch.zeros(3) for row in range(6)]
    torch.testing.assert_close(batch.mean_tokens(states), torch.stack(expected))
    no_padding = BatchLayout.from_attention_mask(None, 2, 3)
    x = torch.randn(2, 3, 3)
    torch.testing.assert_close(no_padding.mean_tokens(x), x.mean(1))


def mlm_head(**overrides) -> RoFormerLMPredictions:
    torch.manual_seed(0)
    config = tiny_config(hidden_size=8, num_attention_heads=2, vocab_size=5, **overrides)
    head = RoFormerLMPredictions(config)
    if head.decoder.bias is not None:
        torch.nn.init.normal_(head.decoder.bias)  # not zeros, so that a lost bias shows
    return head


@pytest.mark.parametrize("v2", [False, True], ids=["RoFormer", "RoFormer-V2 (no transform, no bias)"])
def test_logits_in_padded_layout_equals_unpack_of_the_mapped_tokens(v2):
    """The per-sequence path (contiguous sequences) and the fallback (holes) both give unpack(head(x)), values and
    gradients, with zeros at the padding; without autograd (oneDNN's kernel where it runs) the same values."""
    head = mlm_head(**({"use_bias": False, "norm_type": "rms_norm"} if v2 else {}))
    for mask in (MASK, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
                 torch.tensor([[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 0, 1]])):
        batch = BatchLayout.from_attention_mask(mask, 4, 4)
        x = torch.randn(int(mask.sum()), 8, requires_grad=True)
        mapped = logits_in_padded_layout(head, x, batch, min_rows=1)  # per sequence even for these short ones
        expected = batch.scatter_tokens(head(x))
        assert mapped.shape == (4, 4, 5)
        torch.testing.assert_close(mapped, expected)
        assert (mapped[~mask.bool()] == 0).all()
        grad = torch.randn(4, 4, 5)
        (got,) = torch.autograd.grad(mapped, x, grad)
        (want,) = torch.autograd.grad(expected, x, grad)
        torch.testing.assert_close(got, want)
        with torch.inference_mode():
            torch.testing.assert_close(logits_in_padded_layout(head, x, batch, min_rows=1), expected.detach())


def test_logits_in_padded_layout_runs_the_head_per_sequence_only_for_long_enough_sequences():
    head, calls = mlm_head(), []
    head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    batch = BatchLayout.from_attention_mask(MASK, 4, 4)  # sequences of 3, 4 and 2 tokens
    x = torch.randn(9, 8)
    with torch.no_grad():
        expected = batch.scatter_tokens(head(x))
        calls.clear()
        torch.testing.assert_close(logits_in_padded_layout(head, x, batch, min_rows=3), expected)
        assert [n for n in calls if n] == [3, 4, 2]  # (a call on no rows tells the logits' width and dtype)
        calls.clear()
        torch.testing.assert_close(logits_in_padded_layout(head, x, batch, min_rows=4), expected)
        assert calls == [9]  # 9 tokens < 4 x 3 sequences: one call on all the packed tokens
        calls.clear()
        torch.testing.assert_close(logits_in_padded_layout(head, x, batch, min_rows=1, max_rows=2), expected)
        assert [n for n in calls if n] == [2, 1, 2, 2, 2]  # at most max_rows logits at a time


def test_a_batch_without_real_tokens_packs_to_nothing():
    batch = BatchLayout.from_attention_mask(torch.zeros(2, 3, dtype=torch.long), 2, 3)
    assert batch.mode == "varlen" and batch.max_seqlen == 0 and batch.blocks() == []
    assert batch.gather_tokens(torch.randn(2, 3, 4)).shape == (0, 4)
    assert torch.equal(batch.scatter_tokens(torch.randn(0, 4)), torch.zeros(2, 3, 4))


def test_a_packed_row_of_a_new_length_does_not_recompile_the_layout():
    """DataCollatorWithFlattening's batches: one row, the same number of sequences, a new total length each step.
    Once torch.compile has made the length dynamic (its second change), no new length compiles the layout again.
    (The check that every row starts a sequence used to specialise a single row's length: one recompile a batch, up
    to dynamo's limit.)"""
    import itertools

    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def offsets_of(position_ids):
        return BatchLayout.from_inputs(1, position_ids.shape[1], None, position_ids).cu_seqlens

    frames = []
    for lengths in ([9, 4, 7], [5, 3, 12], [11, 2, 6], [8, 6, 3], [10, 10, 10], [3, 4, 5]):
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        assert offsets_of(positions).tolist() == [0, *itertools.accumulate(lengths)]
        frames.append(counter.frame_count)
    assert frames[2] == frames[-1], frames  # lengths 19, 17, 30 and 12 after the first two: no frame compiled again
