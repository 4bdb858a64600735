"""Masks (roformer_hf/masks.py): each form a kernel takes, against the definitions of padding, packed rows, causality
and the bidirectional prefix."""

import pytest
import torch

from roformer_hf.attention import choose_kernel
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
