"""The masked-LM loss against transformers' `ForMaskedLMLoss` (PyTorch's cross-entropy): values (to the bit) and
gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from transformers.loss.loss_utils import ForMaskedLMLoss

from roformer_hf import RoFormerForMaskedLM
from roformer_hf.loss import masked_lm_loss


@pytest.mark.parametrize("seed", range(8))
def test_masked_lm_loss_and_its_gradient_equal_transformers(seed):
    """Random shapes (flat or batched labels), shares of ignored labels (all of them included), dtypes and
    `num_items_in_batch` (none, an int, a tensor)."""
    generator = torch.Generator().manual_seed(seed)
    shape = [(7,), (3, 5), (2, 4, 6)][seed % 3]
    vocab = int(torch.randint(2, 300, (1,), generator=generator))
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    logits = (4 * torch.randn(*shape, vocab, generator=generator)).to(dtype)
    labels = torch.randint(vocab, shape, generator=generator)
    ignored = torch.rand(shape, generator=generator) < (0.0, 0.5, 1.0, 0.9)[seed % 4]
    labels = labels.masked_fill(ignored, -100)
    count = [None, 11, torch.tensor(13)][seed % 3]
    results = []
    for loss_function in (ForMaskedLMLoss, masked_lm_loss):
        leaf = logits.clone().requires_grad_()
        loss = loss_function(leaf, labels, vocab_size=vocab, num_items_in_batch=count)
        if not ignored.all():
            loss.backward(torch.tensor(0.7))
        results.append((loss, leaf.grad))
    (expected, expected_grad), (actual, actual_grad) = results
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, equal_nan=True, atol=0, rtol=0)  # the same value, to the bit
    if ignored.all():
        assert count is not None or actual.isnan()  # the mean over no labelled token
    else:
        assert actual_grad.dtype == dtype
        torch.testing.assert_close(actual_grad, expected_grad)


def test_the_masked_lm_takes_this_loss_unless_another_is_set():
    model = RoFormerForMaskedLM(tiny_config())
    assert model.loss_function is masked_lm_loss

    def custom(logits, labels, vocab_size, **kwargs):
        return logits.sum() * 0

    model.loss_function = custom
    ids = torch.randint(1, 97, (2, 5))
    assert model.loss_function is custom and model(ids, labels=ids).loss == 0
