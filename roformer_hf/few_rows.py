"""A GEMM for fp32 inputs of few rows on CPUs with AVX2 and FMA or with AVX-512: `linear`, on a weight laid out by
`pack`.

A short input's dense layers wait on their weights: on an AMD EPYC with AVX2 only, oneDNN's GEMM on a packed weight
ran the 16 dense calls of a 16-token forward (4 layers of base width) at 70-82 GFLOP/s where a large product runs at
165 (`benchmarks/RESULTS.md`). This kernel (`csrc/few_rows.cpp`) puts the input's rows in a vector's lanes (8 a
vector with AVX2, 16 with AVX-512: `isa`) and broadcasts each weight entry once against them, so the weight streams
through once, in the order `pack` lays it out: tiles of `TILE` output features, each tile's entries feature by feature
along the input. Each output is summed over the input features in order, whatever the number of rows from 2 up and
the instruction set, so a row's result does not depend on the rows beside it; one row alone (a decoding step) reads
each tile as whole vectors against the input repeated to its layout, in interleaved sums (4 with AVX2, 8 with
AVX-512).

It is built at first use with the system's C++ compiler (``$CXX``, else ``c++``; about a second) into
``$ROFORMER_HF_CACHE/kernels``, else ``$XDG_CACHE_HOME/roformer_hf/kernels``, else ``~/.cache/roformer_hf/kernels``,
and linked against the OpenMP runtime torch itself runs on, so its threads are torch's (``torch.set_num_threads``).
Where it cannot be (no compiler, no AVX2 or FMA, not Linux, torch without GNU OpenMP), `available` is False, `why_not`
says why (logged once), and dense layers take the CPU kind's other kernels. ``ROFORMER_HF_FEW_ROWS=0`` turns it off
(without the warning).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .cpu import cpu_has, held_below_avx512

logger = logging.getLogger(__name__)

TILE = 6  # output features a tile of the packed weight holds: `kTile` in csrc/few_rows.cpp
SOURCE = Path(__file__).with_name("csrc") / "few_rows.cpp"
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")
AVX512_FLAGS = ("-mavx512f",)  # added where `isa` is AVX-512: 16 lanes a vector, 32 registers

_lock = threading.Lock()
_state: dict[str, object] = {}  # "library" (ctypes.CDLL or None) and "why_not" (str), once decided


def cache_root() -> Path:
    """Where roformer_hf keeps what it builds: ``$ROFORMER_HF_CACHE``, else ``$XDG_CACHE_HOME/roformer_hf``, else
    ``~/.cache/roformer_hf`` (`RuntimeError` where there is no home folder to find)."""
    root = os.environ.get("ROFORMER_HF_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "roformer_hf"
    return Path(root).expanduser()


def available() -> bool:
    """Whether `linear` runs here: the kernel built (at the first call, which builds it) and loaded."""
    if "library" not in _state:
        with _lock:
            if "library" not in _state:
                library, why_not = _load()
                if library is None and not _turned_off():
                    logger.warning("roformer_hf's few-row GEMM is not available (%s): dense layers of few rows take "
                                   "oneDNN's kernel instead", why_not)
                _state.update(library=library, why_not=why_not)
    return _state["library"] is not None


def isa() -> str:
    """The instruction set the kernel is built for here: ``"AVX-512"`` where the CPU has AVX-512F and the environment
    does not hold oneDNN below it (``ONEDNN_MAX_CPU_ISA``: the kernel then runs the AVX2 code, as an AVX2-only CPU
    would), else ``"AVX2"``."""
    return "AVX-512" if cpu_has("avx512f") and not held_below_avx512() else "AVX2"


def why_not() -> str:
    """Why `available` is False (``""`` where it is True)."""
    available()
    return str(_state["why_not"])


@dataclass(frozen=True)
class Packed:
    """A weight ``(out_features, in_features)`` laid out for `linear` (`pack`)."""

    tiles: Tensor  # (ceil(out_features / TILE), in_features, TILE), contiguous; the last tile's missing features zero
    out_features: int


def pack(weight: Tensor) -> Packed:
    """`weight` ``(out_features, in_features)`` laid out for `linear` (a copy)."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"few_rows.pack: weight must be a 2-d float32 tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    out_features, in_features = weight.shape
    tiles = -(-out_features // TILE)
    padded = weight.new_zeros(tiles * TILE, in_features)
    padded[:out_features] = weight
    return Packed(padded.view(tiles, TILE, in_features).transpose(1, 2).contiguous(), out_features)


def linear(x: Tensor, packed: Packed, bias: Tensor | None, residual: Tensor | None = None) -> Tensor:
    """``residual + x @ weight.T + bias`` (`residual` and `bias` optional), `packed` being ``pack(weight)``.

    Args:
        x: ``(*, in_features)`` float32 on CPU.
        packed: `pack`'s layout of the weight ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        residual: ``(*, out_features)``, as `x`'s leading dimensions, or None.

    It has no backward: with autograd recording, inputs that require grad are refused.
    """
    library = _state.get("library") if available() else None
    if library is None:
        raise RuntimeError(f"roformer_hf's few-row GEMM is not available here: {why_not()}")
    tiles, out_features = packed.tiles, packed.out_features
    in_features = tiles.shape[1]
    if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1] != in_features:
        raise ValueError(f"few_rows.linear: x must be float32 on CPU with {in_features} features (the packed "
                         f"weight's), got {tuple(x.shape)} {x.dtype} on {x.device}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32 or not bias.is_cpu):
        raise ValueError(f"few_rows.linear: bias must be float32 ({out_features},) on CPU, got {tuple(bias.shape)} "
                         f"{bias.dtype} on {bias.device}")
    leading = x.shape[:-1]
    if residual is not None and (residual.shape != (*leading, out_features) or residual.dtype != torch.float32
                                 or not residual.is_cpu):
        raise ValueError(f"few_rows.linear: residual must be float32 {(*leading, out_features)} on CPU, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in (x, bias, residual)):
        raise RuntimeError("few_rows.linear has no backward: call it under torch.no_grad() or "
                           "torch.inference_mode(), or use nn.functional.linear where gradients are needed")
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    residual = None if residual is None else residual.contiguous()
    output = x.new_empty(*leading, out_features)
    library.few_row_linear(x.data_ptr(), tiles.data_ptr(), None if bias is None else bias.data_ptr(),
                           None if residual is None else residual.data_ptr(), output.data_ptr(),
                           math.prod(leading), out_features, in_features, torch.get_num_threads())
    return output


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The built kernel, or None and why not."""
    if _turned_off():
        return None, "turned off by ROFORMER_HF_FEW_ROWS=0"
    if not sys.platform.startswith("linux"):
        return None, f"built on Linux only, not {sys.platform}"
    if not cpu_has("avx2", "fma"):
        return None, "the CPU has no AVX2 and FMA"
    runtimes = _openmp_runtimes()
    if len(runtimes) != 1:
        return None, f"not one GNU OpenMP runtime (libgomp.so.1) loaded to share torch's threads: {runtimes or 'none'}"
    openmp = runtimes[0]
    if not SOURCE.is_file():
        return None, f"its source {SOURCE} is missing (a saved folder's copy of roformer_hf's code carries none)"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return None, "no C++ compiler (set CXX)"
    source = SOURCE.read_bytes()
    flags = FLAGS + (AVX512_FLAGS if isa() == "AVX-512" else ())
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(), str(openmp).encode(),
                                     torch.__version__.encode()])).hexdigest()[:16]
    try:
        folder = cache_root() / "kernels"
        path = folder / f"few_rows-{key}.so"
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            _build(compiler, flags, openmp, folder, path)
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return None, str(error)
    if _openmp_runtimes() != runtimes:
        return None, f"the kernel brought a second OpenMP runtime beside torch's ({openmp})"
    function = library.few_row_linear
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    function.restype = None
    return library, ""


def _turned_off() -> bool:
    return os.environ.get("ROFORMER_HF_FEW_ROWS", "1").strip() == "0"


def _build(compiler: str, flags: tuple[str, ...], openmp: Path, folder: Path, path: Path) -> None:
    """Compiles `SOURCE` with `flags` into `path`, through a file of its own in `folder` renamed into place (processes
    building it at once each write their own)."""
    handle, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
    os.close(handle)
    command = [*shlex.split(compiler), *flags, str(SOURCE), "-o", partial, f"-Wl,-rpath,{openmp.parent}"]
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
