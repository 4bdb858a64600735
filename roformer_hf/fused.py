"""Dense layers for CPU inference: oneDNN's GEMM, with the activation or the residual add fused into it.

`nn.Linear` on CPU runs MKL's GEMM (after copying the bias into its output), and the activation or residual add
that follows is another pass over that output, into fresh memory. `torch.ops.mkldnn._linear_pointwise`, the kernel
torch.compile's CPU backend emits for linear layers, applies either to the GEMM's result before it is stored; on the
CPU benchmark's encoder shapes its GEMM alone also ran 6-13% faster than MKL's (AMD EPYC with AVX-512, fp32;
`benchmarks/RESULTS.md`, 2026-11-23, at d290e68).

On CPUs with AVX2 only, fp32 inputs of 1 to 128 rows take `few_rows`' GEMM instead, which reads a short input's
weights faster than oneDNN there (`DenseRule.few_rows_max_rows`), under the same conditions; on AMD's Zen 5, 1 to 64
rows, in its AVX-512 kernel, and bf16 inputs of 1 to 128 rows in its bf16 kernel (`DenseRule.bf16_few_rows_max_rows`);
on AMD's Zen 4, fp32 inputs of 1 to 256 rows and bf16 inputs of any number; on Intel's Xeons with AMX, fp32 inputs of
1 to 64 rows and bf16 inputs of 1 to 48, in its bf16 kernel built for AMX's tiles (`few_rows.bf16_isa`).

In fp32 training, where oneDNN's GEMM outruns MKL's (`DenseRule.onednn_training_macs`: AMD's Zen 5, where MKL's ran at
half its rate), a plain `nn.Linear`'s call and its gradients take oneDNN's kernel (`_TrainedLinear`), eager only.

The fused kernel has no backward formula and compilers and exporters should see plain ops, so `fused_linear` takes it
only in eager forwards without autograd (`torch.inference_mode()`, `torch.no_grad()`), and only where it computes what
the module would: a plain `nn.Linear` (not an adapter such as LoRA's, not a quantized weight) without hooks, fp32 or
bf16 without autocast, on CPU. A layer class that applies the activation or the addition itself declares it
(`FusesPostOps`: `quantization.Int8Linear` does; this module does not import it, so saved folders carry no quantization
code). Everywhere else `fused_linear` calls the module and applies the activation and the addition as usual; of any
other layer it reads nothing but its type.

Each call decides for itself: what holds for every layer of a forward alike (the device, the dtype, autograd, autocast,
compiling or tracing, global hooks) is `fusion_applies` (about 2 µs), then the layer's own conditions, then the GEMM
for the input's shape by the CPU's rule (`_dense_kernel`, `DenseRule`: which kernel at how many rows, and whether
oneDNN applies GELU itself; each CPU kind's rule is measured there), so the model's code calls
``fused_linear(self.dense, x)`` and passes nothing down. Within a model's forward (`one_forward`, entered by
`encode`), the calls that took the packed kernel in an earlier forward of that model are checked all together at its
start, and each such call then only confirms that it is the call checked: the same checks, run before the first GEMM
rather than between GEMMs, where each has just pushed Python's data out of the caches (a 16-token fp32 forward of base
width 3-6% faster on an Intel Xeon).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeGuard, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from transformers.activations import GELUActivation

from . import few_rows
from .blocked_dropout import dropout
from .cpu import cpu_family, cpu_has, cpu_vendor, held_below_avx512
from .few_rows import Packed, PackedBF16  # also what lets a saved folder's copy of the code carry few_rows.py

_KERNEL = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
# oneDNN has bf16 GEMMs only on CPUs with AVX-512 (or AMX); elsewhere it cannot build the primitive at all.
_BF16_GEMMS = _KERNEL is not None and torch.ops.mkldnn._is_mkldnn_bf16_supported()
_KERNEL_DTYPES = (torch.float32, torch.bfloat16) if _BF16_GEMMS else (torch.float32,)
_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _KERNEL is not None else None

PACKING_HINT = 16  # the rows oneDNN lays a packed weight out for; it serves every row count


@dataclass(frozen=True)
class DenseRule:
    """Which GEMM a dense layer takes in CPU inference on one kind of CPU (`_dense_kernel`), and whether oneDNN
    applies the GELU that follows it, as measured on that kind (`benchmarks/RESULTS.md`, "Dense kernels per shape").

    Attributes:
        cpu: the CPU kind, as the benchmarks name it.
        packed_max_rows: fp32 inputs of 2 up to this many rows take oneDNN's kernel on the packed weight.
        beyond: the fp32 kernel past them, and past `few_rows_max_rows`: ``"onednn"`` (on the layer's own weight),
            ``"module"`` (MKL's) or ``"packed"``.
        one_row: the fp32 kernel of one row (a decoding step).
        few_rows_max_rows: fp32 inputs of 1 up to this many rows take `few_rows`' kernel where it is available
            (`few_rows.available`), in place of `one_row` and `packed_max_rows`, and `beyond` past them; 0: never.
        fuses_gelu: oneDNN applies GELU to its product before storing it; else ``F.gelu`` runs on the stored product.
        compiled_max_tokens: the longest input a server started with ``--compile`` sends to the compiled encoder
            (`serving.compiled`), one input at a time; a longer one runs eagerly, where the compiled graph's GEMMs (the
            packed weight at every row count, query, key and value apart) took longer than this rule's.
        onednn_training_macs: fp32 training's dense calls of at least this many multiply-adds (rows x in x out)
            take oneDNN's kernel, forward and backward (`_TrainedLinear`), in place of MKL's, where MKL's GEMM runs
            slower (at half oneDNN's rate on a Zen 5); smaller ones keep the module's call, cheaper than an autograd
            function's; infinity: none.
        few_rows_row_panels: `few_rows`' AVX-512 kernel takes one row against four panels of the weight at once
            (`few_rows.linear`'s `row_panels`).
        bf16_few_rows_max_rows: bf16 inputs of 1 up to this many rows take `few_rows`' bf16 kernel where it is
            available (`few_rows.bf16_available`; AMX's tiles or AVX-512's ``vdpbf16ps``, as `few_rows.bf16_isa`
            says), in place of the packed weight; 0: never; infinity: every input.
    """

    cpu: str
    packed_max_rows: float
    beyond: str
    one_row: str
    fuses_gelu: bool
    compiled_max_tokens: float = math.inf
    few_rows_max_rows: int = 0
    onednn_training_macs: float = math.inf
    bf16_few_rows_max_rows: float = 0
    few_rows_row_panels: bool = False


# Intel Xeon (AVX-512): the packed weight at every row count, 1.05-1.10x up to 2626 rows; MKL's matrix-vector product
# for one row, 0.5-0.85x oneDNN's time. The encoder compiled with frozen weights took 0.84-0.97x the eager time for
# one input of 8-512 tokens.
INTEL_RULE = DenseRule("Intel, AVX-512", math.inf, "onednn", "module", fuses_gelu=True)
# Intel Xeon with AMX (Emerald Rapids, family 6 model 207; L2 2 MiB per core): four layers' dense calls in a row, each
# weight read from the L3 as a forward reads it: `few_rows`' AVX-512 kernel took 0.86-0.94x the time of MKL's at one
# row, 0.73-0.83x oneDNN's on the packed weight at 4-32 rows, 0.94x at 64, 1.05x at 128 and 1.18x at 256; past 64 rows
# the packed weight. With these kernels eager, the served compiled encoder took 0.91x the eager time for one input of 8
# tokens, 0.95x at 16, 1.09x at 32, 0.97-1.00x at 64-512. In bf16 `few_rows`' kernel on AMX's tiles (a second Intel
# Xeon with AMX, family 6 model 167 as its VM reports it, L2 2 MiB per core; each kernel 6 turns of 45 calls in a row,
# the first 25 left out) took 0.75x the time of oneDNN's AMX kernel on the packed weight at 1 row, 0.77-0.78x at 8-16,
# 0.86x at 24-32, 0.92-0.97x at 40-48, 1.03x at 64, 1.13x at 128; its AVX-512 build (`vdpbf16ps`, the kernel of the AMD
# EPYCs) had taken 0.64x at one row on the first, 0.89x at 8 and 1.26x at 16. There, too, one fp32 row against four
# panels at once (`few_rows_row_panels`) took 0.82x the time of one panel in interleaved runs (3.06 against 3.74 ms for
# the dense calls in a row; the same at 4-64 rows, which it does not touch); fetching the blocks of 12 rows and more
# into the L2 cache rather than the L1 took 0.94x at 16 rows but 1.2-1.3x at 24-32, and was left out.
INTEL_AMX_RULE = DenseRule("Intel with AMX, AVX-512", math.inf, "packed", "module", fuses_gelu=True,
                           compiled_max_tokens=16, few_rows_max_rows=64, bf16_few_rows_max_rows=48,
                           few_rows_row_panels=True)
# AMD EPYC with AVX-512, Zen 4 (family 25 model 17; 512-bit operations in two halves; L1d 32 KiB): four layers' dense
# calls in a row, each weight read from memory: `few_rows`' AVX-512 kernel took 0.66-0.96x the time of oneDNN's on the
# packed weight at 1-128 rows (0.66x at one row, 0.69x at 8, 0.95-0.96x at 16 and 128), 1.02x at 256, within the
# packed weight's own spread there (0.98-1.02x between two rules' turns); its bf16 kernel 0.69-0.97x the packed
# weight's time at 1-256 rows, 0.95x at 626 and 0.99x at 2626 (32 short sentences in 0.93x the time, the padded
# batch of 8 x 512..128 in 1.01x), so it takes every bf16 input and a layer keeps one bf16 copy. Beyond 256 fp32 rows,
# the packed weight: 0.89-0.90x the time of oneDNN's on the layer's own weight at 626 rows in a row, 0.93-0.98x per
# layer at 2626; `few_rows`' kernel took 1.03x its time at 626 and 1.15x at 2626.
AVX512_RULE = DenseRule("AMD Zen 4, AVX-512", math.inf, "packed", "onednn", fuses_gelu=True, few_rows_max_rows=256,
                        bf16_few_rows_max_rows=math.inf)
# AMD EPYC with AVX-512, Zen 5 (family 26; whole 512-bit operations): `few_rows`' AVX-512 kernel ran four layers'
# dense calls in a row, each weight read from memory, in 0.70-0.93x the time of oneDNN's on the packed weight at 1-64
# rows, 0.96-1.00x at 128-256; the model of 4 layers of base width in 0.62-0.68x the time at one token, 0.86-0.97x at
# 4-32, 0.97-1.01x at 64 and even beyond. Past 64 rows the packed weight, which took 0.92x the time of the layer's own
# at 626 rows.
# oneDNN's GEMM ran the training step's shapes at 1.9-2.2x MKL's rate forward and for the input's gradient, 1.4-2.0x
# for the weight's (on its transposed operands as they lie); a layer's forward and backward through it took 0.47-0.54x
# the module's time from 67M multiply-adds, 0.76x at 8.4M, 0.92x at 4.3M, 1.44x at 1.1M.
# In bf16 `few_rows`' bf16 kernel ran the dense calls in a row in 0.66-0.93x the time of oneDNN's on the packed weight
# at 1-128 rows (0.75-0.79x at 16), 0.96-0.97x at 256.
ZEN5_RULE = DenseRule("AMD Zen 5, AVX-512", math.inf, "packed", "onednn", fuses_gelu=True, few_rows_max_rows=64,
                      onednn_training_macs=4_000_000, bf16_few_rows_max_rows=128)
# AMD EPYC with AVX2 only (Zen 3): four layers' dense calls in a row, each weight read from memory as a forward reads
# it. Two hosts of this kind disagreed on MKL past 256 rows: on the first (MKL's SGEMM at 140-168 GFLOP/s) oneDNN's
# kernel on the packed weight took 0.89x MKL's time at 256 rows, 1.02x at 626, 1.11x at 2626; on the second (MKL's at
# 81 GFLOP/s, oneDNN's packed at 106) 0.71x at 256, 0.80x at 626, 0.77x at 1024 and 0.88x at 2626, and the model
# embedded sorted batches of 32 short sentences in 0.87-0.92x the time, the padded batch of 8 x 512..128 in
# 0.83-0.92x: the packed weight past the few rows, as on the AVX-512 EPYCs. `few_rows`' kernel took 0.88x the time of
# oneDNN's kernel at 1 and 2 rows (one row: on the layer's own weight; 0.64-0.76x on a weight in the caches), 0.68x at
# 8, 0.60x at 16, 0.70-0.72x at 24-32 and 0.81-0.89x at 64-256 on the first host; on the second 0.77x at 64,
# 0.99-1.03x at 128, 1.08-1.09x at 192 and 1.07-1.16x at 256 (eight sentences of 16-32 tokens in a batch took 0.89x
# the time on the packed weight): it takes inputs of 1 to 128 rows. oneDNN's AVX2 GELU post-op cost 8 ms of a 22 ms
# product at 626 rows, where `F.gelu` after it cost 2. The compiled encoder (GELU after the product there too) took
# 0.91-0.99x the eager time at 8 tokens, 1.14-1.20x at 16-24, 1.15-1.28x at 32-512.
AVX2_RULE = DenseRule("AVX2 only", math.inf, "packed", "onednn", fuses_gelu=False, compiled_max_tokens=8,
                      few_rows_max_rows=128)


def onednn_has_avx512() -> bool:
    """Whether oneDNN's kernels run AVX-512 here: the CPU has it and oneDNN is not held below it (oneDNN reads its
    limit once, from the environment)."""
    if held_below_avx512():
        return False
    is_avx512_supported = getattr(torch.cpu, "_is_avx512_supported", None)
    if is_avx512_supported is not None:
        return bool(is_avx512_supported())
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


# every CPU kind's, as `dense_rule` picks among them
RULES = (INTEL_RULE, INTEL_AMX_RULE, AVX512_RULE, ZEN5_RULE, AVX2_RULE)


def dense_rule() -> DenseRule:
    """This CPU's `DenseRule`: AVX2 only (a CPU without AVX-512 on any vendor's; measured on an AMD EPYC), else
    Intel's AVX-512 rule (with AMX or without, as /proc/cpuinfo lists ``amx_bf16``), or AMD's for Zen 4 or for Zen 5
    and later by the CPU's family."""
    if not onednn_has_avx512():
        return AVX2_RULE
    if cpu_vendor() == "GenuineIntel":
        return INTEL_AMX_RULE if cpu_has("amx_bf16") else INTEL_RULE
    return ZEN5_RULE if cpu_family() >= 26 else AVX512_RULE


RULE = dense_rule()


@dataclass
class _Copies:
    """A layer's packed weights (or those of layers side by side): what they were packed from (`_source`), and one
    copy per packing kernel (`_PACKING_KERNELS`) that has called for it."""

    source: tuple
    bias: Tensor | None = None  # layers side by side: their biases side by side (a layer alone reads its own)
    weights: dict[str, Tensor | Packed | PackedBF16] = field(default_factory=dict)


# Each layer's `_Copies`: a copy made at the layer's first call that `_dense_kernel` packs for with that kernel, all
# made again once the weight changes, dropped with the layer. A layer that runs both short and long inputs keeps both
# copies (`few_rows`' tiles and oneDNN's layout, where the CPU's rule takes both): with one copy, each change of kernel
# packed the weight again (on a Zen 4, a 16-token forward after a 400-token one took 63 ms instead of 11).
_PACKED: weakref.WeakKeyDictionary[nn.Linear, _Copies] = weakref.WeakKeyDictionary()
# Layers that read the same input (attention's query, key and value), packed side by side, by their first layer.
_PACKED_SIDE_BY_SIDE: weakref.WeakKeyDictionary[nn.Linear, _Copies] = weakref.WeakKeyDictionary()
# The kernels (`_dense_kernel`) that run on a packed copy of the weight: oneDNN's blocked layout, `few_rows`' tiles.
_PACKING_KERNELS = ("packed", "few_rows", "few_rows_bf16")
_FEW_ROWS_BINDS = {"few_rows": lambda weight, bias, activation: few_rows.bind_linear(weight, bias, activation,
                                                                                     RULE.few_rows_row_panels),
                   "few_rows_bf16": few_rows.bind_bf16_linear}


@runtime_checkable
class FusesPostOps(Protocol):
    """A dense layer (``in_features -> out_features``) that applies the activation or the residual add after its
    product itself: `fused_linear` hands them to its `fused`, with oneDNN's names, instead of applying them to its
    output. Its class declares it with ``fuses_post_ops = True``.

    A class may also let a model's forward check its layers' state once, at the forward's start (`one_forward`),
    rather than at each call: ``checked_call(layer, activation, algorithm)`` returns the call that `fused` would make
    once its checks pass (``run(x)``, or ``run(x, residual)``), or None where they fail now (the call itself then says
    why); ``checked_side_by_side(layers)`` does the same for ``fused_side_by_side(layers, x)``, returning ``run(x)``.
    Nothing the layer reads may change within a forward (`quantization.Int8Linear` does this).

    Example:

    ```python
    >>> import torch
    >>> from torch import nn
    >>> from roformer_hf.fused import FusesPostOps, fused_linear
    >>> class Relu(nn.Linear):  # applies ReLU itself
    ...     fuses_post_ops = True
    ...     def fused(self, x, activation="none", algorithm="", residual=None):
    ...         assert activation in ("none", "relu") and residual is None
    ...         return self(x).relu() if activation == "relu" else self(x)
    >>> layer, x = Relu(4, 3), torch.randn(2, 4)
    >>> isinstance(layer, FusesPostOps), torch.equal(fused_linear(layer, x, nn.ReLU()), layer.fused(x, "relu"))
    (True, True)
    ```
    """

    fuses_post_ops: ClassVar[bool]
    out_features: int

    def fused(self, x: Tensor, activation: str = "none", algorithm: str = "",
              residual: Tensor | None = None) -> Tensor:
        """``residual + activation(self(x))``: `activation` ``"none"``, ``"relu"`` or ``"gelu"`` (with `algorithm`
        ``"none"``, the erf form); `residual` ``(*, out_features)``, only without an activation."""
        ...


def _fuses_post_ops(layer: nn.Module) -> TypeGuard[FusesPostOps]:
    """Whether `layer`'s class declares `FusesPostOps`. It reads the class's flag, not `isinstance`: it runs for
    every dense layer of every forward, where a protocol check costs 50 times as much."""
    return bool(getattr(type(layer), "fuses_post_ops", False))


def fusion_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether dense layers computing in `dtype` on `device` may take oneDNN's kernel here and now: the conditions of
    the module docstring that hold for a whole forward (each layer's own are checked per call)."""
    return (_KERNEL is not None and device.type == "cpu" and dtype in _KERNEL_DTYPES and not torch.is_grad_enabled()
            and torch.backends.mkldnn.enabled
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()  # transformers' is_tracing, on CPU
            and not torch.is_autocast_enabled("cpu")
            and not (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks))


@dataclass(frozen=True)
class _Checked:
    """A dense call of a model's forward, checked at the start of the forward in progress: its kernel with every
    argument but the input bound, and what the call must bring to take it."""

    layers: tuple[nn.Module, ...]  # one layer, or layers side by side (`fused_linears`)
    activation: nn.Module | None
    adds: bool  # a residual is added
    run: Callable[..., Tensor | tuple[Tensor, ...]]  # run(x), or run(x, residual) where it adds; side by side: a tuple
    out_features: int
    kernel: str | None  # the packing kernel it runs (`_PACKING_KERNELS`), for rows that take it; else a `FusesPostOps`
    #                     layer's call

    def takes(self, x: Tensor, activation: nn.Module | None, residual: Tensor | None) -> bool:
        """Whether a call with these arguments is the call checked: the same activation, a residual where it added
        one (that the kernel can add), and an input its kernel was checked for."""
        return (activation is self.activation and (residual is not None) == self.adds
                and (self.kernel is None or _dense_kernel(x) == self.kernel)
                and (residual is None or _fits(residual, x, self.out_features)))


@dataclass(frozen=True)
class _Forward:
    """A model's forward in progress (`one_forward`)."""

    dtype: torch.dtype
    checked: dict[nn.Module, _Checked]  # by first layer
    calls: dict[int, tuple]  # the model's recorded calls (`_CALLS`), to record this forward's new ones


_FORWARD: ContextVar[_Forward | None] = ContextVar("roformer_hf_forward", default=None)
# By model: each dense call that took the packed kernel in one of its forwards, by its first layer's id, as weak
# references: (layers, activation or None, adds a residual).
_CALLS: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple]] = weakref.WeakKeyDictionary()


def one_forward(model: nn.Module, hidden_states: Tensor) -> AbstractContextManager[None]:
    """The scope of one forward of `model` whose dense layers read `hidden_states` ``(*T, H)`` (the same rows, dtype
    and device): the calls of its earlier forwards that took the packed kernel are checked here, all together, and
    those that still hold skip their checks within it. A call that does not hold (its weight changed, a hook was added,
    the layer was replaced) decides for itself, as outside any forward, and is packed again where it applies. Nothing
    where no call packs: the kernel does not apply at all (`fusion_applies`, compiling and tracing included), or the
    rows take another GEMM (`_dense_kernel`: one fp32 row on Intel CPUs, a decoding step)."""
    if not fusion_applies(hidden_states.device, hidden_states.dtype):
        return nullcontext()
    kernel = _dense_kernel(hidden_states)
    return _one_forward(model, hidden_states.dtype, kernel) if kernel in _PACKING_KERNELS else nullcontext()


@contextmanager
def _one_forward(model: nn.Module, dtype: torch.dtype, kernel: str) -> Iterator[None]:
    calls = _CALLS.get(model)
    if calls is None:
        calls = _CALLS[model] = {}
    checked = {}
    for key, (refs, activation_ref, adds) in list(calls.items()):
        layers = tuple(ref() for ref in refs)
        activation = activation_ref() if activation_ref is not None else None
        if any(layer is None for layer in layers) or (activation_ref is not None and activation is None):
            calls.pop(key, None)
            continue
        call = _check(layers, activation, adds, dtype, kernel)
        if call is not None:
            checked[layers[0]] = call
    token = _FORWARD.set(_Forward(dtype, checked, calls))
    try:
        yield
    finally:
        _FORWARD.reset(token)


def _check(layers: tuple[nn.Module, ...], activation: nn.Module | None, adds: bool, dtype: torch.dtype,
           kernel: str) -> _Checked | None:
    """A recorded call, checked as the call itself would check it for an input of `dtype` whose rows take the packing
    `kernel` (`fused_linear`, `fused_linears`); None where it no longer takes the kernel it was recorded with, or its
    weight holds no copy packed for that kernel (the call itself packs one)."""
    post_op = _fused_activation(activation)
    if post_op is None or (adds and post_op[0] != "none"):
        return None
    if _fuses_post_ops(layers[0]):
        return _check_fuses_post_ops(layers, activation, adds, post_op)
    if not all(_layer_applies(layer, dtype) for layer in layers):
        return None
    if len(layers) == 1:
        layer = layers[0]
        copies, parameters = _PACKED.get(layer), layer._parameters  # `_layer_applies`: a plain `nn.Linear`
        weight = parameters["weight"]
        if (copies is None or kernel not in copies.weights or weight.is_inference()
                or not _same_source(copies.source, (weight,))):
            return None
        bias, out_features, sizes = parameters["bias"], weight.shape[0], None
    else:
        copies = _PACKED_SIDE_BY_SIDE.get(layers[0])
        if (copies is None or kernel not in copies.weights
                or not _same_source(copies.source, _side_by_side_tensors(layers))):
            return None
        bias, sizes = copies.bias, [layer.out_features for layer in layers]
        out_features = sum(sizes)
    run = _packed_call(kernel, copies.weights[kernel], bias, post_op, adds, sizes)
    return _Checked(layers, activation, adds, run, out_features, kernel)


def _packed_call(kernel: str, weight: Tensor | Packed | PackedBF16, bias: Tensor | None, post_op: tuple[str, str],
                 adds: bool, sizes: list[int] | None) -> Callable[..., Tensor | tuple[Tensor, ...]]:
    """The packing `kernel` on its packed weight, every argument but the input bound: ``run(x)``, ``run(x, residual)``
    where it adds one; layers side by side (their `sizes`): their outputs, as views of the one product."""
    name, algorithm = post_op
    if kernel in _FEW_ROWS_BINDS:  # `few_rows`' kernels, with their operands checked once (`few_rows.bind_linear`)
        product = _FEW_ROWS_BINDS[kernel](weight, bias, name)
        if sizes is None:
            return product

        def run(x: Tensor) -> tuple[Tensor, ...]:
            return product(x).split(sizes, dim=-1)
    elif adds:
        def run(x: Tensor, residual: Tensor) -> Tensor:
            return _packed_product(kernel, x, weight, bias, "none", "", residual)
    elif sizes is None:
        def run(x: Tensor) -> Tensor:
            return _packed_product(kernel, x, weight, bias, name, algorithm)
    else:
        def run(x: Tensor) -> tuple[Tensor, ...]:
            return _packed_product(kernel, x, weight, bias, "none", "").split(sizes, dim=-1)
    return run


def _check_fuses_post_ops(layers: tuple[nn.Module, ...], activation: nn.Module | None, adds: bool,
                          post_op: tuple[str, str]) -> _Checked | None:
    """`_check` for layers of a `FusesPostOps` class that checks its own state up front (`checked_call`,
    `checked_side_by_side`): the call it makes once checked."""
    kind = type(layers[0])
    if any(type(layer) is not kind or _hooked(layer) for layer in layers):
        return None
    if len(layers) == 1:
        run = kind.checked_call(layers[0], *post_op)
    else:
        side_by_side = getattr(kind, "checked_side_by_side", None)
        run = side_by_side(layers) if side_by_side is not None else None
    return None if run is None else _Checked(layers, activation, adds, run, layers[0].out_features, kernel=None)


def _checks_up_front(layer: nn.Module) -> bool:
    """Whether a `FusesPostOps` layer's class hands `one_forward` its checked calls (`checked_call`)."""
    return hasattr(type(layer), "checked_call")


def _record(layers: tuple[nn.Linear, ...], activation: nn.Module | None, adds: bool) -> None:
    """Notes, for the model's later forwards, a call that took the packed kernel in the forward in progress."""
    forward = _FORWARD.get()
    if forward is not None:
        forward.calls[id(layers[0])] = (tuple(weakref.ref(layer) for layer in layers),
                                        None if activation is None else weakref.ref(activation), adds)


def _checked(layer: nn.Module, x: Tensor) -> _Checked | None:
    """The call of `layer` checked at the start of the forward in progress, for an input `x` of its kind. None while
    compiling, where a forward has none (and the compilers cannot read a context variable)."""
    if torch.compiler.is_compiling():
        return None
    forward = _FORWARD.get()
    if forward is None or x.dtype is not forward.dtype or not x.is_cpu:
        return None
    return forward.checked.get(layer)


def fused_linear(layer: nn.Linear, x: Tensor, activation: nn.Module | None = None,
                 residual: Tensor | None = None) -> Tensor:
    """``residual + activation(layer(x))`` (both optional): one oneDNN call where it applies (see above).

    Args:
        layer: the dense layer, ``in_features -> out_features``.
        x: ``(*, in_features)``.
        activation: applied to the layer's output; fused for transformers' ``"gelu"`` (the erf form) and ``"relu"``,
            and nothing to fuse for a dropout that is off (one that is on: `blocked_dropout.dropout`).
        residual: ``(*, out_features)``, added last; fused when there is no activation to apply.
    """
    checked = _checked(layer, x)
    if checked is not None and len(checked.layers) == 1 and checked.takes(x, activation, residual):
        return checked.run(x) if residual is None else checked.run(x, residual)
    fused = _fused_activation(activation)
    if fused is not None and (residual is None or fused[0] == "none"):
        name, algorithm = fused
        if _fuses_post_ops(layer) and not _hooked(layer) and (
                residual is None or _fits(residual, x, layer.out_features)):
            if _checks_up_front(layer):
                _record((layer,), activation, residual is not None)
            return layer.fused(x, name, algorithm, residual)
        if fusion_applies(x.device, x.dtype) and _kernel_applies(layer, x, residual):
            kernel = _dense_kernel(x)
            if kernel == "module":
                return _applied_in_place(layer(x), name, residual)
            weight = _packed_weight(layer, x, kernel)
            if weight is not layer.weight:
                _record((layer,), activation, residual is not None)
            else:
                kernel = "onednn"  # a weight that is never packed (`_packed_weight`)
            return _packed_product(kernel, x, weight, layer.bias, name, algorithm, residual)
    product = _TrainedLinear.apply(x, layer.weight, layer.bias) if _trains_on_onednn(layer, x) else layer(x)
    if activation is None:
        output = product
    elif _gelu_written_out(activation, x):
        output = activation._gelu_python(product)
    else:
        output = dropout(activation, product)
    return output if residual is None else residual + output


def _trains_on_onednn(layer: nn.Module, x: Tensor) -> bool:
    """Whether the layer's call in training takes `_TrainedLinear`: where the CPU's rule says so for its size, for a
    plain `nn.Linear` in fp32 on CPU with autograd recording, eager, without autocast."""
    return (RULE.onednn_training_macs < math.inf and _KERNEL is not None and x.is_cpu and x.dtype == torch.float32
            and torch.is_grad_enabled() and torch.backends.mkldnn.enabled
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch.is_autocast_enabled("cpu") and _layer_applies(layer, torch.float32)
            and x.numel() * layer.out_features >= RULE.onednn_training_macs)


class _TrainedLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` through oneDNN's GEMM, and its gradients: the input's ``grad @ weight``, the weight's
    ``grad.T @ x``, each one oneDNN call on the operands as they lie (transposed views), the bias's ``grad``'s sum.
    A backward pass that is itself recorded (``create_graph=True``, for gradients of gradients) computes them with
    differentiable ops instead."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        return _KERNEL(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        recorded = torch.is_grad_enabled()
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (rows @ weight if recorded else _KERNEL(rows, weight.t(), None, "none", [], ""))
            grad_x = grad_x.view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t() @ inputs if recorded else _KERNEL(rows.t(), inputs.t(), None, "none", [], "")
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def fused_linears(layers: tuple[nn.Linear, ...], x: Tensor) -> tuple[Tensor, ...]:
    """``tuple(fused_linear(layer, x) for layer in layers)``, for layers that read the same input (attention's query,
    key and value projections): one GEMM on their weights packed side by side where the weights are packed
    (`_dense_kernel`, plain `nn.Linear`s), which reads them faster than three GEMMs and gives the same bits; the
    outputs are views of its output. Layers of a `FusesPostOps` class that defines ``fused_side_by_side(layers, x)``
    (`quantization.Int8Linear`) are handed to it."""
    checked = _checked(layers[0], x)
    if checked is not None and checked.layers == layers and checked.takes(x, None, None):
        return checked.run(x)
    kind = type(layers[0])
    if (_fuses_post_ops(layers[0]) and hasattr(kind, "fused_side_by_side")
            and all(type(layer) is kind and not _hooked(layer) for layer in layers)):
        outputs = kind.fused_side_by_side(layers, x)
        if outputs is not None:
            if _checks_up_front(layers[0]):
                _record(layers, None, False)
            return outputs
    packed = _side_by_side(layers, x) if fusion_applies(x.device, x.dtype) else None
    if packed is None:
        return tuple(fused_linear(layer, x) for layer in layers)
    _record(layers, None, False)
    sizes = [layer.out_features for layer in layers]
    return _packed_product(_dense_kernel(x), x, *packed, "none", "").split(sizes, dim=-1)


def _packed_product(kernel: str, x: Tensor, weight: Tensor | Packed | PackedBF16, bias: Tensor | None, name: str,
                    algorithm: str, residual: Tensor | None = None) -> Tensor:
    """`kernel`'s product (``"few_rows"``, ``"few_rows_bf16"``; else oneDNN's, on a packed weight or the layer's own)
    with the activation `name` or the `residual` applied: `few_rows`' kernels apply either (their activations' names
    are `_fused_activation`'s); oneDNN applies either itself, but GELU after its product where the rule says so
    (`DenseRule.fuses_gelu`)."""
    if kernel == "few_rows":
        return few_rows.linear(x, weight, bias, residual, name, RULE.few_rows_row_panels)
    if kernel == "few_rows_bf16":
        return few_rows.bf16_linear(x, weight, bias, residual, name)
    if residual is not None:
        return _KERNEL.binary(x, residual, weight, bias, "add")
    if name == "gelu" and not RULE.fuses_gelu:
        return torch._C._nn.gelu_(_KERNEL(x, weight, bias, "none", [], ""))
    return _KERNEL(x, weight, bias, name, [], algorithm)


def _applied_in_place(output: Tensor, name: str, residual: Tensor | None) -> Tensor:
    """The activation `name` (`_fused_activation`'s) or the residual applied to the layer's own output, which no one
    else holds (inference, a plain `nn.Linear`), in place: the same bits as a new tensor, without allocating and
    writing a second one of the output's size (4 layers of base width on an AVX2 EPYC, when MKL took the rows past
    512 there: 32 short sentences in 0.95-0.97x the time, the padded batch of 8 x 512..128 in 0.98x)."""
    if name == "gelu":
        return torch._C._nn.gelu_(output)
    if name == "relu":
        return output.relu_()
    return output if residual is None else output.add_(residual)


def _side_by_side(layers: tuple[nn.Linear, ...], x: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """The layers' weights packed side by side and their biases concatenated, for `x`; ``None`` where that does not
    apply: an input that is not packed for (`_dense_kernel`), a layer the kernel cannot compute, biases on some layers
    only, or a weight made under `torch.inference_mode()` (see `_packed_weight`)."""
    kernel = _dense_kernel(x)
    if kernel not in _PACKING_KERNELS:
        return None
    if not all(_kernel_applies(layer, x, None) for layer in layers):
        return None
    tensors = _side_by_side_tensors(layers)
    if len(tensors) not in (len(layers), 2 * len(layers)) or any(tensor.is_inference() for tensor in tensors):
        return None
    copies = _PACKED_SIDE_BY_SIDE.get(layers[0])
    if copies is None or not _same_source(copies.source, tensors):
        bias = None if len(tensors) == len(layers) else torch.cat([layer.bias.detach() for layer in layers])
        copies = _PACKED_SIDE_BY_SIDE[layers[0]] = _Copies(_source(tensors), bias)
    if kernel not in copies.weights:
        copies.weights[kernel] = _pack(torch.cat([layer.weight.detach() for layer in layers]), kernel)
    return copies.weights[kernel], copies.bias


def _side_by_side_tensors(layers: tuple[nn.Linear, ...]) -> list[Tensor]:
    """What layers packed side by side are made from: each layer's weight, then its bias if it has one."""
    return [tensor for layer in layers for name in ("weight", "bias")
            if (tensor := layer._parameters[name]) is not None]  # `_layer_applies`'s layers: without `__getattr__`


def _dense_kernel(x: Tensor) -> str:
    """The GEMM a dense layer's call takes for the input `x` once `fusion_applies` and the layer is the kernel's
    (`_kernel_applies`), chosen from the input's dtype and rows by this CPU's `RULE` (`DenseRule`: the figures behind
    each CPU kind's rule are beside it, and in `benchmarks/RESULTS.md`, "Dense kernels per shape"):

    - ``"packed"``: oneDNN's kernel on the weight packed in its blocked layout (`_PACK`, what torch.compile's CPU
      backend does with frozen weights), which reads faster and gives the same bits as the layer's own weight. fp32:
      2 to `DenseRule.packed_max_rows` rows, where the GEMM waits on its weight; bf16: every row count `few_rows`' bf16
      kernel leaves (an Intel Xeon without AMX: 2x at one row, 1.3x at 16).
    - ``"module"``: the layer's own call (MKL's GEMM), the activation or addition applied after it: where the rule
      names it for one fp32 row (Intel CPUs, where MKL's matrix-vector product takes 0.5-0.85x oneDNN's time; a
      packed weight would sum in another order) or past the packed rows where a rule names it (none of `RULES` does).
    - ``"onednn"``: oneDNN's kernel on the layer's own weight, where the rule names it, and for an input of no rows.
    - ``"few_rows"``: `few_rows`' kernel on the weight packed in its tiles, for fp32 inputs of 1 up to
      `DenseRule.few_rows_max_rows` rows where it is available (AVX2 only; AMD Zen 4 and 5; Intel with AMX), in place of
      the packed weight and the rule's `one_row`; past them the rule's `beyond`.
    - ``"few_rows_bf16"``: `few_rows`' bf16 kernel on the weight packed in its tiles, for bf16 inputs of 1 up to
      `DenseRule.bf16_few_rows_max_rows` rows where it is available (AMD Zen 4 and 5; Intel with AMX), in place of the
      packed weight.
    """
    rows = x.numel() // x.shape[-1]
    if RULE.few_rows_max_rows and x.dtype == torch.float32 and rows > 0 and few_rows.available():
        return "few_rows" if rows <= RULE.few_rows_max_rows else RULE.beyond
    if 0 < rows <= RULE.bf16_few_rows_max_rows and x.dtype == torch.bfloat16 and few_rows.bf16_available():
        return "few_rows_bf16"
    if _PACK is not None and (x.dtype == torch.bfloat16 or 1 < rows <= RULE.packed_max_rows):
        return "packed"
    if rows == 1:
        return RULE.one_row
    return RULE.beyond if rows > RULE.packed_max_rows else "onednn"  # past the packed rows, or none at all


def _packed_weight(layer: nn.Linear, x: Tensor, kernel: str) -> Tensor | Packed | PackedBF16:
    """The weight `fused_linear` hands `kernel`: packed for it (a copy kept beside the layer, as much memory again as
    its weight, one per packing kernel the layer's inputs have called for) where `_dense_kernel` says so, from the
    first such input on, all made anew when the weight changes (as `_source` tells); the layer's own weight otherwise. A weight made under `torch.inference_mode()` keeps no count of
    its changes, so it is never packed."""
    weight = layer.weight
    if kernel not in _PACKING_KERNELS or weight.is_inference():
        return weight
    copies = _PACKED.get(layer)
    if copies is None or not _same_source(copies.source, (weight,)):
        copies = _PACKED[layer] = _Copies(_source((weight,)))
    if kernel not in copies.weights:
        copies.weights[kernel] = _pack(weight.detach(), kernel)
    return copies.weights[kernel]


def _pack(weight: Tensor, kernel: str) -> Tensor | Packed | PackedBF16:
    """`weight` laid out for the packing `kernel`: `few_rows`' tiles (fp32 or bf16), or oneDNN's blocked layout."""
    if kernel == "few_rows":
        return few_rows.pack(weight)
    return few_rows.pack_bf16(weight) if kernel == "few_rows_bf16" else _PACK(weight, PACKING_HINT)


# Entries of a weight compared at each call with those it was packed from (`_sample`): runs of adjacent entries, each
# run one cache line of fp32.
SAMPLED_RUNS, SAMPLED_RUN_LENGTH = 16, 16
SAMPLED_ENTRIES = SAMPLED_RUNS * SAMPLED_RUN_LENGTH


def _sample(tensor: Tensor) -> Tensor:
    """`SAMPLED_ENTRIES` entries of `tensor` (all of them, if it holds no more): `SAMPLED_RUNS` runs of adjacent
    entries, spread evenly from its first entry to its last, so that a tensor of at least as many rows has each run in
    a row of its own (a view: copy it to keep it). They catch the uncounted writes that change the whole weight (an
    optimizer step, a merged adapter), not one through ``.data`` to a few rows. Runs cost 16 cache lines where 256
    lone entries cost 256: each comparison took 11 µs in the model that way, and a 16-token forward of base width makes
    36 of them (runs: 1.5-4% faster, Intel Xeon)."""
    flat = tensor.detach().view(-1)
    if flat.numel() <= SAMPLED_ENTRIES:
        return flat
    step = (flat.numel() - SAMPLED_RUN_LENGTH) // (SAMPLED_RUNS - 1)
    return flat.as_strided((SAMPLED_RUNS, SAMPLED_RUN_LENGTH), (step, 1))


def _source(tensors: Sequence[Tensor]) -> tuple:
    """What a packed copy was made from: for each tensor, the tensor itself (held weakly, so a replaced weight is
    never mistaken for the one it replaced), where its data is, its count of in-place changes, and `_sample` of it,
    as a view (it sees every later write) and as a copy. The count alone misses changes: torch's fused AdamW
    (Trainer's default optimizer) and writes through ``.data`` (PEFT merging an adapter, a user's edit) leave it as
    it was; they change the sampled entries."""
    return tuple((weakref.ref(tensor), tensor.data_ptr(), tensor._version, view, view.clone())
                 for tensor in tensors for view in (_sample(tensor),))


def _same_source(cached: tuple, tensors: Sequence[Tensor]) -> bool:
    if len(cached) != len(tensors):
        return False
    for (ref, data_ptr, version, view, sample), tensor in zip(cached, tensors):
        if (ref() is not tensor or data_ptr != tensor.data_ptr() or version != tensor._version
                or not torch.equal(view, sample)):
            return False
    return True


def _fused_activation(activation: nn.Module | None) -> tuple[str, str] | None:
    """oneDNN's name and algorithm for an activation it computes exactly as torch does; None if it has none (or if
    hooks wait for the activation's call)."""
    if activation is not None and _hooked(activation):
        return None
    if activation is None or (type(activation) is nn.Dropout and not (activation.training and activation.p)):
        return "none", ""
    if type(activation) is GELUActivation and activation.act is nn.functional.gelu:
        return "gelu", "none"  # the erf form: transformers' "gelu", RoFormer's
    if type(activation) is nn.ReLU:
        return "relu", ""  # RoFormer-V2's
    return None


def _gelu_written_out(activation: nn.Module, x: Tensor) -> bool:
    """Whether a compiler tracing CPU inference (`torch.compile`, `torch.export`) sees this GELU written out
    (transformers' `GELUActivation._gelu_python`, the erf form inductor computes for ``F.gelu`` too) rather than as
    ``F.gelu``, which inductor's oneDNN pass fuses into the GEMM before it: where this CPU kind's rule applies GELU after
    oneDNN's product (`DenseRule.fuses_gelu` false: AVX2 only), as the eager forward does. On an AVX2 EPYC the encoder
    compiled for one input took 0.93x the time of the one with GELU fused at 16 tokens, 0.89x at 512
    (benchmarks/RESULTS.md)."""
    return (not RULE.fuses_gelu and torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and x.device.type == "cpu" and _fused_activation(activation) == ("gelu", "none"))


def _kernel_applies(layer: nn.Module, x: Tensor, residual: Tensor | None) -> bool:
    """The layer's own conditions, once `fusion_applies` holds."""
    return (x.is_cpu and _layer_applies(layer, x.dtype)
            and (residual is None or _fits(residual, x, layer._parameters["weight"].shape[0])))


def _layer_applies(layer: nn.Module, dtype: torch.dtype) -> bool:
    """The layer's conditions for inputs of `dtype`. The layer's type first: a replacement (quantized, adapted) may
    hold anything under `weight`, or nothing. Its weight and bias (or None) must be where `nn.Linear` registers them: a
    bias deleted, or set as a plain attribute, leaves the layer its own call."""
    if type(layer) is not nn.Linear:
        return False
    parameters = layer._parameters  # what `layer.weight` reads, without `nn.Module.__getattr__`'s cost
    weight, bias = parameters.get("weight"), parameters.get("bias")
    return (type(weight) is nn.Parameter and "bias" in parameters and dtype in _KERNEL_DTYPES
            and weight.dtype == dtype and (bias is None or bias.dtype == dtype) and not _hooked(layer))


def _fits(residual: Tensor, x: Tensor, out_features: int) -> bool:
    """The kernel adds `residual` as it is: no broadcasting, no type promotion."""
    return residual.dtype == x.dtype and residual.device == x.device and residual.shape == (*x.shape[:-1], out_features)


def _hooked(layer: nn.Module) -> bool:
    """Whether calling `layer` would run more than its forward: its own hooks, global module hooks, or a replaced
    `forward` (accelerate's offloading hooks replace it)."""
    return bool(layer._forward_hooks or layer._forward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks or "forward" in vars(layer))
