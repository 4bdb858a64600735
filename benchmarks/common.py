"""Timing and report helpers shared by `bench_cpu.py` and `bench_gpu.py` (what they run is in `workload.py`)."""

from __future__ import annotations

import os
import platform
import time
from statistics import median
from typing import Callable

import torch


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_interleaved(runners: dict[str, Callable[[], float]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Calls each runner (it returns its own timing) once per repeat, rotating which goes first, so drifting load
    from other processes hits every runner alike. Returns the seconds of the repeats after `warmup`."""
    names = list(runners)
    times = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = runners[name]()
            if repeat >= warmup:
                times[name].append(seconds)
    return times


def spread(samples: list[float]) -> str:
    return f"{median(samples):.3f} ({min(samples):.3f}–{max(samples):.3f})"


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def machine_lines() -> list[str]:
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return [
        f"- CPU: {cpu}, {cores} cores available, ISA {torch.backends.cpu.get_cpu_capability()}",
        f"- torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"- load average (1/5/15 min) at the end: {load}",
    ]


def progress(message: str, _start=time.perf_counter()) -> None:
    """Prints `message` after the seconds since this module was imported (the script's start)."""
    print(f"[{time.perf_counter() - _start:6.1f} s] {message}", flush=True)
