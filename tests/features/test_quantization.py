"""Quantized inference: torchao's `quantize_` and transformers' `TorchAoConfig`, PyTorch's legacy `quantize_dynamic`
and roformer_hf's own `quantize_int8`, on every head, for batches on both sides of the MLM head's 512-token chunk;
`Int8Linear` against exact integer arithmetic; and layers that are not plain `nn.Linear` never inspected."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from helpers import padded_batch, tiny_config
from torch import nn
from transformers.activations import ACT2FN

from roformer_hf import few_rows, modeling, quantization
from roformer_hf.cpu import cpu_has
from roformer_hf.fused import FusesPostOps, fused_linear, fused_linears
from roformer_hf.loading import RefusesSaving
from roformer_hf.modeling import HEADS, RoFormerForCausalLM, RoFormerForMaskedLM, RoFormerModel
from roformer_hf.quantization import Int8Linear, int8_kernel_available, quantize_activations, quantize_int8

needs_int8_kernel = pytest.mark.skipif(not int8_kernel_available(), reason="this torch has no oneDNN int8 kernel")

# Real tokens per batch: few and short (the head on the packed tokens at once), below the MLM head's 512-token
# chunk (one sequence at a time), and above it (a sequence in two chunks).
BATCHES = {"short": [9, 4, 7], "below chunk": [200, 120], "above chunk": [600, 300]}
HEAD_CLASSES = [head.model_class for head in HEADS]


def head_outputs(model: nn.Module, lengths: list[int]) -> torch.Tensor:
    """The head's main output at the real tokens only (or per sequence/choice), flattened, in float64."""
    ids, mask = padded_batch(lengths, seed=1)
    multiple_choice = type(model).__name__ == "RoFormerForMultipleChoice"
    with torch.inference_mode():
        if multiple_choice:  # two choices per example
            return model(torch.stack([ids, ids.roll(1, 0)], 1), attention_mask=torch.stack([mask, mask], 1)
                         ).logits.flatten().double()
        output = model(ids, attention_mask=mask)
    real = mask.bool()
    if "start_logits" in output:
        return torch.cat([output.start_logits[real], output.end_logits[real]]).double()
    tensor = output.last_hidden_state if "last_hidden_state" in output else output.logits
    return (tensor if tensor.dim() == 2 else tensor[real]).flatten().double()  # sequence logits: (B, labels)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return nn.functional.cosine_similarity(a, b, dim=0).item()


def fp32_model(cls):
    torch.manual_seed(0)
    return cls(tiny_config(is_decoder=cls is RoFormerForCausalLM)).eval()  # the causal LM needs a decoder config


# ---------------------------------------------------------------------------------------------------- torchao

def torchao_configs():
    quantization = pytest.importorskip("torchao.quantization")
    return {
        "int8 dynamic activations, int8 weights": quantization.Int8DynamicActivationInt8WeightConfig(),
        "int8 weight-only": quantization.Int8WeightOnlyConfig(),
        # torchao 0.18's Int4WeightOnlyConfig has no CPU kernel (its formats need mslk or CUDA); its generic
        # int4 weight-only (intx, dequantize and matmul) runs on CPU.
        "int4 weight-only (intx)": quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                     granularity=quantization.PerGroup(16)),
    }


def int_mm_saturates() -> bool:
    """Whether PyTorch's `torch._int_mm` (torchao's int8 GEMM) gives wrong products here: it takes oneDNN's kernel
    where the CPU has VNNI without asking oneDNN's limit, so with oneDNN held below VNNI (`ONEDNN_MAX_CPU_ISA=AVX2`
    on such a CPU) int16 pair sums saturate. `Int8Linear` follows the limit (`quantization._cpu_has_vnni`)."""
    is_vnni_supported = getattr(torch.cpu, "_is_vnni_supported", lambda: False)
    return is_vnni_supported() and not quantization._cpu_has_vnni()


# int4 with groups of 16 on a 32-wide model errs more than int8.
MIN_COSINE = {"int8 dynamic activations, int8 weights": 0.99, "int8 weight-only": 0.99,
              "int4 weight-only (intx)": 0.97}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config_name", list(MIN_COSINE))
@pytest.mark.parametrize("cls", HEAD_CLASSES, ids=lambda cls: cls.__name__)
def test_torchao_quantized_heads_stay_close_to_fp32(cls, config_name, batch):
    config = torchao_configs()[config_name]  # skips where torchao is not installed
    from torchao.quantization import quantize_

    if config_name == "int8 dynamic activations, int8 weights" and int_mm_saturates():
        pytest.skip("oneDNN held below the CPU's VNNI (ONEDNN_MAX_CPU_ISA): torch._int_mm saturates there")
    model = fp32_model(cls)
    expected = head_outputs(model, BATCHES[batch])
    quantize_(model, config)
    prefix = "roformer." if hasattr(model, "roformer") else ""
    assert type(model.get_submodule(f"{prefix}encoder.layer.0.intermediate.dense").weight) is not nn.Parameter
    actual = head_outputs(model, BATCHES[batch])
    assert cosine(actual, expected) >= MIN_COSINE[config_name]


@pytest.mark.parametrize("config_name", ["int8 dynamic activations, int8 weights", "int8 weight-only"])
def test_torchao_config_in_from_pretrained_round_trips_through_safetensors(tmp_path, config_name):
    """transformers quantizes while loading (`quantization_config=TorchAoConfig(...)`), saves the quantized weights
    as safetensors, and loads them back quantized, giving the same logits."""
    config = torchao_configs()[config_name]
    fp32 = fp32_model(RoFormerForMaskedLM)
    fp32.save_pretrained(tmp_path / "fp32")
    quantized = RoFormerForMaskedLM.from_pretrained(tmp_path / "fp32",
                                                    quantization_config=transformers.TorchAoConfig(config))
    quantized.save_pretrained(tmp_path / "int8")
    assert (tmp_path / "int8" / "model.safetensors").exists()
    reloaded = RoFormerForMaskedLM.from_pretrained(tmp_path / "int8")
    query = reloaded.roformer.encoder.layer[0].attention.self.query.weight
    assert type(query).__name__ == "Int8Tensor"
    lengths = BATCHES["above chunk"]
    expected, actual = head_outputs(quantized, lengths), head_outputs(reloaded, lengths)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert cosine(actual, head_outputs(fp32, lengths)) >= 0.99


# ---------------------------------------------------------------------------------------------------- torch.ao

@pytest.mark.parametrize("cls", HEAD_CLASSES, ids=lambda cls: cls.__name__)
def test_legacy_quantize_dynamic_runs_on_every_head(cls):
    model = fp32_model(cls)
    expected = head_outputs(model, BATCHES["above chunk"])
    with warnings.catch_warnings():  # its deprecation notice
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear})
    prefix = "roformer." if hasattr(quantized, "roformer") else ""
    assert isinstance(quantized.get_submodule(f"{prefix}encoder.layer.0.output.dense"),
                      torch.ao.nn.quantized.dynamic.Linear)
    assert cosine(head_outputs(quantized, BATCHES["above chunk"]), expected) >= 0.99


# ---------------------------------------------------------------------------------------------------- roformer_hf int8

@needs_int8_kernel
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("cls", HEAD_CLASSES, ids=lambda cls: cls.__name__)
def test_quantize_int8_heads_stay_close_to_fp32(cls, batch):
    model = fp32_model(cls)
    expected = head_outputs(model, BATCHES[batch])
    quantize_int8(model)
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert cosine(head_outputs(model, BATCHES[batch]), expected) >= 0.99


@needs_int8_kernel
def test_int8_causal_lm_generates_with_its_cache_close_to_fp32():
    """Generation reuses the cache: each step quantizes one token per row. Every step's logits stay close to what
    the fp32 model gives for the same prefix in one forward without a cache (left-padded prompts)."""
    fp32 = fp32_model(RoFormerForCausalLM)
    int8 = quantize_int8(copy.deepcopy(fp32))
    ids, mask = padded_batch([7, 3, 5], seed=2, left=True)
    with torch.inference_mode():
        generated = int8.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
        full_mask = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], 1)
        reference = fp32(generated.sequences, attention_mask=full_mask, use_cache=False).logits
    assert generated.sequences.shape == (3, ids.shape[1] + 6)
    for step, logits in enumerate(generated.logits):
        position = ids.shape[1] - 1 + step
        assert cosine(logits.flatten().double(), reference[:, position].flatten().double()) >= 0.99, step


@needs_int8_kernel
def test_quantized_model_runs_without_inference_mode():
    """`quantize_int8` leaves the model for inference: a plain call (autograd on) gives the inference-mode logits;
    only an input that itself requires grad is refused (see below)."""
    model = quantize_int8(fp32_model(RoFormerForMaskedLM))
    ids, mask = padded_batch(BATCHES["below chunk"])
    with torch.inference_mode():
        expected = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, rtol=0, atol=0)


# Each of `Int8Linear`'s kernels by the limits that give it every row count: (SMALL_BATCH_ROWS, FEW_ROWS_INT8_ROWS)
KERNEL_LIMITS = {"oneDNN, fused": (0, 0), "fbgemm, few rows": (10 ** 9, 0), "roformer_hf, few rows": (0, 10 ** 9)}


@pytest.fixture(params=list(KERNEL_LIMITS))
def kernel(request, monkeypatch):
    """Each of `Int8Linear`'s paths, whatever the inputs' row count: oneDNN's fused kernel (the many-row path),
    fbgemm's on weights packed once and `few_rows`' int8 kernel (the few-row paths), for layers built under it."""
    small, vnni = KERNEL_LIMITS[request.param]
    monkeypatch.setattr(quantization, "SMALL_BATCH_ROWS", small)
    monkeypatch.setattr(quantization, "FEW_ROWS_INT8_ROWS", vnni)
    if request.param.startswith("fbgemm") and not has_few_row_path():
        pytest.skip("PyTorch has no fbgemm here")
    if request.param.startswith("roformer_hf") and not few_rows.int8_available():
        pytest.skip(f"no few-row int8 kernel here: {few_rows.why_not('int8')}")
    return request.param


def has_few_row_path() -> bool:
    """Whether a layer built under the limits now in force holds fbgemm's packed weights."""
    return int8_kernel_available() and Int8Linear(nn.Linear(8, 4))._packed_small is not None


def exact_product(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the kernel must compute: the integer product of the quantized input and weights in int64 (no
    saturation), rescaled, plus the bias."""
    quantized, scale, zero_point = quantize_activations(x)
    product = (quantized.long() - zero_point) @ layer.weight_int8.long().T  # (rows, out)
    bias = 0 if layer.bias is None else layer.bias.double()
    return product.double() * scale * layer.weight_scale.double() + bias


@needs_int8_kernel
@pytest.mark.parametrize("saturation_safe", [True, False])
def test_int8_linear_computes_the_exact_integer_product(saturation_safe, kernel):
    """Inputs and weights at the ends of their ranges: where the CPU's instructions would saturate int16 pair sums
    (no VNNI), a wrong result. With `saturation_safe` (the default on such CPUs) the product is exact everywhere;
    without it, only on CPUs with VNNI or AMX."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 16)
    with torch.no_grad():
        linear.weight.copy_(torch.randint(0, 2, (16, 64)) * 2.0 - 1)  # +-1: every weight at the end of its range
    x = torch.cat([torch.full((4, 64), 3.0), torch.randn(4, 64)])  # the first rows at the top of the input's range
    layer = Int8Linear(linear, saturation_safe=saturation_safe)
    if not saturation_safe and layer.saturation_safe != Int8Linear(linear).saturation_safe:
        pytest.skip("without VNNI, full-range int8 saturates: what saturation_safe is for")
    with torch.inference_mode():
        actual = layer(x)
    torch.testing.assert_close(actual.double(), exact_product(layer, x), rtol=1e-5, atol=1e-4)
    assert (actual - linear(x)).abs().max() <= 0.05 * linear(x).abs().max()


HELD_BELOW_VNNI = """
import torch
from torch import nn
from roformer_hf.quantization import Int8Linear, quantize_activations
torch.manual_seed(0)
linear = nn.Linear(64, 16)
with torch.no_grad():
    linear.weight.copy_(torch.randint(0, 2, (16, 64)) * 2.0 - 1)
x = torch.cat([torch.full((300, 64), 3.0), torch.randn(300, 64)])  # more rows than SMALL_BATCH_ROWS: oneDNN's kernel
layer = Int8Linear(linear)
with torch.inference_mode():
    actual = layer(x).double()
quantized, scale, zero_point = quantize_activations(x)
product = ((quantized.long() - zero_point) @ layer.weight_int8.long().T).double()
print(layer.saturation_safe, (actual - product * scale * layer.weight_scale.double() - layer.bias).abs().max().item())
"""


@needs_int8_kernel
def test_onednn_held_below_vnni_still_gives_the_exact_product():
    """`ONEDNN_MAX_CPU_ISA=AVX2` makes oneDNN multiply as on a CPU without VNNI, whatever the CPU has (and PyTorch's
    `torch._int_mm`, which asks the CPU, saturates there): the default scales follow oneDNN's limit."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", HELD_BELOW_VNNI], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    saturation_safe, error = result.stdout.split()[-2:]
    assert saturation_safe == "True" and float(error) < 1e-4, result.stdout


@needs_int8_kernel
@pytest.mark.parametrize("in_features", [64, 65, 768])
def test_saturation_safe_weights_keep_8_bits_and_stay_exact_where_neighbours_differ(in_features, kernel):
    """Neighbouring input features ``(2i, 2i + 1)`` share an int16 sum without VNNI. Weights laid out big, small,
    small, big, ... keep every such pair within bounds at 8 bits, while the pairs ``(2i + 1, 2i + 2)`` (big, big)
    would not: if the kernel paired features differently, the product would saturate. Shifted by one, the big
    weights share pairs and get half the steps; of opposite signs, they keep all 8 bits. Random rows lose less than
    a bit; the output is the exact integer product (inputs at 255, the top of uint8, in some rows)."""
    torch.manual_seed(0)
    pattern = torch.tensor([1.0, 0.001, 0.001, 1.0]).repeat(in_features // 4 + 1)[:in_features]
    signs = torch.tensor([1.0, -1.0])[torch.arange(4) % 2, None]  # rows of one sign each, both signs
    alternating = torch.tensor([1.0, -1.0]).repeat(in_features // 2 + 1)[:in_features]  # pairs of both signs
    weight = torch.cat([signs * pattern, signs * pattern.roll(1), signs[:2] * alternating,
                        torch.randn(6, in_features)])
    linear = nn.Linear(in_features, 16)
    with torch.no_grad():
        linear.weight.copy_(weight)
    layer = Int8Linear(linear, saturation_safe=True)
    largest = layer.weight_int8.abs().amax(dim=1)
    assert largest[:4].tolist() == [127] * 4 and largest[4:8].tolist() == [64] * 4
    assert largest[8:10].tolist() == [127] * 2  # a pair of opposite signs cannot saturate: 8 bits
    assert (largest[10:] >= 64).all()  # at least the 7 bits of reduce_range
    pairs = nn.functional.pad(layer.weight_int8.long(), (0, in_features % 2)).view(16, -1, 2)
    assert pairs.clamp(min=0).sum(-1).max() <= 128 and pairs.clamp(max=0).sum(-1).min() >= -128
    x = torch.cat([torch.full((3, in_features), 2.0), torch.randn(5, in_features),
                   -torch.full((2, in_features), 2.0)])  # uint8 255 for the first rows, 0 for the last
    with torch.inference_mode():
        actual = layer(x)
    torch.testing.assert_close(actual.double(), exact_product(layer, x), rtol=1e-5, atol=1e-4)


@needs_int8_kernel
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_saturation_safe_products_stay_exact_however_the_kernel_splits_the_work(threads, kernel):
    """Few rows and outputs with many input features: oneDNN may split the input features across threads, and a
    split at an odd feature would pair ``(2i + 1, 2i + 2)``. Big weights in every position of the pattern, all
    inputs at the top of uint8: the product stays exact."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, in_features, out_features in ((1, 4097, 8), (3, 3071, 4)):
            pattern = torch.tensor([1.0, 0.001, 0.001, 1.0]).repeat(in_features // 4 + 1)[:in_features]
            linear = nn.Linear(in_features, out_features)
            with torch.no_grad():
                linear.weight.copy_(torch.stack([pattern.roll(row) for row in range(out_features)]))
            layer, x = Int8Linear(linear, saturation_safe=True), torch.full((rows, in_features), 2.0)
            with torch.inference_mode():
                actual = layer(x)
            torch.testing.assert_close(actual.double(), exact_product(layer, x), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("contiguous", [True, False])
def test_both_ways_of_quantizing_activations_agree(monkeypatch, contiguous):
    """fbgemm's kernel (while PyTorch keeps its quantized tensors, its bytes seen as uint8) and the composite of plain
    ops that replaces it: the same value to within one quantization step, both within half a step of the input, and
    the input's shape and element order kept (a transposed input too)."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(50, 16) * 3, torch.rand(50, 16)])
    x = x if contiguous else x.t()

    def dequantized():
        quantized, scale, zero_point = quantize_activations(x)
        assert quantized.dtype == torch.uint8 and quantized.shape == x.shape
        return (quantized.float() - zero_point) * scale, scale

    kernel, scale = dequantized()
    monkeypatch.delattr(torch, "quantize_per_tensor")
    composite, _ = dequantized()
    assert (kernel - composite).abs().max() <= scale * 1.001
    for value in (kernel, composite):
        assert (value - x).abs().max() <= scale * 0.501


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused_by_name(value):
    x = torch.randn(4, 8)
    x[1, 2] = value
    with pytest.raises(ValueError, match="non-finite"):
        quantize_activations(x)


@needs_int8_kernel
@pytest.mark.parametrize("case", ["gelu", "relu", "residual"])
def test_int8_linear_applies_the_activation_or_residual_as_fused_linear_asks(case, kernel):
    torch.manual_seed(0)
    layer, x = Int8Linear(nn.Linear(32, 24)), torch.randn(2, 5, 32)
    activation = None if case == "residual" else ACT2FN[case]
    residual = torch.randn(2, 5, 24) if case == "residual" else None
    with torch.inference_mode():
        actual = fused_linear(layer, x, activation, residual)
        plain = layer(x)
    expected = plain + residual if case == "residual" else activation(plain)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@needs_int8_kernel
def test_int8_linear_declares_the_protocols_the_model_reads(monkeypatch):
    """`fused_linear` hands it the activation (`FusesPostOps`); `save_pretrained` refuses it (`RefusesSaving`)."""
    layer, calls, fused = Int8Linear(nn.Linear(8, 4)), [], Int8Linear.fused
    assert isinstance(layer, FusesPostOps) and isinstance(layer, RefusesSaving)

    def spy(self, x, *post_ops):
        calls.append(post_ops)
        return fused(self, x, *post_ops)

    monkeypatch.setattr(Int8Linear, "fused", spy)
    with torch.inference_mode():
        fused_linear(layer, torch.randn(3, 8), ACT2FN["gelu"])
    assert calls == [("gelu", "none", None)]


@needs_int8_kernel
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_the_kernels_compute_the_same_product_and_the_layer_picks_by_row_count(rows, monkeypatch):
    """fbgemm on weights packed once, `few_rows`' int8 kernel and oneDNN's fused kernel: the same numbers for the same
    inputs (exact integer products of the same quantized inputs), with GELU and the residual applied alike; and a
    call takes `few_rows`' kernel up to `FEW_ROWS_INT8_ROWS` rows, fbgemm's below `SMALL_BATCH_ROWS` past those, oneDNN's
    beyond."""
    torch.manual_seed(0)
    with monkeypatch.context() as patch:  # every kernel's packed weights, whatever this CPU's limits
        patch.setattr(quantization, "SMALL_BATCH_ROWS", 10 ** 9)
        patch.setattr(quantization, "FEW_ROWS_INT8_ROWS", 10 ** 9)
        layer = Int8Linear(nn.Linear(48, 40))
    x, residual = torch.randn(rows, 48) * 2, torch.randn(rows, 40)
    outputs = {}
    for name, (small, vnni) in KERNEL_LIMITS.items():
        if (name.startswith("fbgemm") and layer._packed_small is None) or (
                name.startswith("roformer_hf") and layer._packed_few_rows is None):
            continue
        with monkeypatch.context() as patch, torch.inference_mode():
            patch.setattr(quantization, "SMALL_BATCH_ROWS", small)
            patch.setattr(quantization, "FEW_ROWS_INT8_ROWS", vnni)
            outputs[name] = [layer(x), layer.fused(x, "gelu", "none"), layer.fused(x, residual=residual)]
    for name, kernel_outputs in outputs.items():
        for actual, onednn in zip(kernel_outputs, outputs["oneDNN, fused"]):
            torch.testing.assert_close(actual, onednn, rtol=1e-5, atol=1e-5, msg=name)
    calls = []
    monkeypatch.setattr(Int8Linear, "_few_rows", lambda self, *args: calls.append("fbgemm") or torch.zeros(rows, 40))
    monkeypatch.setattr(Int8Linear, "_few_rows_call",
                        lambda self, activation: lambda *args: calls.append("VNNI") or torch.zeros(rows, 40))
    with torch.inference_mode():
        layer(x)
    vnni = rows <= quantization.FEW_ROWS_INT8_ROWS and layer._packed_few_rows is not None
    fbgemm = not vnni and rows < quantization.SMALL_BATCH_ROWS and layer._packed_small is not None
    assert calls == ["VNNI"] * vnni + ["fbgemm"] * fbgemm


def test_the_few_row_int8_kernel_leaves_fbgemm_nothing_to_pack(monkeypatch):
    """Where `few_rows`' int8 kernel takes every row count below fbgemm's limit, fbgemm's copy of the weights is not
    made; where it does not run, fbgemm's kernel keeps its rows."""
    if not (int8_kernel_available() and few_rows.int8_available()):
        pytest.skip("no oneDNN int8 kernel or no few-row int8 kernel here")
    monkeypatch.setattr(quantization, "SMALL_BATCH_ROWS", 16)
    monkeypatch.setattr(quantization, "FEW_ROWS_INT8_ROWS", 64)
    layer = Int8Linear(nn.Linear(8, 4))
    assert layer._packed_few_rows is not None and layer._packed_small is None
    monkeypatch.setattr(quantization, "FEW_ROWS_INT8_ROWS", 0)
    without_vnni = Int8Linear(nn.Linear(8, 4))
    assert without_vnni._packed_few_rows is None
    assert (without_vnni._packed_small is not None) == ("fbgemm" in torch.backends.quantized.supported_engines)


@needs_int8_kernel
@pytest.mark.parametrize("magnitude", [1e-3, 1e-4, 1e-7])
def test_inputs_too_small_for_fbgemms_scales_are_still_exact(magnitude, kernel):
    """fbgemm never uses a scale below 6.1e-5: on inputs spanning less than 255 of them it would quantize otherwise
    (13 steps off at 1e-3, everything at 1e-7). Such calls stay on oneDNN's path, exact on either."""
    torch.manual_seed(0)
    layer, x = Int8Linear(nn.Linear(64, 16, bias=False)), torch.randn(4, 64) * magnitude
    with torch.inference_mode():
        actual = layer(x)
    expected = exact_product(layer, x)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


@needs_int8_kernel
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_layers_on_one_input_give_the_bits_of_each_alone(rows, kernel):
    """Attention's query, key and value layers run as one (`Int8Linear.fused_side_by_side`): the input quantized
    once, one kernel call, each output channel computed as its own layer computes it. oneDNN's kernel on a CPU with
    AMX rounds a few rows' rescaling by the layers' width (a unit in the last place at 7 and 16 rows, none from 31 on;
    `few_rows`' kernel takes those rows there), so that kernel's few rows are held to that much there."""
    torch.manual_seed(rows)
    layers = tuple(Int8Linear(nn.Linear(32, out)) for out in (32, 16, 16))
    x = torch.randn(rows, 32)
    last_place = kernel == "oneDNN, fused" and rows < 32 and cpu_has("amx_int8")
    with torch.inference_mode():
        together = fused_linears(layers, x)
        for output, layer in zip(together, layers):
            torch.testing.assert_close(output, layer(x), rtol=0, atol=2.5e-7 if last_place else 0)
        assert quantization._SIDE_BY_SIDE[layers[0]][1].out_features == 64
        unjoinable = (layers[0], Int8Linear(nn.Linear(32, 16, bias=False)))  # bias on one only: each alone
        assert all(torch.equal(output, layer(x)) for output, layer in zip(fused_linears(unjoinable, x), unjoinable))
    layers[1].load_state_dict(Int8Linear(nn.Linear(32, 16)).state_dict())
    with torch.inference_mode(), pytest.raises(RuntimeError, match="changed after they were packed"):
        fused_linears(layers, x)


def per_call(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's output with every dense call checking for itself (no checks at the forward's start)."""
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(modeling, "one_forward", lambda *args: contextlib.nullcontext())
        return model(ids).last_hidden_state


@needs_int8_kernel
@pytest.mark.parametrize("change", [None, "a hook on a layer", "a layer replaced", "the key layer replaced",
                                    "buffers loaded"])
def test_an_int8_models_calls_are_checked_at_the_forwards_start_and_changes_are_followed(change, kernel):
    """From its second forward on, a quantized model checks its layers once, at the forward's start
    (`fused.one_forward`), and no call checks again; whatever changed since (hooks, layers, loaded buffers) is seen:
    the forward computes what the layers compute now, or refuses stale packed weights, as each call would."""
    torch.manual_seed(0)
    model = quantize_int8(RoFormerModel(tiny_config()).eval())
    ids = torch.randint(5, 90, (2, 9))
    with torch.inference_mode():
        first = model(ids).last_hidden_state
    layer, seen = model.encoder.layer[0], []
    if change == "a hook on a layer":
        layer.output.dense.register_forward_hook(lambda *args: seen.append("hooked"))
    elif change == "a layer replaced":
        layer.intermediate.dense = Int8Linear(nn.Linear(*layer.intermediate.dense.weight_int8.shape[::-1]))
    elif change == "the key layer replaced":
        layer.attention.self.key = Int8Linear(nn.Linear(*layer.attention.self.key.weight_int8.shape[::-1]))
    elif change == "buffers loaded":
        dense = layer.attention.output.dense
        dense.load_state_dict(Int8Linear(nn.Linear(*dense.weight_int8.shape[::-1])).state_dict())
        with torch.inference_mode(), pytest.raises(RuntimeError, match="changed after they were packed"):
            model(ids)
        return
    checked_calls = []
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():  # the kernel's patch stays
        patch.setattr(Int8Linear, "_check_packed", lambda self: checked_calls.append(self) or self._packed_from)
        second = model(ids).last_hidden_state
    if change is None:
        assert torch.equal(second, first) and not checked_calls  # every call was checked at the start
    assert seen == (["hooked"] if change == "a hook on a layer" else [])
    assert torch.equal(second, per_call(model, ids))


@needs_int8_kernel
def test_changed_buffers_are_refused_rather_than_run_on_stale_packed_weights():
    """The kernels run on copies packed at construction: after `load_state_dict`, `.to(dtype)` or an in-place edit
    they would silently use the old weights, so the layer stops with the reason."""
    layer, x = Int8Linear(nn.Linear(8, 4)), torch.randn(3, 8)
    other = Int8Linear(nn.Linear(8, 4))
    layer.load_state_dict(other.state_dict())
    with torch.inference_mode(), pytest.raises(RuntimeError, match="changed after they were packed"):
        layer(x)
    layer = Int8Linear(nn.Linear(8, 4)).to(torch.bfloat16)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="quantize the fp32 model again"):
        layer(x)


@needs_int8_kernel
def test_an_unknown_post_op_is_refused_on_both_paths(kernel):
    layer = Int8Linear(nn.Linear(8, 4))
    with torch.inference_mode(), pytest.raises(ValueError, match="activation='swish'"):
        layer.fused(torch.randn(3, 8), "swish", "")


@needs_int8_kernel
def test_a_non_finite_input_is_refused_on_both_paths(kernel):
    layer, x = Int8Linear(nn.Linear(8, 4)), torch.randn(3, 8)
    x[2, 5] = float("nan")
    with torch.inference_mode(), pytest.raises(ValueError, match="non-finite"):
        layer(x)


@needs_int8_kernel
def test_int8_linear_refuses_training_and_takes_empty_inputs(kernel):
    layer = Int8Linear(nn.Linear(8, 4))
    with pytest.raises(RuntimeError, match="inference"):
        layer(torch.randn(3, 8, requires_grad=True))
    with torch.inference_mode():
        assert layer(torch.randn(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="8 features"):
        layer(torch.randn(3, 5))


# ------------------------------------------------------------------------------------------------- third-party layers

class Opaque(nn.Module):
    """A third-party dense layer: it can be called, and nothing else may be assumed (`weight` raises)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.inner = linear

    @property
    def weight(self):
        raise AssertionError("a layer that is not a plain nn.Linear was inspected")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("case", ["gelu", "residual"])
def test_fused_linear_only_calls_a_layer_that_is_not_a_plain_linear(case):
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 6), torch.randn(5, 8)
    activation = ACT2FN["gelu"] if case == "gelu" else None
    residual = torch.randn(5, 6) if case == "residual" else None
    with torch.inference_mode():
        actual = fused_linear(Opaque(linear), x, activation, residual)
        expected = linear(x)
    expected = activation(expected) if activation else expected + residual
    torch.testing.assert_close(actual, expected)


def test_mlm_head_is_never_called_on_an_empty_tensor():
    model = fp32_model(RoFormerForMaskedLM)
    reference = copy.deepcopy(model)
    calls = []
    model.cls.predictions.register_forward_pre_hook(lambda module, inputs: calls.append(inputs[0].shape[0]))
    for lengths in BATCHES.values():
        torch.testing.assert_close(head_outputs(model, lengths), head_outputs(reference, lengths))
    assert calls and min(calls) > 0
    assert 512 in calls  # the above-chunk batch ran in 512-token chunks


@needs_int8_kernel
def test_module_docstring_example_runs():
    import doctest
    import re

    import roformer_hf.quantization

    blocks = re.findall(r"```python\n(.*?)```", roformer_hf.quantization.__doc__, flags=re.DOTALL)
    test = doctest.DocTestParser().get_doctest("".join(blocks), {}, "roformer_hf.quantization", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert blocks and runner.summarize(verbose=False).failed == 0


@needs_int8_kernel
def test_saving_an_int8_model_is_refused_saying_what_to_do(tmp_path):
    torch.manual_seed(0)
    model = quantize_int8(RoFormerForCausalLM(tiny_config(is_decoder=True)).eval())
    with pytest.raises(ValueError, match=r"save_pretrained.*Int8Linear.*Save the model before quantizing it and call "
                                         r"quantize_int8 after loading it.*TorchAoConfig"):
        model.save_pretrained(tmp_path / "int8")
    assert not (tmp_path / "int8").exists()  # nothing half-written that would load as random weights
    with pytest.raises(ValueError, match="Int8Linear"):
        model.push_to_hub("user/int8-model")  # refused before anything is uploaded


# `static_int8`: torchao's static PT2E quantization, for a compiled graph.


def test_static_int8_quantizes_every_dense_layer_and_stays_near_fp32():
    pytest.importorskip("torchao", reason="static_int8 quantizes with torchao")
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config(unpad_inputs=False)).eval()
    dims = {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("length", max=128)}
    calibration = []
    for lengths in ([9, 4, 7], [12, 12], [5, 16, 3, 8]):
        ids, mask = padded_batch(lengths, seed=len(lengths))
        calibration.append({"input_ids": ids, "attention_mask": mask})
    quantized = quantization.static_int8(model, calibration, {"input_ids": dims, "attention_mask": dims})
    targets = [str(node.target) for node in quantized.graph.nodes]
    linears = sum(type(module) is nn.Linear for module in model.modules())
    assert sum(t == "quantized_decomposed.dequantize_per_channel.default" for t in targets) == linears
    assert sum(t == "quantized_decomposed.quantize_per_tensor.default" for t in targets) >= 4 * len(model.encoder.layer)
    ids, mask = padded_batch([11, 6], seed=7)  # a batch calibration did not see, another shape
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = quantized(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    cosine = torch.cosine_similarity(got[real], want[real], dim=-1)
    assert cosine.min() > 0.99 and not torch.allclose(got, want, atol=1e-5)  # int8: near fp32, not equal to it


def test_static_int8_refuses_what_cannot_calibrate(monkeypatch):
    model = RoFormerModel(tiny_config(unpad_inputs=False))
    ids = torch.tensor([[2, 5, 3]])
    with pytest.raises(ValueError, match="calibration is empty; expected at least one input"):
        quantization.static_int8(model.eval(), [])
    with pytest.raises(ValueError, match=r"training mode; expected module.eval\(\)"):
        quantization.static_int8(model.train(), [{"input_ids": ids}])
    monkeypatch.setitem(sys.modules, "torchao.quantization.pt2e.quantize_pt2e", None)  # as if not installed
    with pytest.raises(ImportError, match=r"torchao's PT2E flow, which did not import \(.*\): pip install "
                                          r"roformer_hf\[quantization\]"):
        quantization.static_int8(model.eval(), [{"input_ids": ids}])


@pytest.mark.parametrize(("vnni", "vendor", "family", "expected"), [
    (False, "AuthenticAMD", 25, 256), (False, "GenuineIntel", 6, 256), (True, "GenuineIntel", 6, 32),
    (True, "AuthenticAMD", 25, 16), (True, "AuthenticAMD", 26, 16), (True, "", 0, 0)])
def test_the_few_row_limit_follows_the_cpu_kind_it_was_measured_on(monkeypatch, vnni, vendor, family, expected):
    """Below the limit `Int8Linear` takes fbgemm's kernel: every row count without VNNI's int32 sums, and on CPUs
    with VNNI as far as fbgemm measured faster on each kind (none on a CPU of unknown vendor, unmeasured there)."""
    monkeypatch.setattr(quantization, "_cpu_has_vnni", lambda: vnni)
    monkeypatch.setattr(quantization, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(quantization, "cpu_family", lambda: family)
    assert quantization.few_row_limit() == expected


@pytest.mark.parametrize(("isa", "vendor", "family", "amx", "expected"), [
    ("AVX2", "AuthenticAMD", 25, False, 640), ("AVX2", "GenuineIntel", 6, False, 0),
    ("VNNI", "GenuineIntel", 6, False, 0), ("VNNI", "GenuineIntel", 6, "vnni build", 32),
    ("VNNI", "GenuineIntel", 6, "tiles build", 128), ("VNNI", "AuthenticAMD", 25, False, 256),
    ("VNNI", "AuthenticAMD", 26, False, 128), ("VNNI", "", 0, False, 0)])
def test_the_few_row_int8_kernels_rows_follow_the_cpu_kind_it_was_measured_on(monkeypatch, isa, vendor, family, amx,
                                                                              expected):
    """`few_rows`' int8 kernel takes the calls of up to `few_rows_int8_limit` rows where it was measured faster (its
    VNNI build on a Zen 4, a Zen 5 and an Intel Xeon with AMX, there further where it runs on AMX's tiles; its AVX2
    build on an AVX2 EPYC), none where it was not measured."""
    monkeypatch.setattr(few_rows, "int8_isa", lambda: isa)
    monkeypatch.setattr(few_rows, "amx_build_first", lambda kernel: amx == "tiles build")
    monkeypatch.setattr(quantization, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(quantization, "cpu_family", lambda: family)
    monkeypatch.setattr(quantization, "cpu_has", lambda *flags: amx and set(flags) <= {"amx_bf16", "amx_int8"})
    assert quantization.few_rows_int8_limit() == expected
