"""GEMMs for inputs of few rows: fp32 on CPUs with AVX2 and FMA or with AVX-512 (`linear`, on a weight laid out by
`pack`), int8 on CPUs with AVX-512 VNNI or AVX2 (`int8_linear`, `pack_int8`) and bf16 on CPUs with AVX-512 bf16
(`bf16_linear`, `pack_bf16`), int8 and bf16 on AMX's tiles where the CPU has them; and the attention of sequences of
few tokens (`attention`).

A short input's dense layers wait on their weights: on an AMD EPYC with AVX2 only, oneDNN's GEMM on a packed weight
ran the 16 dense calls of a 16-token forward (4 layers of base width) at 70-82 GFLOP/s where a large product runs at
165 (`benchmarks/RESULTS.md`). This kernel streams the weight through once, in the order `pack` lays it out: tiles of
output features, each tile's entries feature by feature along the input. With AVX2 (`csrc/few_rows_avx2.cpp`, tiles
of 6) the input's rows lie in a vector's lanes and each weight entry is broadcast against them; with AVX-512
(`csrc/few_rows_avx512.cpp`, tiles of 48, three vectors) the weight lies in the lanes and each input entry is broadcast
against it, 8 rows at a time, so that no lane idles at few rows; from 12 rows, in passes over blocks of the weight
while the next block streams in. Either way each output is summed over the input features in order, whatever the
number of rows from 2 up: the same bits in both, and a row's result does not depend on the rows beside it. One row
alone (a decoding step) is summed in interleaved runs, an order of its own.

`int8_linear` (`csrc/few_rows_int8_vnni.cpp`; without VNNI `csrc/few_rows_int8_avx2.cpp`) does in one call what
`quantization.Int8Linear` does in four on oneDNN's path: the input's range, its quantization to uint8 (the same bytes
as `quantization.quantize_activations`), the integer product (exact: the same sums as oneDNN's and fbgemm's kernels),
and the rescaling with the bias, the residual or the activation. Its weight lies as the AVX-512 fp32 kernel's does, in
panels of 48 output features, in groups of 4 input features (what one ``vpdpbusd`` sums; with AVX2, ``vpmaddubsw``
and ``vpmaddwd``, whose int16 sums of neighbouring products hold only weights whose neighbours of one sign add to at
most 128 in magnitude: `int8_exact`); `bf16_linear`'s in pairs (``vdpbf16ps``), its sums in float32, rounded to bf16
once. On CPUs with AMX (`csrc/few_rows_bf16_amx.cpp`; int8's VNNI source built with ``ROFORMER_HF_AMX``) the same
packed weights are read as AMX tiles, 16 rows of the input against a panel at once (``tdpbf16ps``, ``tdpbusd``): bf16
at every row count, int8 from 16 rows, with the same outputs as ``vpdpbusd``'s (integer sums); `build` says which
build runs, and Linux must grant the process AMX's tile data (else the AVX-512 builds run). Each kernel applies ReLU
or GELU (the erf form: `csrc/gelu_avx512.h`, `csrc/gelu_avx2.h`) itself, the AVX-512 ones and int8's AVX2 one to their
sums before storing them, fp32's AVX2 one to each thread's columns once it has written them.

`attention` (`csrc/few_tokens_attention.cpp`, built for AVX-512 or AVX2 as `isa` says) is a short input's
self-attention in one call: queries and keys rotated, scores, softmax and weighted values for every sequence and head,
where the two rotations and SDPA call it replaces cost several times its work in dispatch alone (a model's inference
on CPU, `plan.few_token_attention`).

A caller that makes many calls with one weight binds the kernel to it once (`bind_linear`, `bind_int8_linear`,
`bind_bf16_linear`): each call then checks only its input and residual (a model's forward: `fused.one_forward`).

Each kernel is built at first use with the system's C++ compiler (``$CXX``, else ``c++``; about a second) into
``$ROFORMER_HF_CACHE/kernels``, else ``$XDG_CACHE_HOME/roformer_hf/kernels``, else ``~/.cache/roformer_hf/kernels``,
and linked against the OpenMP runtime torch itself runs on, so its threads are torch's (``torch.set_num_threads``).
Where it cannot be (no compiler, no AVX2 or FMA, not Linux, torch without GNU OpenMP), `available` is False, `why_not`
says why (logged once), and dense layers take the CPU kind's other kernels. ``ROFORMER_HF_FEW_ROWS=0`` turns it off
(without the warning).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .cpu import cpu_has, held_below_amx, held_below_avx512

logger = logging.getLogger(__name__)

# Each instruction set's source (`isa`) and the output features a tile of its packed weight holds (its `kTile`).
SOURCES = {"AVX2": Path(__file__).with_name("csrc") / "few_rows_avx2.cpp",
           "AVX-512": Path(__file__).with_name("csrc") / "few_rows_avx512.cpp",
           "int8 VNNI": Path(__file__).with_name("csrc") / "few_rows_int8_vnni.cpp",
           "int8 AMX": Path(__file__).with_name("csrc") / "few_rows_int8_vnni.cpp",  # built with ROFORMER_HF_AMX
           "int8 AVX2": Path(__file__).with_name("csrc") / "few_rows_int8_avx2.cpp",
           "bf16 AVX-512": Path(__file__).with_name("csrc") / "few_rows_bf16_avx512.cpp",
           "bf16 AMX": Path(__file__).with_name("csrc") / "few_rows_bf16_amx.cpp",
           "attention AVX2": Path(__file__).with_name("csrc") / "few_tokens_attention.cpp",
           "attention AVX-512": Path(__file__).with_name("csrc") / "few_tokens_attention.cpp"}
TILES = {"AVX2": 6, "AVX-512": 48, "int8 VNNI": 48, "int8 AMX": 48, "int8 AVX2": 48, "bf16 AVX-512": 48,
         "bf16 AMX": 48}
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")
EXTRA_FLAGS = {"AVX2": (), "AVX-512": ("-mavx512f",), "int8 VNNI": ("-mavx512f", "-mavx512vnni"),
               "int8 AMX": ("-mavx512f", "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-DROFORMER_HF_AMX"),
               "int8 AVX2": (),
               "bf16 AVX-512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
               "bf16 AMX": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
               "attention AVX2": (), "attention AVX-512": ("-mavx512f",)}
# What each kind needs of the CPU beyond AVX2 and FMA (/proc/cpuinfo's flags), and of the environment: not holding
# oneDNN below AVX-512 (`ONEDNN_MAX_CPU_ISA`), as one does to run an AVX2-only CPU's paths on an AVX-512 one.
NEEDS = {"AVX2": (), "AVX-512": ("avx512f",), "int8 VNNI": ("avx512f", "avx512_vnni"),
         "int8 AMX": ("avx512f", "avx512_vnni", "amx_tile", "amx_int8"), "int8 AVX2": (),
         "bf16 AVX-512": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
         "bf16 AMX": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"), "attention AVX2": (),
         "attention AVX-512": ("avx512f",)}
# `_loaded`'s names, each with the kind (a key of `SOURCES`) it builds here: fp32's and attention's by `isa`, int8's
# by `int8_isa`, bf16's AVX-512's; where the CPU has AMX, int8's VNNI kind and bf16's for its tiles first (`_kinds`)
KERNELS = {"fp32": lambda: isa(), "int8": lambda: f"int8 {int8_isa()}", "bf16": lambda: "bf16 AVX-512",
           "attention": lambda: f"attention {isa()}"}
AMX_KINDS = {"int8 VNNI": "int8 AMX", "bf16 AVX-512": "bf16 AMX"}
INT8_GROUP = 4  # input features one `vpdpbusd` sums per output feature: `pack_int8`'s groups
# The activations the kernels apply (`csrc/gelu_avx512.h`, `csrc/gelu_avx2.h`: GELU's erf form, within 4e-7 |x| of the
# exact value), by their codes.
ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2}

# A kernel bound to its weight, bias and activation (`bind_linear`): run(x, residual=None).
Kernel = Callable[..., Tensor]

_lock = threading.Lock()
# By kernel (a key of `KERNELS`), once decided: (ctypes.CDLL or None, why not: "" where it loaded, the kind loaded)
_state: dict[str, tuple[ctypes.CDLL | None, str, str]] = {}


def cache_root() -> Path:
    """Where roformer_hf keeps what it builds: ``$ROFORMER_HF_CACHE``, else ``$XDG_CACHE_HOME/roformer_hf``, else
    ``~/.cache/roformer_hf`` (`RuntimeError` where there is no home folder to find)."""
    root = os.environ.get("ROFORMER_HF_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "roformer_hf"
    return Path(root).expanduser()


def available() -> bool:
    """Whether `linear` runs here: the kernel built (at the first call, which builds it) and loaded."""
    return _loaded("fp32")[0] is not None


def int8_available() -> bool:
    """Whether `int8_linear` runs here: the kernel built for `int8_isa` and loaded."""
    return _loaded("int8")[0] is not None


def int8_isa() -> str:
    """The instruction set `int8_linear` is built for here: ``"VNNI"`` where the CPU has AVX-512 VNNI and the
    environment does not hold oneDNN below AVX-512 (on a CPU with AMX's int8 tiles, inputs of 16 rows and more run on
    them: `build` says ``"int8 AMX"``; the same outputs), else ``"AVX2"`` (exact only on weights `int8_exact`
    accepts)."""
    return "VNNI" if cpu_has("avx512f") and cpu_has("avx512_vnni") and not held_below_avx512() else "AVX2"


def bf16_available() -> bool:
    """Whether `bf16_linear` runs here: a CPU with AVX-512 bf16 (and the environment not holding oneDNN below
    AVX-512), the kernel built and loaded (for `bf16_isa`)."""
    return _loaded("bf16")[0] is not None


def bf16_isa() -> str:
    """The instruction set `bf16_linear` is built for here: ``"AMX"`` where the CPU has AMX's bf16 tiles, the
    environment does not hold oneDNN below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``) and Linux grants the process
    AMX's tile data, else ``"AVX-512"`` (``vdpbf16ps``)."""
    return build("bf16").removeprefix("bf16 ")


def _loaded(kernel: str) -> tuple[ctypes.CDLL | None, str]:
    """`kernel`'s library (a key of `KERNELS`) and why not, loaded at the first call."""
    if kernel not in _state:
        with _lock:
            if kernel not in _state:
                kinds = _kinds(kernel)
                for kind in kinds:  # the first that loads
                    library, why_not = _load(kind)
                    if library is not None:
                        break
                if library is None and not _turned_off() and kernel == "fp32":
                    logger.warning("roformer_hf's few-row GEMM is not available (%s): dense layers of few rows take "
                                   "oneDNN's kernel instead", why_not)
                _state[kernel] = (library, why_not, kind if library is not None else kinds[-1])
    return _state[kernel][:2]


def _kinds(kernel: str) -> list[str]:
    """The builds `kernel` (a key of `KERNELS`) may load here, the first that loads taken: AMX's tiles first (int8's
    VNNI kind and bf16's) where the CPU has them and the environment does not hold oneDNN below AMX (Linux may still
    refuse the process its tile data)."""
    kind = KERNELS[kernel]()
    amx = AMX_KINDS.get(kind)
    return [amx, kind] if amx is not None and cpu_has(*NEEDS[amx]) and not held_below_amx() else [kind]


def amx_build_first(kernel: str) -> bool:
    """Whether `kernel` (a key of `KERNELS`) is built for AMX's tiles first here (the CPU has them, the environment
    does not hold oneDNN below AMX), known without building it: `build` says which build runs."""
    return _kinds(kernel)[0] in AMX_KINDS.values()


def build(kernel: str = "fp32") -> str:
    """The build of `kernel` (a key of `KERNELS`) that runs here, as `SOURCES` names it (``"AVX-512"``, ``"int8 AMX"``,
    ``"bf16 AVX-512"``); where none loads, the one it would have been."""
    _loaded(kernel)
    return _state[kernel][2]


def isa() -> str:
    """The instruction set the kernel is built for here: ``"AVX-512"`` where the CPU has AVX-512F and the environment
    does not hold oneDNN below it (``ONEDNN_MAX_CPU_ISA``: the kernel is then AVX2's, as on an AVX2-only CPU), else
    ``"AVX2"``. Each has a source and a packed layout of its own (`SOURCES`, `TILES`)."""
    return "AVX-512" if cpu_has("avx512f") and not held_below_avx512() else "AVX2"


def why_not(kernel: str = "fp32") -> str:
    """Why `available` (``"fp32"``), `int8_available` (``"int8"``) or `bf16_available` (``"bf16"``) is False (``""``
    where it is True)."""
    return _loaded(kernel)[1]


@dataclass(frozen=True)
class Packed:
    """A weight ``(out_features, in_features)`` laid out for `linear` (`pack`)."""

    tiles: Tensor  # (ceil(out_features / tile), in_features, tile), contiguous; the last tile's missing features zero
    out_features: int


def pack(weight: Tensor) -> Packed:
    """`weight` ``(out_features, in_features)`` laid out for `linear` (a copy), in tiles of the kernel's width
    (`TILES`)."""
    _check_weight("pack", weight, torch.float32)
    tile = _library().few_row_tile()
    return Packed(_tiled(weight, tile, 1).squeeze(-1), weight.shape[0])


def _check_weight(function: str, weight: Tensor, dtype: torch.dtype) -> None:
    if weight.dim() != 2 or weight.dtype != dtype:
        raise ValueError(f"few_rows.{function}: weight must be a 2-d {str(dtype).removeprefix('torch.')} tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype}")


def _tiled(weight: Tensor, tile: int, group: int) -> Tensor:
    """`weight` ``(out_features, in_features)`` in tiles of `tile` output features, each tile's entries group by group
    of `group` input features: ``(ceil(out_features / tile), ceil(in_features / group), tile, group)``, contiguous,
    the entries past the weight's zero."""
    out_features, in_features = weight.shape
    tiles, groups = -(-out_features // tile), -(-in_features // group)
    padded = weight.new_zeros(tiles * tile, groups * group)
    padded[:out_features, :in_features] = weight
    return padded.view(tiles, tile, groups, group).transpose(1, 2).contiguous()


def linear(x: Tensor, packed: Packed, bias: Tensor | None, residual: Tensor | None = None,
           activation: str = "none", row_panels: bool = False) -> Tensor:
    """``activation(residual + x @ weight.T + bias)`` (`residual` and `bias` optional), `packed` being
    ``pack(weight)``, `activation` a key of `ACTIVATIONS`, applied by the kernel (GELU: `csrc/gelu_avx512.h`,
    `csrc/gelu_avx2.h`).

    Args:
        x: ``(*, in_features)`` float32 on CPU.
        packed: `pack`'s layout of the weight ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        residual: ``(*, out_features)``, as `x`'s leading dimensions, or None.
        row_panels: the AVX-512 kernel takes one row against four panels of the weight at once (four streams from
            memory; each output summed over the input features in order), rather than one panel in four interleaved
            runs of sums: per CPU kind (`fused.DenseRule.few_rows_row_panels`).

    It has no backward: with autograd recording, inputs that require grad are refused.
    """
    return bind_linear(packed, bias, activation, row_panels)(x, residual)


def bind_linear(packed: Packed, bias: Tensor | None, activation: str = "none",
                row_panels: bool = False) -> Kernel:
    """`linear` on `packed`, `bias` and `activation`, checked now: ``run(x, residual=None)`` checks only what it is
    given. For a caller that makes many calls with one layer (a model's forward, `fused.one_forward`): a call of 16
    rows cost 4.1 µs of Python and ctypes where `linear`'s cost 5.3 (a Zen 5)."""
    library = _library()
    code = _activation_code(activation)
    tiles, out_features = packed.tiles, packed.out_features
    in_features = tiles.shape[1]
    if tiles.shape[2] != library.few_row_tile():
        raise ValueError(f"few_rows.linear: packed holds tiles of {tiles.shape[2]} features, this kernel's are "
                         f"{library.few_row_tile()} wide: pack the weight again with few_rows.pack")
    _check_operand("linear", torch.float32, "bias", bias, (out_features,))

    def run(x: Tensor, residual: Tensor | None = None) -> Tensor:
        x, residual = _checked_inputs("linear", torch.float32, x, in_features, residual, out_features, bias)
        bias_now = _contiguous(bias)
        output = x.new_empty(*x.shape[:-1], out_features)
        library.few_row_linear(x.data_ptr(), tiles.data_ptr(), _address(bias_now), _address(residual),
                               output.data_ptr(), math.prod(x.shape[:-1]), out_features, in_features,
                               torch.get_num_threads(), code, int(row_panels))
        return output
    return run


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight ``(out_features, in_features)`` laid out for `int8_linear` (`pack_int8`)."""

    tiles: Tensor  # int8 (ceil(out_features / 48), ceil(in_features / 4), 48, 4), contiguous; missing entries zero
    sums: Tensor  # int32 (out_features,): each output feature's sum of weights, for the input's zero point
    out_features: int
    in_features: int
    # Whether every pair of neighbouring entries (input features 2i, 2i + 1) of one sign adds to at most 128 in
    # magnitude: 255 times either stays within an int16 (`int8_exact`)
    pairs_fit_int16: bool


def pack_int8(weight: Tensor) -> PackedInt8:
    """The int8 `weight` ``(out_features, in_features)`` laid out for `int8_linear` (a copy)."""
    _check_weight("pack_int8", weight, torch.int8)
    out_features, in_features = weight.shape
    layout = _tiled(weight, TILES["int8 VNNI"], INT8_GROUP)
    pairs = layout.view(-1, 2).to(torch.int16)  # the padding's zeros add nothing
    fits = bool((pairs.clamp(min=0).sum(-1) <= 128).all() and (pairs.clamp(max=0).sum(-1) >= -128).all())
    return PackedInt8(layout, weight.sum(1, dtype=torch.int32), out_features, in_features, fits)


def int8_exact(packed: PackedInt8) -> bool:
    """Whether `int8_linear` computes `packed`'s products exactly here: always with VNNI (int32 sums); with AVX2,
    whose ``vpmaddubsw`` adds neighbouring products into a saturating int16, where ``packed.pairs_fit_int16``
    (`quantization.Int8Linear`'s `saturation_safe` scales give such weights)."""
    return int8_isa() == "VNNI" or packed.pairs_fit_int16


def int8_linear(x: Tensor, packed: PackedInt8, weight_scale: Tensor, bias: Tensor | None,
                residual: Tensor | None = None, activation: str = "none") -> Tensor:
    """``activation(residual + dequantized(quantized(x) @ weight.T) + bias)`` (`residual` and `bias` optional): `x`
    quantized to uint8 as `quantization.quantize_activations` does, `packed` being ``pack_int8(weight)`` of an int8
    weight whose output features have the scales `weight_scale`; `activation` a key of `ACTIVATIONS`.

    Args:
        x: ``(*, in_features)`` float32 on CPU; every value finite (`ValueError` otherwise).
        packed: `pack_int8`'s layout of the weight.
        weight_scale: ``(out_features,)`` float32.
        bias: ``(out_features,)`` float32, or None.
        residual: ``(*, out_features)`` float32, or None.
    """
    return bind_int8_linear(packed, weight_scale, bias, activation)(x, residual)


def bind_int8_linear(packed: PackedInt8, weight_scale: Tensor, bias: Tensor | None, activation: str = "none") -> Kernel:
    """`int8_linear` on `packed`, `weight_scale`, `bias` and `activation`, checked now (see `bind_linear`):
    ``run(x, residual=None)``."""
    library = _library("int8")
    code = _activation_code(activation)
    out_features, in_features = packed.out_features, packed.in_features
    if not int8_exact(packed):
        raise ValueError("few_rows.int8_linear: without AVX-512 VNNI the kernel adds neighbouring products (input "
                         "features 2i, 2i + 1) into int16, and this weight has neighbours of one sign adding to more "
                         "than 128 in magnitude, which would saturate: quantize with saturation-safe scales "
                         "(quantization.Int8Linear(..., saturation_safe=True), the default on CPUs without VNNI)")
    _check_operand("int8_linear", torch.float32, "weight_scale", weight_scale, (out_features,))
    _check_operand("int8_linear", torch.float32, "bias", bias, (out_features,))

    def run(x: Tensor, residual: Tensor | None = None) -> Tensor:
        x, residual = _checked_inputs("int8_linear", torch.float32, x, in_features, residual, out_features, bias)
        scale_now, bias_now = weight_scale.contiguous(), _contiguous(bias)
        output = x.new_empty(*x.shape[:-1], out_features)
        if library.few_row_int8_linear(x.data_ptr(), packed.tiles.data_ptr(), packed.sums.data_ptr(),
                                       scale_now.data_ptr(), _address(bias_now), _address(residual), output.data_ptr(),
                                       math.prod(x.shape[:-1]), out_features, in_features, code,
                                       torch.get_num_threads()):
            low, high = (float(value) for value in x.aminmax())
            raise ValueError(f"Int8Linear got an input with non-finite values (between {low} and {high}): int8 "
                             "cannot represent them")
        return output
    return run


@dataclass(frozen=True)
class PackedBF16:
    """A bf16 weight ``(out_features, in_features)`` laid out for `bf16_linear` (`pack_bf16`)."""

    tiles: Tensor  # bf16 (ceil(out_features / 48), ceil(in_features / 2), 48, 2), contiguous; missing entries zero
    out_features: int
    in_features: int


def pack_bf16(weight: Tensor) -> PackedBF16:
    """The bf16 `weight` ``(out_features, in_features)`` laid out for `bf16_linear` (a copy)."""
    _check_weight("pack_bf16", weight, torch.bfloat16)
    return PackedBF16(_tiled(weight, TILES["bf16 AVX-512"], 2), *weight.shape)


def bf16_linear(x: Tensor, packed: PackedBF16, bias: Tensor | None, residual: Tensor | None = None,
                activation: str = "none") -> Tensor:
    """``activation(residual + x @ weight.T + bias)`` in bf16 (`residual` and `bias` optional), `packed` being
    ``pack_bf16(weight)``: the products summed in float32, the bias, the residual and `activation` (a key of
    `ACTIVATIONS`) applied to the sums, rounded to bf16 once.

    Args:
        x: ``(*, in_features)`` bfloat16 on CPU.
        packed: `pack_bf16`'s layout of the weight.
        bias: ``(out_features,)`` bfloat16, or None.
        residual: ``(*, out_features)`` bfloat16, or None.
    """
    return bind_bf16_linear(packed, bias, activation)(x, residual)


def bind_bf16_linear(packed: PackedBF16, bias: Tensor | None, activation: str = "none") -> Kernel:
    """`bf16_linear` on `packed`, `bias` and `activation`, checked now (see `bind_linear`): ``run(x, residual=None)``."""
    library = _library("bf16")
    code = _activation_code(activation)
    out_features, in_features = packed.out_features, packed.in_features
    _check_operand("bf16_linear", torch.bfloat16, "bias", bias, (out_features,))

    def run(x: Tensor, residual: Tensor | None = None) -> Tensor:
        x, residual = _checked_inputs("bf16_linear", torch.bfloat16, x, in_features, residual, out_features, bias)
        bias_now = _contiguous(bias)
        output = x.new_empty(*x.shape[:-1], out_features)
        library.few_row_bf16_linear(x.data_ptr(), packed.tiles.data_ptr(), _address(bias_now), _address(residual),
                                    output.data_ptr(), math.prod(x.shape[:-1]), out_features, in_features, code,
                                    torch.get_num_threads())
        return output
    return run


def attention_available() -> bool:
    """Whether `attention` runs here: the kernel built (for `isa`) and loaded."""
    return _loaded("attention")[0] is not None


def attention(query: Tensor, key: Tensor, value: Tensor, phases: Tensor | None, lengths: Sequence[int], heads: int,
              scaling: float, layout: str = "interleaved", rotate_value: bool = False) -> Tensor:
    """Self-attention of the tokens of sequences of few tokens, rotation included: each sequence's tokens rotated by
    their `phases` (queries and keys; values too with `rotate_value`) and attending each other, every key visible,
    with the weights ``softmax(q k^T * scaling)`` (`csrc/few_tokens_attention.cpp`).

    Args:
        query: ``(*T, heads * d)`` float32 or bfloat16 on CPU, the ``N = prod(T)`` tokens' queries; each head's ``d``
            features side by side (a projection's output, or a view of one: tokens a fixed stride apart).
        key, value: ``(*T, kv_heads * d)``, the same dtype; query head ``h`` reads key/value head
            ``h // (heads / kv_heads)`` (grouped-query attention).
        phases: ``(*T, [1,] d/2, 2)`` float32, contiguous: each token's rotation (`rotary.rotary_phases`); ``None``:
            nothing rotates.
        lengths: the sequences' lengths, in order (their sum ``N``): sequence ``s`` is the tokens after the first
            ``sum(lengths[:s])``.
        heads: query heads.
        layout: `rotary.rotate`'s pairs, ``"interleaved"`` or ``"half"``.

    Returns:
        The context ``(*T, heads * d)``, contiguous, in the queries' dtype.

    It has no backward: with autograd recording, inputs that require grad are refused.
    """
    return bind_attention(lengths)(query, key, value, phases, heads, scaling, layout, rotate_value)


# A self-attention kernel bound to its sequences' lengths (`bind_attention`):
# run(query, key, value, phases, heads, scaling, layout="interleaved", rotate_value=False).
AttentionKernel = Callable[..., Tensor]


def bind_attention(lengths: Sequence[int]) -> AttentionKernel:
    """`attention` on sequences of `lengths`, checked and laid out now: ``run(query, key, value, phases, heads,
    scaling, layout="interleaved", rotate_value=False)``. For a caller whose layers all attend within the same
    sequences (a model's forward: its attention mask holds one, `masks.create_attention_mask`)."""
    function = _library("attention").few_token_attention
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"few_rows.attention: lengths must be whole numbers >= 0, got {list(lengths)}")
    offsets = (ctypes.c_int64 * (len(lengths) + 1))(0, *itertools.accumulate(lengths))
    tokens, sequences = offsets[-1], len(lengths)

    def run(query: Tensor, key: Tensor, value: Tensor, phases: Tensor | None, heads: int, scaling: float,
            layout: str = "interleaved", rotate_value: bool = False) -> Tensor:
        if layout not in ("interleaved", "half"):
            raise ValueError(f"few_rows.attention: layout={layout!r}; expected 'interleaved' or 'half'")
        head_dim = query.shape[-1] // heads if heads > 0 else 0
        kv_heads = key.shape[-1] // head_dim if head_dim else 0
        multiple = 32 if layout == "half" else 16
        if not head_dim or head_dim % multiple or query.shape[-1] != heads * head_dim or not kv_heads \
                or key.shape[-1] != kv_heads * head_dim or heads % kv_heads or value.shape[-1] != key.shape[-1]:
            raise ValueError(f"few_rows.attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must hold {heads} heads of a size that is a multiple of {multiple} "
                             "(key and value: a number of heads that divides it)")
        if query.dtype not in (torch.float32, torch.bfloat16) or key.dtype != query.dtype \
                or value.dtype != query.dtype or not (query.is_cpu and key.is_cpu and value.is_cpu):
            raise ValueError(f"few_rows.attention: query, key and value must be float32 or bfloat16 on CPU, all "
                             f"alike, got {query.dtype}, {key.dtype}, {value.dtype} on {query.device}")
        if not (query.shape[:-1] == key.shape[:-1] == value.shape[:-1]) or math.prod(query.shape[:-1]) != tokens:
            raise ValueError(f"few_rows.attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                             f"{tuple(value.shape)} must hold the {tokens} tokens of the lengths, alike")
        if phases is not None and (phases.dtype != torch.float32 or not phases.is_cpu or not phases.is_contiguous()
                                   or phases.numel() != tokens * head_dim):
            raise ValueError(f"few_rows.attention: phases must be float32 on CPU, contiguous, {head_dim // 2} pairs "
                             f"for each of the {tokens} tokens, got {tuple(phases.shape)} {phases.dtype}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            raise RuntimeError("few_rows.attention has no backward: call it under torch.no_grad() or "
                               "torch.inference_mode(), or use the model's other attention where gradients are needed")
        (query, q_token), (key, k_token), (value, v_token) = (_token_rows(t) for t in (query, key, value))
        output = query.new_empty(*query.shape[:-1], heads * head_dim)
        function(query.data_ptr(), q_token, head_dim, key.data_ptr(), k_token, head_dim, value.data_ptr(), v_token,
                 head_dim, _address(phases), output.data_ptr(), offsets, sequences, heads, kv_heads, head_dim,
                 scaling, layout == "half", rotate_value, query.dtype == torch.bfloat16, torch.get_num_threads())
        return output
    return run


def _token_rows(tensor: Tensor) -> tuple[Tensor, int]:
    """`tensor` ``(*T, F)`` and the distance between its tokens' rows: its own where each is contiguous and they lie
    a fixed stride apart (a view of a wider projection), else those of a contiguous copy."""
    strides, shape = tensor.stride(), tensor.shape
    if strides[-1] == 1 or shape[-1] == 1:
        step = None  # the stride between consecutive tokens, from the innermost token dimension out
        for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
            if size == 1:
                continue
            if step is None:
                step = stride
                expected = stride * size
            elif stride != expected:
                break
            else:
                expected = stride * size
        else:
            return tensor, shape[-1] if step is None else step
    tensor = tensor.contiguous()
    return tensor, shape[-1]


def _check_operand(function: str, dtype: torch.dtype, name: str, tensor: Tensor | None,
                   shape: tuple[int, ...]) -> None:
    """Refuses, naming it, an operand `function` cannot take: other than `dtype` of its `shape` on CPU."""
    if tensor is not None and (tensor.shape != shape or tensor.dtype != dtype or not tensor.is_cpu):
        raise ValueError(f"few_rows.{function}: {name} must be {str(dtype).removeprefix('torch.')} {shape} on CPU, got "
                         f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")


def _checked_inputs(function: str, dtype: torch.dtype, x: Tensor, in_features: int, residual: Tensor | None,
                    out_features: int, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """`x` and `residual` contiguous, once `function` can take them: `x` of `dtype` on CPU with `in_features`
    features, `residual` of `dtype` on CPU with `x`'s rows of `out_features`; and nothing that requires grad where
    autograd records (the kernels have no backward), `bias` included."""
    if x.dtype != dtype or not x.is_cpu or x.shape[-1] != in_features:
        raise ValueError(f"few_rows.{function}: x must be {str(dtype).removeprefix('torch.')} on CPU with "
                         f"{in_features} features (the packed weight's), got {tuple(x.shape)} {x.dtype} on {x.device}")
    if residual is not None:
        _check_operand(function, dtype, "residual", residual, (*x.shape[:-1], out_features))
    if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in (x, residual, bias)):
        raise RuntimeError(f"few_rows.{function} has no backward: call it under torch.no_grad() or "
                           "torch.inference_mode(), or use nn.functional.linear where gradients are needed")
    return x.contiguous(), None if residual is None else residual.contiguous()


def _contiguous(tensor: Tensor | None) -> Tensor | None:
    """`tensor` as the kernels read it: contiguous (a copy, which the caller holds while the kernel runs, where it is
    not), read at each call, so that a bound kernel sees its operands' later in-place changes."""
    return None if tensor is None else tensor.contiguous()


def _address(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _activation_code(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"few_rows: activation={activation!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


def _library(kernel: str = "fp32") -> ctypes.CDLL:
    """The loaded kernel (`RuntimeError` where it is not available)."""
    library, why = _loaded(kernel)
    if library is None:
        name = "few-row GEMM" if kernel == "fp32" else f"few-row {kernel} GEMM"
        raise RuntimeError(f"roformer_hf's {name} is not available here: {why}")
    return library


def _load(kind: str) -> tuple[ctypes.CDLL | None, str]:
    """The kernel built for `kind` (a key of `SOURCES`), or None and why not."""
    if _turned_off():
        return None, "turned off by ROFORMER_HF_FEW_ROWS=0"
    if not sys.platform.startswith("linux"):
        return None, f"built on Linux only, not {sys.platform}"
    if not cpu_has("avx2", "fma"):
        return None, "the CPU has no AVX2 and FMA"
    if not cpu_has(*NEEDS[kind]):
        return None, f"the CPU lacks {' or '.join(NEEDS[kind])}, which the {kind} kernel needs"
    if "avx512f" in NEEDS[kind] and held_below_avx512():
        return None, "the environment holds oneDNN below AVX-512 (ONEDNN_MAX_CPU_ISA)"
    runtimes = _openmp_runtimes()
    if len(runtimes) != 1:
        return None, f"not one GNU OpenMP runtime (libgomp.so.1) loaded to share torch's threads: {runtimes or 'none'}"
    openmp = runtimes[0]
    source_path = SOURCES[kind]
    if not source_path.is_file():
        return None, f"its source {source_path} is missing (a saved folder's copy of roformer_hf's code carries none)"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return None, "no C++ compiler (set CXX)"
    source = source_path.read_bytes() + b"".join(header.read_bytes()  # what it includes
                                                 for header in sorted(source_path.parent.glob("*.h")))
    flags = FLAGS + EXTRA_FLAGS[kind]
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(), str(openmp).encode(),
                                     torch.__version__.encode()])).hexdigest()[:16]
    try:
        folder = cache_root() / "kernels"
        path = folder / f"few_rows-{key}.so"
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            _build(compiler, source_path, flags, openmp, folder, path)
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return None, str(error)
    if _openmp_runtimes() != runtimes:
        return None, f"the kernel brought a second OpenMP runtime beside torch's ({openmp})"
    if kind.startswith("attention"):
        function, lanes = library.few_token_attention, library.few_token_lanes
        lanes.argtypes, lanes.restype = [], ctypes.c_int
        if lanes() != (16 if kind == "attention AVX-512" else 8):
            return None, f"{path} holds vectors of {lanes()} floats, not those of {kind}"
        function.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
                             + [ctypes.c_int64] * 4 + [ctypes.c_float] + [ctypes.c_int] * 4)
        function.restype = None
        return library, ""
    if kind.endswith("AMX") and not library.few_row_amx_permission():
        return None, "Linux does not grant this process AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM)"
    if kind.startswith("int8"):
        function, tile = library.few_row_int8_linear, library.few_row_int8_tile
        function.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        function.restype = ctypes.c_int
    elif kind.startswith("bf16"):
        function, tile = library.few_row_bf16_linear, library.few_row_bf16_tile
        function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
        function.restype = None
    else:
        function, tile = library.few_row_linear, library.few_row_tile
        function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
        function.restype = None
    tile.argtypes, tile.restype = [], ctypes.c_int
    if tile() != TILES[kind]:
        return None, f"{path} holds tiles of {tile()} features, expected {TILES[kind]} for {kind}"
    return library, ""


def _turned_off() -> bool:
    return os.environ.get("ROFORMER_HF_FEW_ROWS", "1").strip() == "0"


def _build(compiler: str, source: Path, flags: tuple[str, ...], openmp: Path, folder: Path, path: Path) -> None:
    """Compiles `source` with `flags` into `path`, through a file of its own in `folder` renamed into place (processes
    building it at once each write their own)."""
    handle, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
    os.close(handle)
    command = [*shlex.split(compiler), *flags, str(source), "-o", partial, f"-Wl,-rpath,{openmp.parent}"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _openmp_runtimes() -> list[Path]:
    """The GNU OpenMP runtimes loaded under the name the kernel links (``libgomp.so.1``): torch's, where torch runs on
    one. Copies that other wheels bring under names of their own (scikit-learn's ``libgomp-<hash>.so.1``) are theirs."""
    found = set()
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and Path(fields[-1]).name == "libgomp.so.1":
                    found.add(Path(fields[-1]))
    except OSError:
        pass
    return sorted(found)
