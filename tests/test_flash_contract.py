"""The flash-attn code path, run on CPU with a stand-in kernel (CI has no GPU, the real kernel is tested in
test_gpu.py). The stand-in attends with SDPA and checks what transformers' flash-attn wrapper requires: packed
`(1, nh, N, d)` tensors with int32 `cu_seq_lens` and Python-int lengths, or padded tensors with a `(B, L)` mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import padded_batch, tiny_config
from transformers import AttentionInterface

from roformer_hf import RoFormerForMaskedLM, attention

STAND_IN = "test_varlen_stand_in"  # a name with "flash" in it would make transformers look for the real kernel
calls: list[str] = []


def varlen_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if "cu_seq_lens_q" in kwargs:  # packed: (1, nh, N, d), one run of tokens per sequence
        offsets = kwargs["cu_seq_lens_q"]
        assert attention_mask is None and query.shape[0] == 1 and query.shape[2] > 0
        assert offsets.dtype == torch.int32 and torch.equal(offsets, kwargs["cu_seq_lens_k"])
        assert isinstance(kwargs["max_length_q"], int) and kwargs["max_length_q"] == offsets.diff().max().item()
        bounds = offsets.tolist()
        output = torch.cat([F.scaled_dot_product_attention(*(t[:, :, start:end] for t in (query, key, value)),
                                                           scale=scaling) for start, end in zip(bounds, bounds[1:])],
                           dim=2)
        calls.append("varlen")
    else:  # padded: (B, nh, L, d) with the (B, L) mask flash-attn unpads by itself
        assert attention_mask is None or attention_mask.dim() == 2
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        calls.append("padded")
    return output.transpose(1, 2), None  # (B, L, nh, d), as transformers' attention functions return


@pytest.fixture
def stand_in_flash(monkeypatch):
    AttentionInterface.register(STAND_IN, varlen_stand_in)
    monkeypatch.setattr(attention, "is_flash_attention_requested",
                        lambda requested_attention_implementation: requested_attention_implementation == STAND_IN)
    calls.clear()
    return calls


@pytest.mark.parametrize("unpad, lengths, expected_call", [
    (True, [9, 4, 7, 1], "varlen"),
    (False, [9, 4, 7, 1], "padded"),
    (True, [6, 6], "padded"),  # nothing to skip: the plain kernel on (B, L)
])
def test_flash_path_matches_sdpa(stand_in_flash, unpad, lengths, expected_call):
    torch.manual_seed(0)
    sdpa = RoFormerForMaskedLM(tiny_config(unpad_inputs=unpad)).eval()
    ids, mask = padded_batch(lengths)
    labels = ids.masked_fill(mask == 0, -100)
    expected = sdpa(ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    flash = RoFormerForMaskedLM(tiny_config(unpad_inputs=unpad)).eval()
    flash.load_state_dict(sdpa.state_dict())
    flash.set_attn_implementation(STAND_IN)
    actual = flash(ids, attention_mask=mask, labels=labels)
    actual.loss.backward()
    assert set(stand_in_flash) == {expected_call}
    real = mask.bool()
    torch.testing.assert_close(actual.logits[real], expected.logits[real], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(flash.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_flash_path_with_no_real_token_returns_zeros_without_calling_the_kernel(stand_in_flash):
    model = RoFormerForMaskedLM(tiny_config(attn_implementation="sdpa")).eval()
    model.set_attn_implementation(STAND_IN)
    ids = torch.zeros(2, 5, dtype=torch.long)
    logits = model(ids, attention_mask=torch.zeros_like(ids)).logits
    assert stand_in_flash == [] and logits.shape == (2, 5, 97) and (logits == 0).all()
