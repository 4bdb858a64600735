"""GPU-only checks of roformer_hf: half-precision accuracy against transformers' RoFormer in fp32, the attention
kernels against each other (eager, SDPA, flash-attn's varlen kernel), and torch.compile. Every test skips without
CUDA (flash-attn tests also without flash-attn), so the file collects on CPU machines and CI."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import BENCHMARKS, padded_batch, reference_and_ours

import roformer_hf

sys.path.insert(0, str(BENCHMARKS))
from bench_gpu import flash_attn_importable  # noqa: E402  (the benchmark's check: one definition)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_flash = pytest.mark.skipif(not (torch.cuda.is_available() and flash_attn_importable()),
                                 reason="needs an importable flash-attn on a CUDA device")

SIZE = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}  # 2 layers, vocab 97, max 64 positions
LENGTHS = [64, 50, 33, 7]  # padded to 64, sequences of several lengths
BF16_RELATIVE = 3e-2  # bf16 keeps 8 bits of mantissa: ~4e-3 per rounding, a few roundings deep
BF16_GRADIENTS = 5e-2  # relative L2 error of each parameter's gradient, bf16 against bf16
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A folder holding transformers' tiny RoFormerForMaskedLM, and that model (fp32, on CUDA) as the reference."""
    folder = tmp_path_factory.mktemp("roformer")
    reference, _ = reference_and_ours("RoFormerForMaskedLM", folder, **SIZE)
    return folder, reference.to(DEVICE)


def load(folder, attn: str, dtype: torch.dtype = torch.float32, **config) -> roformer_hf.RoFormerForMaskedLM:
    """The checkpoint as roformer_hf's MLM model on CUDA; sparse prediction (labelled tokens only) in training."""
    config.setdefault("sparse_prediction", True)
    model = roformer_hf.RoFormerForMaskedLM.from_pretrained(folder, attn_implementation=attn, dtype=dtype, **config)
    return model.to(DEVICE).eval()


def device_batch(lengths: list[int] = LENGTHS, labelled_every: int = 3):
    """`(input_ids, attention_mask, labels)` on CUDA; every `labelled_every`-th real token carries a label."""
    ids, mask = padded_batch(lengths, vocab_size=97)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    labels = ids.masked_fill((mask == 0) | (positions % labelled_every != 0), -100)
    return ids.to(DEVICE), mask.to(DEVICE), labels.to(DEVICE)


def logits_at_real_tokens(model, ids, mask) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, attention_mask=mask).logits[mask.bool()].float()  # (N, V)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the largest absolute expected value."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def gradients(model, ids, mask, labels) -> dict[str, torch.Tensor]:
    """Parameter gradients of one training forward (sparse MLM head) and backward, in fp32, by parameter name
    (that of the underlying module for a torch.compile wrapper)."""
    model.train().zero_grad(set_to_none=True)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    model.eval()
    parameters = getattr(model, "_orig_mod", model).named_parameters()
    return {name: p.grad.float() for name, p in parameters if p.grad is not None}


def assert_gradients_close(actual: dict, expected: dict, tolerance: float) -> None:
    """Each parameter's gradient within `tolerance` in relative L2 norm (robust to a few bf16 outliers)."""
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        error = ((actual[name] - grad).norm() / grad.norm().clamp_min(1e-12)).item()
        assert error <= tolerance, f"{name}: relative gradient error {error:.3g} > {tolerance}"


def test_bf16_sdpa_matches_transformers_fp32(checkpoint):
    folder, reference = checkpoint
    ids, mask, _ = device_batch()
    expected = logits_at_real_tokens(reference, ids, mask)
    actual = logits_at_real_tokens(load(folder, "sdpa", torch.bfloat16), ids, mask)
    assert relative_error(actual, expected) <= BF16_RELATIVE


@pytest.mark.parametrize("unpad_inputs", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fully_padded_rows_stay_finite(checkpoint, dtype, attn, unpad_inputs):
    """A row of padding only (softmax over no key, NaN in transformers #31035) leaves outputs, loss and gradients
    finite, and the other rows as they are without it."""
    folder, _ = checkpoint
    model = load(folder, attn, dtype, unpad_inputs=unpad_inputs)
    ids, mask, labels = device_batch([40, 0, 17, 0])
    with torch.inference_mode():
        output = model(ids, attention_mask=mask, output_hidden_states=True)
    assert all(torch.isfinite(t).all() for t in (output.logits, *output.hidden_states))
    alone = logits_at_real_tokens(model, ids[[0, 2]], mask[[0, 2]])
    assert relative_error(output.logits[mask.bool()], alone) <= BF16_RELATIVE
    grads = gradients(model, ids, mask, labels)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("dtype, logits_tolerance, gradients_tolerance",
                         [(torch.float32, 1e-4, 1e-3), (torch.bfloat16, BF16_RELATIVE, BF16_GRADIENTS)],
                         ids=["fp32", "bf16"])
def test_eager_and_sdpa_agree(checkpoint, dtype, logits_tolerance, gradients_tolerance):
    folder, _ = checkpoint
    ids, mask, labels = device_batch()
    eager, sdpa = load(folder, "eager", dtype), load(folder, "sdpa", dtype)
    assert relative_error(logits_at_real_tokens(sdpa, ids, mask),
                          logits_at_real_tokens(eager, ids, mask)) <= logits_tolerance
    assert_gradients_close(gradients(sdpa, ids, mask, labels), gradients(eager, ids, mask, labels),
                           gradients_tolerance)


@needs_flash
@pytest.mark.parametrize("lengths", [LENGTHS, [64] * 4], ids=["padded", "unpadded"])
def test_flash_attention_matches_sdpa(checkpoint, lengths):
    """flash-attn's kernel (varlen on a padded batch, the plain one without padding) against SDPA, both bf16,
    forward and gradients."""
    folder, _ = checkpoint
    ids, mask, labels = device_batch(lengths)
    flash, sdpa = load(folder, "flash_attention_2", torch.bfloat16), load(folder, "sdpa", torch.bfloat16)
    assert relative_error(logits_at_real_tokens(flash, ids, mask),
                          logits_at_real_tokens(sdpa, ids, mask)) <= BF16_RELATIVE
    assert_gradients_close(gradients(flash, ids, mask, labels), gradients(sdpa, ids, mask, labels), BF16_GRADIENTS)


@needs_flash
def test_flash_attention_on_padded_tensors_matches_sdpa(checkpoint):
    folder, _ = checkpoint
    ids, mask, _ = device_batch()
    flash = load(folder, "flash_attention_2", torch.bfloat16, unpad_inputs=False)
    sdpa = load(folder, "sdpa", torch.bfloat16)
    assert relative_error(logits_at_real_tokens(flash, ids, mask),
                          logits_at_real_tokens(sdpa, ids, mask)) <= BF16_RELATIVE


def test_torch_compile_matches_eager_mode(checkpoint):
    """torch.compile of the SDPA model (graph breaks at the data-dependent padding layout are allowed) gives the
    eager-mode logits, loss and gradients on a padded batch."""
    folder, _ = checkpoint
    ids, mask, labels = device_batch()
    model = load(folder, "sdpa")
    compiled = torch.compile(model)
    assert relative_error(logits_at_real_tokens(compiled, ids, mask), logits_at_real_tokens(model, ids, mask)) <= 1e-4
    assert_gradients_close(gradients(compiled, ids, mask, labels), gradients(model, ids, mask, labels), 1e-3)


def test_packed_row_matches_padded_batch(checkpoint):
    """Sequences packed into one row (transformers' DataCollatorWithFlattening: positions restart, offsets given)
    give the padded batch's logits and gradients, bf16 on CUDA's SDPA."""
    folder, _ = checkpoint
    ids, mask, labels = device_batch()
    real = mask.bool()
    lengths = mask.sum(1)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    packed = {"input_ids": ids[real][None], "labels": labels[real][None],
              "position_ids": torch.cat([torch.arange(n, device=DEVICE) for n in lengths.tolist()])[None],
              "cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets,
              "max_length_q": int(lengths.max()), "max_length_k": int(lengths.max())}
    model = load(folder, "sdpa", torch.bfloat16)
    with torch.inference_mode():
        packed_logits = model(**{k: v for k, v in packed.items() if k != "labels"}).logits[0].float()
    assert relative_error(packed_logits, logits_at_real_tokens(model, ids, mask)) <= BF16_RELATIVE

    model.train().zero_grad(set_to_none=True)
    model(**packed).loss.backward()
    from_packed = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
    assert_gradients_close(from_packed, gradients(model, ids, mask, labels), BF16_GRADIENTS)


def test_bf16_autocast_training_matches_fp32(checkpoint):
    """An fp32 model trained under `torch.autocast("cuda", torch.bfloat16)` (what Trainer's `bf16=True` does): its
    loss and gradients are those of fp32 within bf16's error."""
    folder, _ = checkpoint
    ids, mask, labels = device_batch()
    model = load(folder, "sdpa")
    expected = gradients(model, ids, mask, labels)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        actual = gradients(model, ids, mask, labels)
    assert_gradients_close(actual, expected, BF16_GRADIENTS)


def test_attention_dropout_trains_on_cuda(checkpoint):
    """Attention dropout on CUDA (SDPA's own dropout): the loss changes with the seed, repeats with the same seed,
    and the gradients stay finite; in eval mode it is off."""
    folder, _ = checkpoint
    ids, mask, labels = device_batch()
    model = load(folder, "sdpa", torch.bfloat16, attention_probs_dropout_prob=0.5).train()

    def loss(seed: int) -> float:
        torch.manual_seed(seed)
        with torch.no_grad():
            return model(ids, attention_mask=mask, labels=labels).loss.item()

    assert loss(0) == loss(0) != loss(1)
    grads = gradients(load(folder, "sdpa", torch.bfloat16, attention_probs_dropout_prob=0.5), ids, mask, labels)
    assert all(torch.isfinite(g).all() for g in grads.values())
    model.eval()
    assert relative_error(logits_at_real_tokens(model, ids, mask),
                          logits_at_real_tokens(load(folder, "sdpa", torch.bfloat16), ids, mask)) == 0


def test_greedy_generation_with_the_cache_matches_transformers(tmp_path):
    """roformer_hf's causal LM on CUDA generates transformers' tokens (fp32, greedy), with the cache and without."""
    reference, _ = reference_and_ours("RoFormerForCausalLM", tmp_path, is_decoder=True, **SIZE)
    ours = roformer_hf.RoFormerForCausalLM.from_pretrained(tmp_path).to(DEVICE).eval()
    prompts = torch.randint(1, 97, (3, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    expected = reference.to(DEVICE).generate(prompts, **settings)
    assert torch.equal(ours.generate(prompts, **settings), expected)
    assert torch.equal(ours.generate(prompts, use_cache=False, **settings), expected)


def test_causal_lm_on_a_padded_batch_matches_transformers_fp32(tmp_path):
    """A decoder's forward without a cache on a right-padded batch: causal attention on the real tokens alone (the
    nested kernel's `is_causal`), bf16, against transformers' RoFormerForCausalLM in fp32."""
    reference, _ = reference_and_ours("RoFormerForCausalLM", tmp_path, is_decoder=True, **SIZE)
    ours = roformer_hf.RoFormerForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(DEVICE).eval()
    ids, mask, _ = device_batch()
    real = mask.bool()
    with torch.inference_mode():
        expected = reference.to(DEVICE)(ids, attention_mask=mask).logits[real]
        actual = ours(ids, attention_mask=mask, use_cache=False).logits[real]
    assert relative_error(actual, expected) <= BF16_RELATIVE


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients(checkpoint, use_reentrant):
    """Gradient checkpointing (Trainer's `gradient_checkpointing=True`) recomputes each layer in the backward pass,
    through the nested varlen kernel: the gradients are those without it."""
    folder, _ = checkpoint
    ids, mask, labels = device_batch()
    model = load(folder, "sdpa", torch.bfloat16)
    expected = gradients(model, ids, mask, labels)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert_gradients_close(gradients(model, ids, mask, labels), expected, 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16 flash", "fp32 nested"])
def test_cuda_varlen_kernel_matches_the_closed_form(dtype):
    """The CUDA varlen kernel (flash-attention's operator in bf16, nested tensors in fp32) against the closed form
    per sequence in float64, forward and gradients, grouped-query heads, with a sequence without queries."""
    from roformer_hf.attention import cuda_varlen_attention_forward

    class Module(torch.nn.Module):
        is_causal, num_key_value_groups = False, 2

    query_lengths, key_lengths = (2, 0, 3), (4, 3, 5)
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, sum(query_lengths), 64, generator=generator).to(DEVICE, dtype).requires_grad_()
    key, value = (torch.randn(1, 2, sum(key_lengths), 64, generator=generator).to(DEVICE, dtype).requires_grad_()
                  for _ in range(2))
    offsets_q, offsets_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                            for n in (query_lengths, key_lengths))
    output, _ = cuda_varlen_attention_forward(Module().eval(), query, key, value, None, 0.125,
                                              cu_seq_lens_q=offsets_q, cu_seq_lens_k=offsets_k)
    pieces = []
    for q0, q1, k0, k1 in zip(offsets_q, offsets_q[1:], offsets_k, offsets_k[1:]):
        q = query[0, :, q0:q1].double()
        k, v = (t[0, :, k0:k1].double().repeat_interleave(2, dim=0) for t in (key, value))
        pieces.append(((q @ k.transpose(-1, -2) * 0.125).softmax(-1) @ v).transpose(0, 1))
    expected = torch.cat(pieces)[None]
    tolerance = BF16_RELATIVE if dtype == torch.bfloat16 else 1e-5
    assert relative_error(output, expected) <= tolerance
    weights = torch.randn(expected.shape, generator=generator, dtype=torch.float64).to(DEVICE)
    actual = torch.autograd.grad((output.double() * weights).sum(), (query, key, value))
    wanted = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for a, w in zip(actual, wanted):
        assert relative_error(a, w) <= (BF16_GRADIENTS if dtype == torch.bfloat16 else 1e-4)
