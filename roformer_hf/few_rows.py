"""A GEMM for fp32 inputs of few rows on CPUs with AVX2 and FMA or with AVX-512: `linear`, on a weight laid out by
`pack`.

A short input's dense layers wait on their weights: on an AMD EPYC with AVX2 only, oneDNN's GEMM on a packed weight
ran the 16 dense calls of a 16-token forward (4 layers of base width) at 70-82 GFLOP/s where a large product runs at
165 (`benchmarks/RESULTS.md`). This kernel streams the weight through once, in the order `pack` lays it out: tiles of
output features, each tile's entries feature by feature along the input. With AVX2 (`csrc/few_rows_avx2.cpp`, tiles
of 6) the input's rows lie in a vector's lanes and each weight entry is broadcast against them; with AVX-512
(`csrc/few_rows_avx512.cpp`, tiles of 48, three vectors) the weight lies in the lanes and each input entry is broadcast
against it, 8 rows at a time, so that no lane idles at few rows. Either way each output is summed over the input
features in order, whatever the number of rows from 2 up: the same bits in both, and a row's result does not depend
on the rows beside it. One row alone (a decoding step) is summed in interleaved runs, an order of its own.

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

# Each instruction set's source (`isa`) and the output features a tile of its packed weight holds (its `kTile`).
SOURCES = {"AVX2": Path(__file__).with_name("csrc") / "few_rows_avx2.cpp",
           "AVX-512": Path(__file__).with_name("csrc") / "few_rows_avx512.cpp"}
TILES = {"AVX2": 6, "AVX-512": 48}
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")
AVX512_FLAGS = ("-mavx512f",)  # added for the AVX-512 source

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
    does not hold oneDNN below it (``ONEDNN_MAX_CPU_ISA``: the kernel is then AVX2's, as on an AVX2-only CPU), else
    ``"AVX2"``. Each has a source and a packed layout of its own (`SOURCES`, `TILES`)."""
    return "AVX-512" if cpu_has("avx512f") and not held_below_avx512() else "AVX2"


def why_not() -> str:
    """Why `available` is False (``""`` where it is True)."""
    available()
    return str(_state["why_not"])


@dataclass(frozen=True)
class Packed:
    """A weight ``(out_features, in_features)`` laid out for `linear` (`pack`)."""

    tiles: Tensor  # (ceil(out_features / tile), in_features, tile), contiguous; the last tile's missing features zero
    out_features: int


def pack(weight: Tensor) -> Packed:
    """`weight` ``(out_features, in_features)`` laid out for `linear` (a copy), in tiles of the kernel's width
    (`TILES`)."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"few_rows.pack: weight must be a 2-d float32 tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    tile = _library().few_row_tile()
    out_features, in_features = weight.shape
    tiles = -(-out_features // tile)
    padded = weight.new_zeros(tiles * tile, in_features)
    padded[:out_features] = weight
    return Packed(padded.view(tiles, tile, in_features).transpose(1, 2).contiguous(), out_features)


def linear(x: Tensor, packed: Packed, bias: Tensor | None, residual: Tensor | None = None) -> Tensor:
    """``residual + x @ weight.T + bias`` (`residual` and `bias` optional), `packed` being ``pack(weight)``.

    Args:
        x: ``(*, in_features)`` float32 on CPU.
        packed: `pack`'s layout of the weight ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        residual: ``(*, out_features)``, as `x`'s leading dimensions, or None.

    It has no backward: with autograd recording, inputs that require grad are refused.
    """
    library = _library()
    tiles, out_features = packed.tiles, packed.out_features
    in_features = tiles.shape[1]
    if tiles.shape[2] != library.few_row_tile():
        raise ValueError(f"few_rows.linear: packed holds tiles of {tiles.shape[2]} features, this kernel's are "
                         f"{library.few_row_tile()} wide: pack the weight again with few_rows.pack")
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


def _library() -> ctypes.CDLL:
    """The loaded kernel (`RuntimeError` where it is not `available`)."""
    library = _state.get("library") if available() else None
    if library is None:
        raise RuntimeError(f"roformer_hf's few-row GEMM is not available here: {why_not()}")
    return library


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
    kind = isa()
    source_path = SOURCES[kind]
    if not source_path.is_file():
        return None, f"its source {source_path} is missing (a saved folder's copy of roformer_hf's code carries none)"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return None, "no C++ compiler (set CXX)"
    source = source_path.read_bytes()
    flags = FLAGS + (AVX512_FLAGS if kind == "AVX-512" else ())
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
    function = library.few_row_linear
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    function.restype = None
    library.few_row_tile.argtypes, library.few_row_tile.restype = [], ctypes.c_int
    if library.few_row_tile() != TILES[kind]:
        return None, f"{path} holds tiles of {library.few_row_tile()} features, expected {TILES[kind]} for {kind}"
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
