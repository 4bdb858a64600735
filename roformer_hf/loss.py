"""The masked-LM loss: transformers' `ForMaskedLMLoss` (its arguments, its mean over the labelled tokens or sum over
Trainer's `num_items_in_batch`), with a cheaper backward pass.

The gradient of cross-entropy with respect to the logits is ``softmax - one_hot(label)``, scaled. PyTorch's
`cross_entropy` reaches it through NLL's backward (a zero-filled ``(M, V)`` tensor with one value per row) and then
log-softmax's backward (another ``(M, V)`` pass reading both). `CrossEntropySum` keeps the log-probabilities, as
PyTorch's does, and writes the gradient in one new tensor: their exponential, one subtracted at each label, scaled.
"""

from __future__ import annotations

import torch
from torch import Tensor


class CrossEntropySum(torch.autograd.Function):
    """``-sum(log_softmax(logits)[i, labels[i]])`` over the rows whose label is not `ignore_index`: ``logits``
    ``(M, V)`` float, ``labels`` ``(M,)`` int64."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)
        labelled = labels != ignore_index
        ctx.save_for_backward(log_probs, labels.where(labelled, 0).unsqueeze(-1), labelled)
        # NLL as PyTorch's cross-entropy computes it: the same value, to the bit
        return torch.nn.functional.nll_loss(log_probs, labels, ignore_index=ignore_index, reduction="sum")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        log_probs, labels, labelled = ctx.saved_tensors  # labels (M, 1), any class where the row is ignored
        grad_logits = log_probs.exp()  # softmax
        grad_logits.scatter_add_(-1, labels, torch.full_like(labels, -1, dtype=grad_logits.dtype))
        return grad_logits.mul_((labelled * grad).unsqueeze(-1)), None, None


def masked_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Tensor | int | None = None,
                   ignore_index: int = -100, **kwargs) -> Tensor:
    """transformers' `ForMaskedLMLoss`: the cross-entropy of `logits` ``(..., vocab_size)`` (computed in float32)
    against `labels` ``(...)``, averaged over the labelled tokens, or summed and divided by `num_items_in_batch`
    (Trainer's count of labelled tokens across gradient-accumulation steps) when given. No labelled token: NaN, as
    there."""
    logits = logits.float().reshape(-1, vocab_size)
    labels = labels.reshape(-1).to(logits.device)
    summed = CrossEntropySum.apply(logits, labels, ignore_index)
    if num_items_in_batch is None:
        return summed / (labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(summed.device)
    return summed / num_items_in_batch
