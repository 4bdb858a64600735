"""Timing and report helpers shared by `bench_cpu.py` and `bench_gpu.py` (what they run is in `workload.py`)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from statistics import median

import torch


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_interleaved(runners: dict[str, Callable[[], float]], warmup: int, repeats: int,
                     block: int = 1) -> dict[str, list[float]]:
    """Calls each runner (it returns its own timing) `block` times in a row per repeat, rotating which goes first, so
    drifting load from other processes hits every runner alike. Returns the seconds of the repeats after `warmup`.
    With ``block > 1`` each turn's first call is left out: it pays for the runner before (threads of another
    runtime still spinning, caches holding its weights), which a process serving one model back to back never does."""
    names = list(runners)
    times = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            for call in range(block):
                seconds = runners[name]()
                if repeat >= warmup and (block == 1 or call):
                    times[name].append(seconds)
    return times


def spread(samples: list[float]) -> str:
    return f"{median(samples):.3f} ({min(samples):.3f}–{max(samples):.3f})"


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def bf16_matrix_units(flags: str | set[str]) -> str:
    """The CPU's fast bf16 matrix arithmetic, from its feature flags (the `flags` line of /proc/cpuinfo): "amx"
    (Intel AMX tiles, `amx_bf16`: bf16 GEMMs several times the fp32 rate), "avx512_bf16" (bf16 dot products in
    AVX-512 vectors, `avx512_bf16`: about the fp32 rate) or "none" (bf16 emulated, slower than fp32)."""
    flags = set(flags.split()) if isinstance(flags, str) else flags
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "none"


BF16_UNITS_DESCRIBED = {"amx": "AMX (amx_bf16): bf16 matrix tiles",
                        "avx512_bf16": "AVX-512 bf16 (avx512_bf16), no AMX",
                        "none": "no bf16 matrix instructions (neither amx_bf16 nor avx512_bf16)"}


def int8_matrix_units(flags: str | set[str]) -> str:
    """The CPU's fast int8 matrix arithmetic, from its feature flags: "amx_int8" (AMX tiles), "vnni" (uint8 x int8
    dot products accumulated in int32: `avx512_vnni` or `avx_vnni`) or "none" (AVX2/AVX-512 `vpmaddubsw`, whose
    int16 pair sums saturate unless the weights or activations are kept in range)."""
    flags = set(flags.split()) if isinstance(flags, str) else flags
    if "amx_int8" in flags:
        return "amx_int8"
    if flags & {"avx512_vnni", "avx_vnni"}:
        return "vnni"
    return "none"


def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (Linux; elsewhere `platform`'s name, no flags)."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first core's
    except OSError:
        pass
    return fields.get("model name", platform.processor() or "unknown"), set(fields.get("flags", "").split())


def cpu_bf16_units() -> str:
    """`bf16_matrix_units` of this machine's CPU."""
    return bf16_matrix_units(cpu_info()[1])


# Environment variables that hold the math libraries below the CPU's ISA (e.g. AVX2 kernels on an AVX-512 CPU).
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def native_precisions() -> list[str]:
    """The precisions this CPU computes natively: fp32; bf16 with AVX-512 bf16 or AMX (oneDNN's bf16 GEMMs); int8."""
    return ["fp32", *(["bf16"] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else []), "int8"]


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine_lines() -> list[str]:
    import transformers

    from roformer_hf import cpu as cpu_facts
    from roformer_hf import few_rows, fused

    cpu, flags = cpu_info()
    few_rows_kernel = f"{few_rows.isa()} build" if few_rows.available() else f"not available ({few_rows.why_not()})"
    if few_rows.bf16_available():
        few_rows_kernel += f"; its bf16 kernel: {few_rows.bf16_isa()} build"
    limits = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)]
    cores = available_cores()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return [
        f"- CPU: {cpu}, {cores} cores available, ISA {torch.backends.cpu.get_cpu_capability()}; bf16 matrix "
        f"units: {BF16_UNITS_DESCRIBED[bf16_matrix_units(flags)]}; int8 matrix units: {int8_matrix_units(flags)}"
        + (f"; kernels held below the CPU's ISA: {' '.join(limits)} (fbgemm is not)" if limits else ""),
        f"- torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"- CPU family {cpu_facts.cpu_family()}; dense kernels by the rule `fused.RULE`: {fused.RULE.cpu}; "
        f"`few_rows`' kernel: {few_rows_kernel}",
        f"- load average (1/5/15 min) at the end: {load}",
    ]


def fresh_clone(source: str, commit: str, folder: Path) -> float:
    """Clones `source` (a path or URL) into `folder`, checks out `commit` and builds its `.venv` with `make install`;
    the seconds the build took."""
    subprocess.run(["git", "clone", "--quiet", source, str(folder)], check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=folder, check=True)
    start = time.perf_counter()
    subprocess.run(["make", "install"], cwd=folder, check=True, capture_output=True)
    return time.perf_counter() - start


def add_clone_arguments(parser: argparse.ArgumentParser, runs: int, what: str) -> None:
    """The options of a script that runs a job on fresh clones (`each_fresh_clone`): how many, of which repository
    and commit, and where to keep `what` each run printed."""
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]),
                        help="the repository to clone (a path or URL; default: this one)")
    parser.add_argument("--commit", default="HEAD", help="what each clone checks out")
    parser.add_argument("--logs", type=Path, default=None, help=f"keep each run's {what} here")


def each_fresh_clone(args: argparse.Namespace, prefix: str,
                     run: Callable[[Path, Path | None], dict]) -> Iterator[tuple[int, dict]]:
    """For each of `args.runs` runs, `run(folder, log)` with a new folder to clone into and the file to keep its
    output in (None without `--logs`); yields the run's number and result, and removes the folder after."""
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    for number in range(1, args.runs + 1):
        folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{number}_"))
        try:
            yield number, run(folder / "repo", args.logs / f"{prefix}{number}.log" if args.logs else None)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def short_head(folder: Path) -> str:
    """The abbreviated commit checked out in `folder`."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True,
                          check=True).stdout.strip()


def progress(message: str, _start=time.perf_counter()) -> None:
    """Prints `message` after the seconds since this module was imported (the script's start)."""
    print(f"[{time.perf_counter() - _start:6.1f} s] {message}", flush=True)
