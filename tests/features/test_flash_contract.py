"""The flash-attn code path, run on CPU with a stand-in kernel (CI has no GPU, the real kernel is tested in
test_gpu.py). The stand-in attends with SDPA and checks what transformers' flash-attn wrapper requires: packed
`(1, nh, N, d)` tensors with int32 `cu_seq_lens` and Python-int lengths, or padded tensors with a `(B, L)` mask
(`helpers.varlen_stand_in`; the `stand_in_flash` fixture is in conftest.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import STAND_IN, padded_batch, tiny_config

from roformer_hf import RoFormerForCausalLM, RoFormerForMaskedLM


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


@pytest.mark.parametrize("unpad, expected_call", [(True, "varlen"), (False, "padded")])
def test_flash_path_of_the_decoder_matches_sdpa(stand_in_flash, unpad, expected_call):
    """Causal through `module.is_causal` on both flash paths, and generation with the cache (the padded path with
    the keys' (B, Lk) padding) gives SDPA's tokens."""
    torch.manual_seed(0)
    sdpa = RoFormerForCausalLM(tiny_config(is_decoder=True, unpad_inputs=unpad)).eval()
    flash = RoFormerForCausalLM(tiny_config(is_decoder=True, unpad_inputs=unpad)).eval()
    flash.load_state_dict(sdpa.state_dict())
    flash.set_attn_implementation(STAND_IN)
    ids, mask = padded_batch([9, 4, 7])
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected, actual = sdpa(ids, attention_mask=mask, labels=labels), flash(ids, attention_mask=mask, labels=labels)
    assert set(stand_in_flash) == {expected_call}
    real = mask.bool()
    torch.testing.assert_close(actual.logits[real], expected.logits[real], atol=1e-5, rtol=1e-5)
    prompts, prompt_mask = padded_batch([6, 3], left=True)
    settings = {"attention_mask": prompt_mask, "max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False,
                "pad_token_id": 0}
    assert torch.equal(flash.generate(prompts, **settings), sdpa.generate(prompts, **settings))
