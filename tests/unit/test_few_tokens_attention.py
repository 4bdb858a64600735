"""`few_rows.attention`: a short input's self-attention in one call, rotation included, against the closed-form
rotation and softmax in float64; and the forwards that take it (`plan.few_token_attention`) against those that do
not."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
from helpers import padded_batch, reference_and_ours, rotary_cos_sin, rotate_pairs, tiny_config
from transformers.modeling_utils import AttentionInterface

from roformer_hf import RoFormerForCausalLM, RoFormerModel, few_rows, plan
from roformer_hf.plan import ForwardPlan
from roformer_hf.rotary import inverse_frequencies, rotary_phases

needs_kernel = pytest.mark.skipif(not few_rows.attention_available(),
                                  reason=f"no few-token attention here: {few_rows.why_not('attention')}")


def closed_form(query, key, value, positions, lengths, heads, scaling, layout, rotate_value):
    """Each sequence's attention in float64: pairs turned by the closed-form angles, softmax over every key."""
    d = query.shape[-1] // heads
    cos, sin = (t.double() for t in rotary_cos_sin(positions, d, layout=layout))  # (N, d)

    def turned(x):  # (N, n, d)
        return x * cos[:, None] + rotate_pairs(x, layout) * sin[:, None]
    q = turned(query.double().unflatten(-1, (heads, d)))
    k = turned(key.double().unflatten(-1, (-1, d)))
    v = value.double().unflatten(-1, (-1, d))
    v = turned(v) if rotate_value else v
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    outputs = []
    for start, n in zip(itertools.accumulate([0, *lengths]), lengths):
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # (heads, n, d)
        weights = (qs @ ks.transpose(1, 2) * scaling).softmax(-1)
        outputs.append((weights @ vs).transpose(0, 1).flatten(-2))
    return torch.cat(outputs) if outputs else query.new_zeros(0, query.shape[-1], dtype=torch.float64)


def random_case(seed: int, dtype: torch.dtype):
    rng = random.Random(seed)
    layout = rng.choice(["interleaved", "half"])
    d = rng.choice([32, 64, 128] if layout == "half" else [16, 32, 64, 128])
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 2, 4])
    lengths = [rng.choice([0, 1, 2, 15, 16, 17, 31, 33, 48, 70]) for _ in range(rng.randint(1, 4))]
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    projected = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=generator).to(dtype)  # one projection
    query, key, value = projected.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # strided views of it
    starts = torch.randint(0, 3000, (len(lengths),), generator=generator)
    positions = torch.cat([start + torch.arange(n) for start, n in zip(starts.tolist(), lengths)]).long()
    return query, key, value, positions, lengths, heads, layout, rng.random() < 0.3, d ** -0.5 * rng.uniform(0.5, 2)


@needs_kernel
@pytest.mark.parametrize("seed", range(24))
def test_the_attention_is_the_closed_form_in_float64(seed):
    query, key, value, positions, lengths, heads, layout, rotate_value, scaling = random_case(seed, torch.float32)
    d = query.shape[-1] // heads
    phases = rotary_phases(positions, inverse_frequencies(d))
    with torch.inference_mode():
        ours = few_rows.attention(query, key, value, phases, lengths, heads, scaling, layout, rotate_value)
    expected = closed_form(query, key, value, positions, lengths, heads, scaling, layout, rotate_value)
    assert ours.shape == query.shape and ours.dtype == torch.float32 and ours.is_contiguous()
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("seed", range(8))
def test_in_bf16_it_is_the_float64_result_rounded_once(seed):
    query, key, value, positions, lengths, heads, layout, rotate_value, scaling = random_case(seed, torch.bfloat16)
    d = query.shape[-1] // heads
    ours = few_rows.attention(query, key, value, rotary_phases(positions, inverse_frequencies(d)), lengths, heads,
                              scaling, layout, rotate_value)
    expected = closed_form(query, key, value, positions, lengths, heads, scaling, layout, rotate_value)
    assert ours.dtype == torch.bfloat16
    # within one bf16 step of the exact value (half a step from rounding, the rest float32's sums)
    assert ((ours.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()


@pytest.mark.skipif(few_rows.isa() != "AVX-512", reason="no AVX-512 here: the kernel's one build is AVX2's")
def test_the_avx2_build_is_the_closed_form_too(monkeypatch, tmp_path):
    """With oneDNN held below AVX-512 the kernel is built for AVX2 (8 floats a vector, as on a CPU without AVX-512):
    on both builds, every layout of the head against the closed form, in float32 and in bf16."""
    monkeypatch.setattr(few_rows, "_state", {})
    monkeypatch.setenv("ROFORMER_HF_CACHE", str(tmp_path))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert few_rows.isa() == "AVX2" and few_rows.attention_available()
    assert few_rows._library("attention").few_token_lanes() == 8
    for seed in range(12):
        dtype = torch.bfloat16 if seed % 3 == 2 else torch.float32
        query, key, value, positions, lengths, heads, layout, rotate_value, scaling = random_case(seed, dtype)
        d = query.shape[-1] // heads
        ours = few_rows.attention(query, key, value, rotary_phases(positions, inverse_frequencies(d)), lengths, heads,
                                  scaling, layout, rotate_value)
        expected = closed_form(query, key, value, positions, lengths, heads, scaling, layout, rotate_value)
        if dtype == torch.float32:
            torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=2e-6)
        else:
            assert ((ours.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()


@needs_kernel
def test_large_scores_stay_finite_and_exact():
    query, key, value, positions, lengths, heads, layout, rotate_value, scaling = random_case(3, torch.float32)
    query, key = query * 30, key * 30  # scores in the thousands: exp overflows without the max subtracted
    d = query.shape[-1] // heads
    ours = few_rows.attention(query, key, value, rotary_phases(positions, inverse_frequencies(d)), lengths, heads,
                              scaling, layout, rotate_value)
    expected = closed_form(query, key, value, positions, lengths, heads, scaling, layout, rotate_value)
    assert ours.isfinite().all()
    # float32 scores in the thousands are off by ~1e-4 before the exp (as SDPA's would be)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-3, atol=1e-3)


@needs_kernel
def test_layouts_of_the_tokens_and_the_threads_do_not_change_the_bits():
    query, key, value, positions, lengths, heads, layout, rotate_value, scaling = random_case(5, torch.float32)
    lengths = [24, 24]
    projected = torch.randn(48, query.shape[-1] + 2 * key.shape[-1])
    query, key, value = projected.split([query.shape[-1], key.shape[-1], key.shape[-1]], dim=-1)
    phases = rotary_phases(torch.arange(24).repeat(2), inverse_frequencies(query.shape[-1] // heads))
    arguments = (heads, scaling, layout, rotate_value)
    flat = few_rows.attention(query, key, value, phases, lengths, *arguments)
    copies = few_rows.attention(query.contiguous(), key.contiguous(), value.contiguous(), phases, lengths, *arguments)
    batched = few_rows.attention(*(t.unflatten(0, (2, 24)) for t in (query, key, value)), phases.view(2, 24, 1, -1, 2),
                                 lengths, *arguments)
    transposed = projected.t().contiguous().t()  # tokens not a fixed stride apart in memory: read from a copy
    columns = transposed.split([query.shape[-1], key.shape[-1], key.shape[-1]], dim=-1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = few_rows.attention(*columns, phases, lengths, *arguments)
    finally:
        torch.set_num_threads(threads)
    assert batched.shape == (2, 24, query.shape[-1])
    for other in (copies, batched.flatten(0, 1), alone):
        assert torch.equal(flat, other)


@needs_kernel
def test_wrong_inputs_are_named():
    query, key, value = torch.randn(5, 64), torch.randn(5, 32), torch.randn(5, 32)
    phases = rotary_phases(torch.arange(5), inverse_frequencies(32))
    with pytest.raises(ValueError, match="multiple of 16"):
        few_rows.attention(torch.randn(5, 48), torch.randn(5, 24), torch.randn(5, 24), None, [5], 2, 1.0)
    with pytest.raises(ValueError, match="multiple of 32"):
        few_rows.attention(torch.randn(5, 32), key[:, :16], value[:, :16], None, [5], 2, 1.0, "half")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        few_rows.attention(query.double(), key.double(), value.double(), phases, [5], 2, 1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        few_rows.attention(query, key.bfloat16(), value, phases, [5], 2, 1.0)
    with pytest.raises(ValueError, match="the 6 tokens"):
        few_rows.attention(query, key, value, phases, [2, 4], 2, 1.0)
    with pytest.raises(ValueError, match="phases must be float32"):
        few_rows.attention(query, key, value, phases[:4], [5], 2, 1.0)
    with pytest.raises(ValueError, match="lengths must be whole numbers"):
        few_rows.attention(query, key, value, phases, [6, -1], 2, 1.0)
    with pytest.raises(ValueError, match="layout='rotated'"):
        few_rows.attention(query, key, value, phases, [5], 2, 1.0, "rotated")
    with pytest.raises(RuntimeError, match="no backward"):
        few_rows.attention(query.requires_grad_(), key, value, phases, [5], 2, 1.0)


# The model's forwards: where the plan binds the kernel, and what it gives against SDPA's path.


@pytest.fixture
def counted(monkeypatch):
    """The number of the kernel's calls, however a forward binds it."""
    calls, bind = [], few_rows.bind_attention

    def counting(lengths):
        run = bind(lengths)

        def counted_run(*args):
            calls.append(1)
            return run(*args)
        return counted_run
    monkeypatch.setattr(few_rows, "bind_attention", counting)
    return calls


def without_it(monkeypatch):
    monkeypatch.setattr(plan, "FEW_TOKENS_LONGEST", -1)


def sharpened(model):
    """The queries' and keys' weights scaled up, in place: scores of several units, as a trained model's, rather than
    the near-uniform weights of a fresh one, which hide a wrong scaling or rotation."""
    for name, parameter in model.named_parameters():
        if name.endswith(("self.query.weight", "self.key.weight")):
            parameter.mul_(6)


@needs_kernel
@pytest.mark.parametrize("seed", range(12))
def test_a_models_forward_with_it_agrees_with_sdpas_path(seed, counted, monkeypatch):
    rng = random.Random(seed)
    layout = rng.choice(["interleaved", "half"])
    kv_heads = rng.choice([1, 2])
    config = tiny_config(hidden_size=128, num_attention_heads=4, num_key_value_heads=kv_heads, rotary_layout=layout,
                         rotary_value=rng.random() < 0.3, norm_position=rng.choice(["post", "pre"]),
                         unpad_inputs=rng.random() < 0.8)
    model = RoFormerModel(config).eval()
    with torch.no_grad():
        sharpened(model)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    model = model.to(dtype)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
    ids, mask = padded_batch(lengths, seed=seed, left=rng.random() < 0.5)
    if rng.random() < 0.3:
        mask = None  # no mask: every token of every row is real
    with torch.inference_mode():
        ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with monkeypatch.context() as patch:
            without_it(patch)
            calls = len(counted)
            reference = model(input_ids=ids, attention_mask=mask).last_hidden_state
            assert len(counted) == calls
    masked_without_unpadding = mask is not None and not config.unpad_inputs  # the keys' mask kept: SDPA's
    assert len(counted) == (0 if masked_without_unpadding else config.num_hidden_layers)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    tolerance = {"rtol": 1.6e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 2e-5}
    torch.testing.assert_close(ours[real].float(), reference[real].float(), **tolerance)


@needs_kernel
@pytest.mark.parametrize("variant", [{}, {"rotary_value": True}, {"embedding_size": 24}])
@pytest.mark.parametrize("head", ["RoFormerModel", "RoFormerForMaskedLM"])
def test_with_it_the_outputs_are_transformers_roformers(tmp_path, head, variant, counted):
    """Against an independent implementation: transformers' RoFormer on the same weights, with heads of 16 (which the
    kernel takes), a padded batch and one sentence alone."""
    reference, ours = reference_and_ours(head, tmp_path, hidden_size=64, **variant)
    ids, mask = padded_batch([20, 13, 7, 1])
    with torch.no_grad():
        for model in (reference, ours):
            sharpened(model)
        for batch, batch_mask in ((ids, mask), (ids[:1], mask[:1])):
            expected, actual = reference(batch, attention_mask=batch_mask)[0], ours(batch, attention_mask=batch_mask)[0]
            assert (actual - expected).abs()[batch_mask.bool()].max() < 1e-5
    assert len(counted) == 2 * ours.config.num_hidden_layers


def replaced_sdpa(module, query, key, value, attention_mask, **kwargs):
    raise AssertionError("not called in these tests")


@needs_kernel
@pytest.mark.parametrize("case", ["grad enabled", "attention dropout in training", "weights returned", "eager",
                                  "causal decoder", "sdpa replaced", "longer than its limit", "autocast"])
def test_forwards_it_cannot_serve_keep_sdpas_path(case, counted, monkeypatch):
    config = tiny_config(hidden_size=128, num_attention_heads=4,
                         attention_probs_dropout_prob=0.1 if "dropout" in case else 0.0,
                         attn_implementation="eager" if case == "eager" else "sdpa")
    model = (RoFormerForCausalLM(tiny_config(hidden_size=128, num_attention_heads=4, is_decoder=True))
             if case == "causal decoder" else RoFormerModel(config))
    model.train("dropout" in case)
    ids, mask = padded_batch([12, 9])
    if case == "longer than its limit":
        monkeypatch.setattr(plan, "FEW_TOKENS_LONGEST", 11)
    if case == "sdpa replaced":
        with torch.inference_mode():
            assert ForwardPlan.build(model.config, ids, mask, dtype=torch.float32).attention_mask.few_tokens
            monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", replaced_sdpa)
            assert ForwardPlan.build(model.config, ids, mask, dtype=torch.float32).attention_mask.few_tokens is None
        return
    grad = case in ("grad enabled", "attention dropout in training")
    with torch.inference_mode(not grad), torch.autocast("cpu", torch.bfloat16, enabled=case == "autocast"):
        model(input_ids=ids, attention_mask=mask, output_attentions=case == "weights returned")
    assert not counted


@needs_kernel
def test_it_is_bound_once_for_every_layer(counted, monkeypatch):
    binds = []
    bind = few_rows.bind_attention
    monkeypatch.setattr(few_rows, "bind_attention", lambda lengths: binds.append(tuple(lengths)) or bind(lengths))
    model = RoFormerModel(tiny_config(hidden_size=64, num_hidden_layers=3)).eval()
    ids, mask = padded_batch([7, 3, 5])
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids[:1, :7])  # one row, no mask: the dense layout
    assert binds == [(7, 3, 5), (7,)]


@needs_kernel
def test_inputs_on_another_device_keep_their_kernel():
    config = RoFormerModel(tiny_config(hidden_size=64)).config
    with torch.inference_mode():
        mask = ForwardPlan.build(config, torch.randint(1, 97, (1, 7)), dtype=torch.float32).attention_mask
        assert mask.few_tokens is not None  # on CPU
        # the same mask for an accelerator's inputs (SDPA on a dense layout there too): not this CPU kernel
        elsewhere = torch.empty(1, 7, dtype=torch.long, device="meta")
        assert plan.few_token_attention(config, replace(mask, few_tokens=None), elsewhere, torch.float32, False,
                                        None).few_tokens is None
