"""int8 inference on CPU: every dense layer's GEMM in oneDNN's int8 kernel, activations quantized on the fly.

`quantize_int8(model)` replaces each `nn.Linear` of a model by an `Int8Linear`: int8 weights with one scale per
output channel (symmetric), and activations quantized to uint8 at every call with one scale and zero point for the
whole input (asymmetric, from its min and max), as ONNX Runtime's and PyTorch's dynamic quantization do. The GEMM
runs in `torch.ops.onednn.qlinear_pointwise` (what torch.compile's x86 backend emits for int8 linear layers) with
fp32 output, the bias, and the layer's GELU/ReLU or residual add applied before the result is stored
(`fused.fused_linear`). Padding stays skipped: the layers see the batch's real tokens only.

Calls with fewer than `SMALL_BATCH_ROWS` rows (a generation step, a short request) take fbgemm's
`quantized::linear_dynamic` instead, on weights packed once, where that was measured faster (`few_row_limit`). On CPUs
without VNNI oneDNN's kernel packs the weights at every call, which costs more than the product itself at a few rows
(8 rows through a 768 x 3072 layer: 0.27 ms against 0.99 ms); on an Intel Xeon with VNNI fbgemm's one call (it
quantizes, multiplies and rescales) still costs less than the separate steps here below 32 rows. Where it was measured
faster still (`few_rows_int8_limit`: AMD's Zen 5, up to 128 rows; Zen 4, up to 256; AVX2 EPYCs; Intel's Xeons with
AMX, up to 32), calls take `few_rows.int8_linear`, roformer_hf's own kernel (AVX-512 VNNI, or AVX2), which does the four
steps in one call. All three compute the same integer product of the same quantized inputs; inputs whose range is too
small for fbgemm's smallest scale (``_FBGEMM_SMALLEST_RANGE``) stay off fbgemm's path.

On CPUs without VNNI (plain AVX2/AVX-512), the kernel multiplies uint8 by int8 with ``vpmaddubsw``, which adds the
products of neighbouring input features (``2i`` and ``2i + 1``) into an int16 that saturates: 255 * 127 * 2 > 32767.
There (``saturation_safe``) each output channel's scale is chosen so that two neighbouring weights of the same sign
sum to at most 128 steps (255 * 128 <= 32767), and the result stays exact. A channel loses
``log2(largest pair / largest weight)`` bits, between 0 and 1: on random weights the steps are 1.34x wider than
plain 8-bit ones (about 7.6 bits), where the usual cure (``reduce_range``: 7-bit weights everywhere) loses a whole
bit. VNNI and AMX accumulate in int32 and get the full 8 bits.

torchao (`torchao.quantization.quantize_`, or transformers' `TorchAoConfig`) works on these models too; on a CPU
without VNNI its int8 GEMM has no fast kernel (docs/quantization.md).

Example:

```python
>>> import torch
>>> from roformer_hf import RoFormerConfig, RoFormerModel
>>> from roformer_hf.quantization import Int8Linear, quantize_int8
>>> model = RoFormerModel(RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
...                                      num_attention_heads=4, intermediate_size=64)).eval()
>>> ids = torch.tensor([[2, 5, 7, 3]])
>>> with torch.inference_mode():
...     reference = model(ids).last_hidden_state
...     quantized = quantize_int8(model)(ids).last_hidden_state
>>> type(model.encoder.layer[0].intermediate.dense).__name__
'Int8Linear'
>>> bool(torch.nn.functional.cosine_similarity(quantized.flatten(), reference.flatten(), dim=0) > 0.99)
True
```
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import few_rows
from .cpu import cpu_family, cpu_has, cpu_vendor

__all__ = ["Int8Linear", "quantize_int8", "int8_kernel_available", "static_int8"]


# fbgemm raises scales below 6.1e-5 to that value, so it quantizes inputs spanning less than 255 of them
# differently from `quantize_activations`; those take oneDNN's path (with a margin for its float32 arithmetic).
_FBGEMM_SMALLEST_RANGE = 255 * 6.2e-5
# What `fused` applies: oneDNN's (activation, algorithm) names.
_POST_OPS = {("none", ""), ("relu", ""), ("gelu", "none"), ("gelu", "tanh")}
# `Int8Linear.fused_side_by_side`: layers' weights joined, by their first layer, with what they were joined from.
_SIDE_BY_SIDE: weakref.WeakKeyDictionary[Int8Linear, tuple[tuple, Int8Linear]] = weakref.WeakKeyDictionary()
# Each layer's calls of `few_rows.int8_linear` bound to its operands (`Int8Linear._few_rows_call`), with the packed
# weight they were bound to.
_FEW_ROWS_CALLS: weakref.WeakKeyDictionary[Int8Linear, tuple[few_rows.PackedInt8, dict[str, few_rows.Kernel]]] = \
    weakref.WeakKeyDictionary()
_LINEAR_DYNAMIC = getattr(getattr(torch.ops.quantized, "linear_dynamic", None), "default", None)
_ENGINE_LOCK = threading.Lock()  # `_fbgemm_prepack` switches PyTorch's global quantized engine for a moment


def int8_kernel_available() -> bool:
    """Whether this PyTorch build has oneDNN's int8 linear kernel (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


# oneDNN's CPU limits (`ONEDNN_MAX_CPU_ISA`, formerly `DNNL_MAX_CPU_ISA`) that keep its int8 kernels off AVX-512
# VNNI: below it, or AVX-VNNI (VEX), which not every CPU with AVX-512 VNNI has.
_LIMITS_WITHOUT_VNNI = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE"}


def _cpu_has_vnni() -> bool:
    """Whether oneDNN's int8 kernels accumulate in int32 here: the CPU has AVX-512 VNNI and oneDNN is not held below
    it. oneDNN reads its limit once, from the environment; held there on a CPU with VNNI, it multiplies with
    ``vpmaddubsw`` as on a CPU without VNNI (PyTorch's own `torch._int_mm` asks the CPU only, and saturates there)."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    if limit.strip().upper() in _LIMITS_WITHOUT_VNNI:
        return False
    is_vnni_supported = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(is_vnni_supported and is_vnni_supported())


def few_row_limit() -> int:
    """The row count below which `Int8Linear` calls fbgemm's kernel on weights packed once rather than oneDNN's, by
    CPU kind, as measured (`benchmarks/RESULTS.md`, "int8 kernels for few rows"):

    - without VNNI (an AVX2 EPYC; or oneDNN held below VNNI): 256. oneDNN packs the weights at every call there;
      fbgemm was 3-6x faster at 8 rows of base width, 1.1-1.5x at 64-128, about even from 256 rows on.
    - with VNNI on Intel CPUs: 32. The 4-layer model of base width on an Intel Xeon with AVX-512 VNNI: 1.26x at one
      row, 1.06x at 16, 1.03x at 32, 0.96x at 48, 0.94x at 64.
    - with VNNI on AMD's EPYCs: 16. Four layers' dense calls of base width in a row, oneDNN's time over fbgemm's: on a
      Zen 5 1.21x at one row, 1.12x at 4, 0.98x at 16, 0.88-0.92x at 32-128; on a Zen 4 (family 25 model 17) 1.31x at
      one row, 1.17x at 4, 1.12x at 8, 1.05x at 16, 0.85-0.98x at 32-256.
    - with VNNI elsewhere: 0, oneDNN's kernel at every row count; not measured there.
    """
    if not _cpu_has_vnni():
        return 256
    if cpu_vendor() == "GenuineIntel":
        return 32
    return 16 if cpu_vendor() == "AuthenticAMD" else 0


SMALL_BATCH_ROWS = few_row_limit()


def few_rows_int8_limit() -> int:
    """The row count up to which `Int8Linear` calls `few_rows.int8_linear` (AVX-512 VNNI or AVX2: the input's range,
    its quantization, the product and the rescaling in one call) rather than fbgemm's or oneDNN's kernel, by CPU kind,
    as measured (`benchmarks/RESULTS.md`, "int8 kernels for few rows"):

    - AMD's Zen 5 (family 26 on) with VNNI: 128. Four layers' dense calls of base width in a row on an AMD EPYC
      (Zen 5), two runs: 0.69-0.89x the time of the faster of the other two at 1 to 64 rows, 0.98-1.01x at 128,
      0.95x at 192, 1.04-1.07x at 256.
    - AMD EPYCs without VNNI (AVX2; Zen 3): 640. Four layers' dense calls of base width in a row (`bench_dense.py`):
      0.87-0.97x the time of the faster of fbgemm's and oneDNN's at 1 to 256 rows, 0.92x at 384, 0.97x at 512,
      0.96x at 640, 1.02x at 1024.
    - Intel's Xeons with AMX: 128, where the kernel runs inputs of 16 rows and more on AMX's int8 tiles
      (`few_rows.amx_build_first`: the environment does not hold oneDNN below AMX). Four layers' dense calls of base
      width in a row (a Xeon reported as family 6 model 167): 0.72-0.78x the time of the faster of fbgemm's and
      oneDNN's at 1 to 32 rows, 0.81-0.85x at 48-96, 0.88-0.90x at 128, 1.02x at 256, 1.06x at 626. With `vpdpbusd`
      alone (Emerald Rapids): 32, 0.58-0.66x at 1 to 16 rows, 0.91x at 32, 1.03x at 64, 1.24-1.33x at 128-256.
    - AMD's Zen 4 (family 25) with VNNI: 256. Four layers' dense calls of base width in a row on an AMD EPYC (Zen 4):
      0.72-0.83x the time of the faster of the other two at 1 to 64 rows, 0.93-1.01x at 128-256 (two runs).
    - elsewhere: 0, not measured there (an Intel Xeon without AMX).
    """
    amd = cpu_vendor() == "AuthenticAMD"
    if few_rows.int8_isa() == "AVX2":
        return 640 if amd else 0
    if cpu_vendor() == "GenuineIntel":
        return (128 if few_rows.amx_build_first("int8") else 32) if cpu_has("amx_int8") else 0
    if not amd:
        return 0
    return 128 if cpu_family() >= 26 else 256



FEW_ROWS_INT8_ROWS = few_rows_int8_limit()


class Int8Linear(nn.Module):
    """A dense layer with int8 weights for CPU inference, built from an `nn.Linear` (fp32 or bf16).

    Weights: ``round(W / s)`` in int8, ``s = max |W[j]| / 127`` per output channel `j` (with `saturation_safe`, no
    less than the largest same-sign sum of neighbouring weights ``|W[j, 2i] + W[j, 2i + 1]|`` over 127). Inputs:
    quantized to uint8 at each call (one scale and zero point per call); output fp32 (``(*, out_features)``).
    Inference only: an input that requires grad is refused, since the kernel has no backward.

    Args:
        linear: the layer to quantize; its weights are copied.
        saturation_safe: scales that keep the int16 pair sums of CPUs without VNNI from saturating (see the
            module's docstring); default: on CPUs without VNNI.
    """

    fuses_post_ops = True  # `fused.FusesPostOps`: `fused_linear` hands it the activation or residual add (`fused`)

    # `loading.RefusesSaving`: what `save_pretrained` of a model holding one says. Its buffers would be written, but
    # `from_pretrained` builds `nn.Linear`s and would find no weights for them.
    save_refusal = ("its int8 layers (Int8Linear, from roformer_hf.quantization.quantize_int8) cannot be saved in a "
                    "form that from_pretrained reads back. Save the model before quantizing it and call quantize_int8 "
                    "after loading it, or, for a quantized checkpoint, use torchao through transformers' TorchAoConfig "
                    "(docs/quantization.md)")

    def __init__(self, linear: nn.Linear, saturation_safe: bool | None = None):
        super().__init__()
        if not int8_kernel_available():
            raise RuntimeError("Int8Linear needs oneDNN's int8 kernel (torch.ops.onednn.qlinear_pointwise), which "
                               "this PyTorch build lacks")
        weight = linear.weight.detach().float()
        if weight.device.type != "cpu":
            raise ValueError(f"Int8Linear runs on CPU; the layer's weight is on {weight.device}")
        saturation_safe = not _cpu_has_vnni() if saturation_safe is None else saturation_safe
        scale = weight_scales(weight, saturation_safe)  # (out,)
        self._hold(torch.round(weight / scale[:, None]).to(torch.int8), scale,
                   None if linear.bias is None else linear.bias.detach().float().clone(), saturation_safe)

    def _hold(self, weight_int8: Tensor, scale: Tensor, bias: Tensor | None, saturation_safe: bool) -> None:
        """Keeps the quantized weight ``(out, in)``, its scales and the bias, and packs them for the kernels."""
        self.out_features, self.in_features = weight_int8.shape
        self.saturation_safe = saturation_safe
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)
        self._weight_zero_point = torch.zeros(self.out_features, dtype=torch.int32)
        self._packed = torch.ops.onednn.qlinear_prepack(self.weight_int8, None)  # oneDNN's blocked layout
        # For calls of up to FEW_ROWS_INT8_ROWS rows; None where none takes `few_rows`' kernel, it is not available,
        # or it would not be exact on this weight (`few_rows.int8_exact`: AVX2's, on scales not saturation-safe).
        packed = (few_rows.pack_int8(self.weight_int8) if FEW_ROWS_INT8_ROWS > 0 and few_rows.int8_available()
                  else None)
        self._packed_few_rows = packed if packed is not None and few_rows.int8_exact(packed) else None
        # For calls of fewer than SMALL_BATCH_ROWS rows that `few_rows`' kernel leaves; None where none takes fbgemm,
        # or without it.
        kernel_rows = FEW_ROWS_INT8_ROWS if self._packed_few_rows is not None else 0
        takes_fbgemm = kernel_rows + 1 < SMALL_BATCH_ROWS  # a row count past the kernel's and below the limit
        self._packed_small = _fbgemm_prepack(self.weight_int8, scale, self.bias) if takes_fbgemm else None
        self._packed_from = self._buffers_state()

    @classmethod
    def fused_side_by_side(cls, layers: tuple[Int8Linear, ...], x: Tensor) -> tuple[Tensor, ...] | None:
        """``tuple(layer(x) for layer in layers)`` for layers that read the same input (attention's query, key and
        value): one kernel call on their weights side by side, the input quantized once. Each output channel is
        computed as its own layer computes it (the same quantized input, its own scale), so the bits are the same (but
        for oneDNN's kernel on CPUs with AMX, whose rescaling of a few rows depends on the output's width: within a
        unit in the last place). The joined copy is kept beside the first layer and made anew when a layer is replaced; ``None`` where the
        layers cannot be joined (other input widths, bias on some only, other `saturation_safe`)."""
        joined = cls._joined(layers, [layer._check_packed() for layer in layers])
        if joined is None:
            return None
        return joined.fused(x, checked=True).split([layer.out_features for layer in layers], dim=-1)

    @classmethod
    def checked_side_by_side(cls, layers: tuple[Int8Linear, ...]) -> Callable[[Tensor], tuple[Tensor, ...]] | None:
        """`fused_side_by_side` with the layers' buffers checked now, for a model's forward that checks its calls at
        its start (`fused.one_forward`): ``run(x)``; None where a layer's buffers changed (its call then says so) or
        the layers cannot be joined."""
        states = [layer._buffers_state() for layer in layers]
        if any(state != layer._packed_from for layer, state in zip(layers, states)):
            return None
        joined = cls._joined(layers, states)
        if joined is None:
            return None
        sizes = [layer.out_features for layer in layers]

        def run(x: Tensor) -> tuple[Tensor, ...]:
            return joined._compute(x, "none", "", None).split(sizes, dim=-1)
        return run

    @classmethod
    def _joined(cls, layers: tuple[Int8Linear, ...], states: list[tuple]) -> Int8Linear | None:
        """The layers' weights side by side in one layer (see `fused_side_by_side`), for layers whose buffers were
        checked (`states`: theirs, as packed)."""
        first = layers[0]
        if any(layer.in_features != first.in_features or layer.saturation_safe != first.saturation_safe
               or (layer.bias is None) != (first.bias is None) for layer in layers):
            return None
        cached = _SIDE_BY_SIDE.get(first)
        if cached is None or any(ref() is not layer or held != state
                                 for (ref, held), layer, state in zip(cached[0], layers, states)):
            state = tuple((weakref.ref(layer), held) for layer, held in zip(layers, states))
            joined = cls.__new__(cls)
            nn.Module.__init__(joined)
            joined._hold(torch.cat([layer.weight_int8 for layer in layers]),
                         torch.cat([layer.weight_scale for layer in layers]),
                         None if first.bias is None else torch.cat([layer.bias for layer in layers]),
                         first.saturation_safe)
            cached = _SIDE_BY_SIDE[first] = (state, joined)
        return cached[1]

    def checked_call(self, activation: str = "none", algorithm: str = "") -> Callable[..., Tensor] | None:
        """`fused` for this activation with the buffers checked now, for a model's forward that checks its calls at
        its start (`fused.one_forward`): ``run(x)``, or ``run(x, residual)`` without an activation; None where the
        buffers changed since they were packed (the call then says so)."""
        if (activation, algorithm) not in _POST_OPS or self._buffers_state() != self._packed_from:
            return None

        def run(x: Tensor, residual: Tensor | None = None) -> Tensor:
            return self._compute(x, activation, algorithm, residual)
        return run

    def _check_packed(self) -> tuple:
        """Refuses to run on packed copies of buffers that have changed since; returns the buffers' state."""
        state = self._buffers_state()
        if state != self._packed_from:
            raise RuntimeError("Int8Linear's weights, scales or bias changed after they were packed for its kernels "
                               "(load_state_dict, .to(), an in-place edit): quantize the fp32 model again instead")
        return state

    def _buffers_state(self) -> tuple:
        """What tells that the buffers were replaced or edited in place (inference tensors keep no version). Read
        from the buffers' dict, without `nn.Module.__getattr__`: every forward of a quantized model reads it for each
        layer (`checked_call`)."""
        buffers = self._buffers
        return tuple((t.data_ptr(), t.dtype, None if t.is_inference() else t._version)
                     for t in (buffers["weight_int8"], buffers["weight_scale"], buffers["bias"]) if t is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"saturation_safe={self.saturation_safe}")

    def forward(self, x: Tensor) -> Tensor:
        return self.fused(x)

    def fused(self, x: Tensor, activation: str = "none", algorithm: str = "", residual: Tensor | None = None, *,
              checked: bool = False) -> Tensor:
        """``residual + activation(self(x))``, both applied by the kernel: `activation` is oneDNN's name
        (``"none"``, ``"relu"``, ``"gelu"`` with `algorithm` ``"none"`` for the erf form); `residual`
        ``(*, out_features)`` fp32, only without an activation. `checked`: the caller checked the buffers
        (`fused_side_by_side`, on the layers its joined copy was made from)."""
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("Int8Linear is for inference: its kernel has no backward (run under "
                               "torch.inference_mode() or torch.no_grad())")
        if (activation, algorithm) not in _POST_OPS:
            raise ValueError(f"Int8Linear.fused: activation={activation!r}, algorithm={algorithm!r}; expected one of "
                             f"{sorted(_POST_OPS)}")
        if residual is not None and activation != "none":
            raise ValueError("Int8Linear.fused applies an activation or a residual add, not both")
        if not checked:
            self._check_packed()
        return self._compute(x, activation, algorithm, residual)

    def _compute(self, x: Tensor, activation: str, algorithm: str, residual: Tensor | None) -> Tensor:
        """`fused` once its arguments and the buffers are checked: the kernel for the rows, with the post-op."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int8Linear expected inputs with {self.in_features} features, got shape "
                             f"{tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features).float()
        if rows.shape[0] == 0:
            return rows.new_empty(*x.shape[:-1], self.out_features)
        other = None if residual is None else residual.reshape(-1, self.out_features).float().contiguous()
        if rows.shape[0] <= FEW_ROWS_INT8_ROWS and self._packed_few_rows is not None:
            in_kernel = activation if activation != "gelu" or algorithm == "none" else "none"  # GELU's erf form
            output = self._few_rows_call(in_kernel)(rows, other)
            if in_kernel != activation:
                output = torch.ops.aten.gelu_(output, approximate=algorithm)
            return output.view(*x.shape[:-1], self.out_features)
        low, high = input_range(rows)
        if (rows.shape[0] < SMALL_BATCH_ROWS and self._packed_small is not None
                and max(high, 0.0) - min(low, 0.0) >= _FBGEMM_SMALLEST_RANGE):
            output = self._few_rows(rows.contiguous(), activation, algorithm, other)
        else:
            quantized, scale, zero_point = quantize_activations(rows, value_range=(low, high))
            inputs = (quantized, scale, zero_point, self._packed, self.weight_scale, self._weight_zero_point)
            if other is None:
                output = torch.ops.onednn.qlinear_pointwise(*inputs, self.bias, 1.0, 0, torch.float32, activation,
                                                            [], algorithm)
            else:
                output = torch.ops.onednn.qlinear_pointwise.binary(*inputs, other, self.bias, 1.0, 0, torch.float32,
                                                                   1.0, 0, "add", 1.0, "none", [], "")
        return output.view(*x.shape[:-1], self.out_features)

    def _few_rows_call(self, activation: str) -> few_rows.Kernel:
        """`few_rows.int8_linear` on this layer's packed weight, scales and bias with `activation`, bound once
        (`few_rows.bind_int8_linear`) and kept beside the layer while it keeps its packed weight."""
        packed, calls = _FEW_ROWS_CALLS.get(self, (None, {}))
        if packed is not self._packed_few_rows:
            packed, calls = _FEW_ROWS_CALLS[self] = (self._packed_few_rows, {})
        if activation not in calls:
            calls[activation] = few_rows.bind_int8_linear(packed, self.weight_scale, self.bias, activation)
        return calls[activation]

    def _few_rows(self, rows: Tensor, activation: str, algorithm: str, residual: Tensor | None) -> Tensor:
        """fbgemm's dynamic int8 linear (it quantizes `rows` as `quantize_activations` does, for inputs spanning at
        least `_FBGEMM_SMALLEST_RANGE`), then the activation or residual that oneDNN would have fused."""
        # full 8-bit inputs; the overload itself spares the packet's search of its arguments for script objects
        output = _LINEAR_DYNAMIC(rows, self._packed_small, False)
        if activation == "gelu":
            # in place on the kernel's own fresh output ("none": the erf form): at 16 x 3072, 54 µs against 92 for a
            # new tensor (Intel Xeon)
            output = torch.ops.aten.gelu_(output, approximate=algorithm)
        elif activation == "relu":
            output = output.relu_()
        return output if residual is None else output.add_(residual)


def weight_scales(weight: Tensor, saturation_safe: bool) -> Tensor:
    """One scale per row of `weight` ``(out, in)``: its largest magnitude over 127, and with `saturation_safe` at
    least its largest same-sign sum of neighbours ``(2i, 2i + 1)`` over 127, so that the rounded pair sums stay within
    128 steps (``round(a / s) + round(b / s) <= (a + b) / s + 1``)."""
    largest = weight.abs().amax(dim=1)
    if saturation_safe:
        pairs = nn.functional.pad(weight, (0, weight.shape[1] % 2)).view(weight.shape[0], -1, 2)
        positive, negative = pairs.clamp(min=0).sum(-1), pairs.clamp(max=0).sum(-1).neg()
        largest = torch.maximum(largest, torch.maximum(positive, negative).amax(dim=1))
    return largest.clamp(min=torch.finfo(torch.float32).tiny) / 127


def input_range(x: Tensor) -> tuple[float, float]:
    """The smallest and largest value of `x`, in one pass (both to the host: the kernels take numbers); non-finite
    values are refused, since int8 cannot represent them."""
    low, high = (float(value) for value in x.aminmax())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"Int8Linear got an input with non-finite values (between {low} and {high}): int8 cannot "
                         "represent them")
    return low, high


def _fbgemm_prepack(weight_int8: Tensor, scale: Tensor, bias: Tensor | None):
    """The weights packed once for fbgemm's `quantized::linear_dynamic`, or None where PyTorch lacks it."""
    if "fbgemm" not in torch.backends.quantized.supported_engines or not hasattr(torch.ops.quantized,
                                                                                  "linear_dynamic"):
        return None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        weight = torch._make_per_channel_quantized_tensor(weight_int8, scale.double(),
                                                          torch.zeros(len(scale), dtype=torch.long), 0)
    with _ENGINE_LOCK:  # the packing follows the global engine; a call follows the packed object
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"
        try:
            return torch.ops.quantized.linear_prepack(weight, bias)
        finally:
            torch.backends.quantized.engine = engine


def quantize_activations(x: Tensor, levels: int = 255,
                         value_range: tuple[float, float] | None = None) -> tuple[Tensor, float, int]:
    """`x` as uint8 in ``[0, levels]``, with the scale and zero point that map ``[min(x, 0), max(x, 0)]`` onto that
    range (zero exactly representable): ``x ~ scale * (q - zero_point)``. `value_range`: `input_range(x)`, if
    already known."""
    low, high = input_range(x) if value_range is None else value_range
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / levels, torch.finfo(torch.float32).tiny)
    zero_point = min(max(round(-low / scale), 0), levels)
    if levels == 255 and hasattr(torch, "quantize_per_tensor"):
        # fbgemm's vectorized kernel, then its bytes seen as uint8 (no copy). PyTorch deprecates its quantized tensors
        # (the wrapper here); until they go, this is 2.4-3.8x faster than the composite below.
        quantized = _quantize_per_tensor(x, scale, zero_point)
        as_bytes = torch.empty(0, dtype=torch.uint8, device=x.device)
        return as_bytes.set_(quantized.untyped_storage(), quantized.storage_offset(), quantized.shape,
                             quantized.stride()), scale, zero_point
    # x / scale + zero_point, rounded half up: + 0.5 and the cast's truncation of values clamped non-negative.
    shifted = torch.add(torch.tensor(zero_point + 0.5), x, alpha=1 / scale)
    return shifted.clamp_(0, levels).to(torch.uint8).contiguous(), scale, zero_point


_DEPRECATION_SEEN = False  # PyTorch warns of its quantized tensors once per process


def _quantize_per_tensor(x: Tensor, scale: float, zero_point: int) -> Tensor:
    """`torch.quantize_per_tensor` to quint8, its deprecation warning kept from the user; the filter is set around
    the first call only, since the warning comes once (setting it costs as much as the call)."""
    global _DEPRECATION_SEEN
    if _DEPRECATION_SEEN:
        return torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        quantized = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
    _DEPRECATION_SEEN = True
    return quantized


def quantize_int8(model: nn.Module, include: Callable[[str, nn.Linear], bool] | None = None,
                  saturation_safe: bool | None = None) -> nn.Module:
    """Replaces, in place, every `nn.Linear` of `model` (those for which ``include(name, layer)`` is true, if
    given) by an `Int8Linear`, and returns `model`, for CPU inference: its remaining parameters (embeddings, norms)
    stop requiring grad, so a plain call works as under `torch.inference_mode()`. Quantize after loading the weights:
    the quantized model cannot be saved (a roformer_hf model's `save_pretrained` refuses it, saying so: save the
    fp32 one, or use torchao through transformers' `TorchAoConfig` for a quantized checkpoint). `saturation_safe` is
    `Int8Linear`'s (default: on CPUs without VNNI)."""
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear and (include is None or include(name, module))]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Int8Linear(module, saturation_safe))
    return model.requires_grad_(False)


def static_int8(module: nn.Module, calibration: Sequence[Mapping[str, Tensor]],
                dynamic_shapes: Mapping[str, Any] | None = None) -> nn.Module:
    """`module` exported and quantized statically, for `torch.compile` on CPU: torchao's PT2E flow for inductor's x86
    kernels (`X86InductorQuantizer`: int8 weights with a scale per output channel; int8 activations whose scale and
    zero point are fixed ahead of time from the `calibration` inputs, as OpenVINO's nncf does; 7-bit activations on
    CPUs without VNNI, as `Int8Linear`'s saturation-safe mode). Compiled with frozen
    weights (inductor's ``freezing``), its dense layers become oneDNN's int8 GEMMs on weights packed once
    (`torch.ops.onednn.qlinear_pointwise`) with nothing run from Python between them: for the latency of one short
    input (docs/quantization.md).

    Args:
        module: in eval mode, its forward traceable by `torch.export` (a roformer_hf model in the padded layout, or
            called without an attention mask).
        calibration: keyword arguments of `module`, each one call: inputs like those it will run. An activation
            beyond the range these saw is clipped to it, with no error.
        dynamic_shapes: `torch.export.export`'s, for the keyword arguments (default: every shape static).

    Returns: the quantized `torch.fx.GraphModule`, called with the same keyword arguments. It needs torchao
    (``pip install roformer_hf[quantization]``).
    """
    if not calibration:
        raise ValueError("static_int8: calibration is empty; expected at least one input (keyword arguments of the "
                         "module) to fix the activations' scales")
    if module.training:
        raise ValueError("static_int8: the module is in training mode; expected module.eval()")
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86
    except ImportError as error:
        raise ImportError(f"static_int8 quantizes with torchao's PT2E flow, which did not import ({error}): pip "
                          "install roformer_hf[quantization]") from error
    graph = torch.export.export(module, (), dict(calibration[0]), dynamic_shapes=dynamic_shapes).module()
    # Without VNNI oneDNN sums pairs of uint8 x int8 products in int16, which saturates on 8-bit activations (the
    # compiled graph strayed to a cosine of 0.96 from this graph, an AVX2 EPYC); 7 bits cannot saturate there.
    config = x86.get_default_x86_inductor_quantization_config(reduce_range=not _cpu_has_vnni())
    quantizer = x86.X86InductorQuantizer().set_global(config)
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for inputs in calibration:
            prepared(**inputs)
    return convert_pt2e(prepared)
