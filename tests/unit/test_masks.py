"""Masks (roformer_hf/masks.py): each form a kernel takes, against the definitions of padding, packed rows, causality
and the bidirectional prefix."""

import pytest
import torch

from roformer_hf.kernels import choose_kernel
from roformer_hf.masks import create_attention_mask
from roformer_hf.padding import BatchLayout

MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])


def test_key_mask_never_leaves_a_row_empty():
    batch = BatchLayout.from_attention_mask(MASK, 4, 4, unpad=False)
    key_mask = create_attention_mask(batch, choose_kernel("sdpa")).dense
    assert batch.mode == "padded" and key_mask.shape == (4, 1, 1, 4)
    assert key_mask.any(dim=-1).all()  # the fully padded row may see its first key
    assert key_mask[1, 0, 0].tolist() == [True, False, False, False]
    assert torch.equal(key_mask[[0, 2, 3], 0, 0], MASK[[0, 2, 3]].bool())


def test_flash_attention_refuses_a_prefix_rather_than_drop_it():
    layout = BatchLayout.from_attention_mask(None, 1, 4)
    with pytest.raises(ValueError, match="flash-attn cannot apply a bidirectional prefix"):
        create_attention_mask(layout, choose_kernel("flash_attention_2"), causal=True,
                              prefix=torch.ones(1, 4, dtype=torch.bool))


def test_varlen_form_renders_no_mask_but_the_longest_sequences_causal_one_where_the_kernel_needs_it():
    """Self-attention on skipped padding: the kernels read the layout's offsets, no mask is rendered; a kernel that
    takes causality as a mask (attention dropout on CPU) gets the causal mask of the longest sequence, once."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0]])
    layout = BatchLayout.from_attention_mask(mask, 3, 5)
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 8] and layout.max_seqlen == 3
    for causal in (False, True):
        rendered = create_attention_mask(layout, choose_kernel("sdpa"), causal=causal)
        assert rendered.form == "varlen" and rendered.tensor is None
    dropout = create_attention_mask(layout, choose_kernel("sdpa", dropout=True), causal=True)
    assert dropout.form == "varlen"
    assert torch.equal(dropout.dense, torch.ones(3, 3, dtype=torch.bool).tril()[None, None])  # (1, 1, 3, 3)
    assert create_attention_mask(layout, choose_kernel("sdpa", dropout=True)).dense is None  # not causal: no mask
    # Only the layout's own self-attention: a cache or a prefix needs a dense mask.
    keys = torch.ones(3, 7, dtype=torch.bool)
    assert create_attention_mask(layout, choose_kernel("sdpa"), causal=True, past_length=2,
                                 key_padding=keys).form == "dense"
    assert create_attention_mask(layout, choose_kernel("sdpa"), causal=True,
                                 prefix=torch.zeros(3, 5, dtype=torch.bool)).form == "dense"


def test_flash_form_is_the_keys_padding():
    """flash-attn's padded interface takes ``(B, Lk)``, True at real keys: the attention mask itself for
    self-attention, the given key padding for a cache (causality comes from the module, not from the mask)."""
    kernel = choose_kernel("flash_attention_2")
    layout = BatchLayout.from_attention_mask(MASK, 4, 4, unpad=False)
    own = create_attention_mask(layout, kernel, causal=True)
    assert own.form == "flash" and own.keys_are_queries and own.dense is None
    assert torch.equal(own.tensor, MASK.bool())
    past_and_new = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]])
    cached = create_attention_mask(layout, kernel, causal=True, past_length=2, key_padding=past_and_new.bool())
    assert cached.form == "flash" and not cached.keys_are_queries
    assert torch.equal(cached.tensor, past_and_new.bool())
    packed = BatchLayout("padded", 1, 4, segment_ids=torch.tensor([[0, 0, 1, 1]]))  # packed rows, as traced
    with pytest.raises(ValueError, match="cannot keep packed sequences apart"):
        create_attention_mask(packed, kernel)
