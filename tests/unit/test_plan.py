"""The forward's plan (roformer_hf/plan.py): every input resolved in one place, the kernel chosen once, and the values
the plan needs read from the device in one copy."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import padded_batch, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from roformer_hf import RoFormerForCausalLM, RoFormerForMaskedLM, RoFormerModel
from roformer_hf.kernels import SDPA_DROPOUT, SDPA_VARLEN
from roformer_hf.plan import ForwardPlan

# Operators whose result the host must wait for (a device-to-host copy on an accelerator).
SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
               "aten.equal.default"}


class HostSyncs(TorchDispatchMode):
    """Counts the host syncs of the code it runs: operators whose result the host must wait for, and `tolist`."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNCING_OPS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_syncs(monkeypatch):
    """Counts the host syncs of the forward's own code. oneDNN's dense path, a CPU path only, is turned off: it
    compares sampled entries of each packed weight with the weight on every call (`fused._same_source`), a read of
    host memory that an accelerator's forward never makes."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    mode = HostSyncs()
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        mode.calls.append("tolist")
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with mode:
        yield mode.calls
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)


def test_a_padded_forward_reads_the_device_once(monkeypatch):
    model = RoFormerForMaskedLM(tiny_config()).eval()
    ids, mask = padded_batch([9, 4, 7])
    with torch.no_grad():
        model(ids, attention_mask=mask)  # warm: nothing first-time counts
        with counting_host_syncs(monkeypatch) as calls:
            logits = model(ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                           position_ids=torch.arange(ids.shape[1])).logits
    assert calls == ["tolist"], calls  # id ranges, positions, the mask's lengths and edges: one copy
    assert logits.shape == (*ids.shape, model.config.vocab_size)


def test_a_generation_step_reads_the_device_once(monkeypatch):
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([6, 3], left=True)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(step)], dim=-1)
        with counting_host_syncs(monkeypatch) as calls:
            model(step, attention_mask=mask, past_key_values=out.past_key_values)
    assert calls == ["tolist"], calls


def test_positions_the_model_derives_never_pack_rows():
    # After a cache, positions continue from it: they restart nowhere, but even positions given by the caller are
    # not read as packed rows once keys come from a cache (query i is key past + i there).
    config = tiny_config(is_decoder=True)
    model = RoFormerForCausalLM(config).eval()
    ids = torch.randint(5, config.vocab_size, (2, 6))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        for positions in (None, torch.tensor([[0, 1, 0]] * 2)):
            plan = ForwardPlan.build(config, ids[:, :3], position_ids=positions, past_key_values=cache)
            assert plan.layout.mode == "dense" and not plan.layout.has_packed_rows
    restarting = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    assert ForwardPlan.build(tiny_config(), ids, position_ids=restarting).layout.has_packed_rows


@pytest.mark.parametrize("training, dropout, output_attentions, expected", [
    (False, 0.1, False, SDPA_VARLEN),  # padding skipped: SDPA one sequence at a time
    (True, 0.1, False, SDPA_VARLEN),
    (False, 0.0, True, "eager"),  # weights asked for: the eager kernel, on the padded layout
])
def test_the_kernel_is_chosen_once_for_every_layer(training, dropout, output_attentions, expected):
    config = RoFormerModel(tiny_config(attention_probs_dropout_prob=dropout)).config  # with its attention kernel
    ids, mask = padded_batch([9, 4, 7])
    plan = ForwardPlan.build(config, ids, mask, training=training, output_attentions=output_attentions,
                             output_hidden_states=output_attentions)
    assert plan.attention_mask.kernel == expected


def test_padded_training_with_attention_dropout_takes_the_blocked_kernel():
    ids, mask = padded_batch([9, 4, 7])
    config = RoFormerModel(tiny_config(attention_probs_dropout_prob=0.1, unpad_inputs=False)).config
    assert ForwardPlan.build(config, ids, mask, training=True).attention_mask.kernel == SDPA_DROPOUT
    assert ForwardPlan.build(config, ids, mask, training=False).attention_mask.kernel == "sdpa"


@pytest.mark.parametrize("inputs, message", [
    ({"input_ids": torch.tensor([[2, 500, 3]])}, r"input_ids contains 500; expected values in \[0, 97\)"),
    ({"input_ids": torch.tensor([[2, 5, 3]]), "token_type_ids": torch.tensor([[0, 2, 0]])},
     r"token_type_ids contains 2; expected values in \[0, 2\)"),
    ({"input_ids": torch.tensor([[2, 5, 3]]), "position_ids": torch.tensor([[0, -1, 2]])},
     "position_ids contains -1; expected positions >= 0"),
    ({"input_ids": torch.tensor([[2, 5, 3, 4]]), "cu_seq_lens_q": torch.tensor([0, 2, 4]),
      "cu_seq_lens_k": torch.tensor([0, 1, 4])}, r"cu_seq_lens_q = \[0, 2, 4\] and cu_seq_lens_k = \[0, 1, 4\] differ"),
])
def test_values_read_in_one_copy_are_still_refused_by_name(inputs, message):
    with pytest.raises(ValueError, match=message):
        RoFormerModel(tiny_config())(**inputs)


def test_causal_training_with_dropout_renders_one_causal_mask_for_every_sequence():
    ids, mask = padded_batch([9, 4, 7])
    rendered = {}
    for dropout in (0.1, 0.0):
        config = RoFormerModel(tiny_config(is_decoder=True, attention_probs_dropout_prob=dropout)).config
        rendered[dropout] = ForwardPlan.build(config, ids, mask, use_cache=False, training=True).attention_mask
        assert rendered[dropout].form == "varlen"
    assert rendered[0.0].dense is None  # SDPA is causal by itself
    longest = rendered[0.1].dense  # the dropout kernels take causality as a mask: the longest sequence's, once
    assert longest.shape == (1, 1, 9, 9)
    for length in (9, 4, 7):  # each sequence's own causal mask is its top-left corner
        assert torch.equal(longest[0, 0, :length, :length], torch.ones(length, length, dtype=torch.bool).tril())
