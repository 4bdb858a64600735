"""CPU benchmark: roformer_hf against transformers' RoFormer, the same weights in both, in one run.

    python benchmarks/bench_cpu.py            # the CPU targets (a few minutes on 2 cores)
    python benchmarks/bench_cpu.py --quick    # tiny smoke configuration (seconds)

What it does:
1. Builds transformers' `RoFormerForMaskedLM` (eager attention, its only kernel; dropout 0 so outputs can be
   compared), saves it, and loads the folder with `roformer_hf.RoFormerForMaskedLM.from_pretrained`.
2. Checks logits equal at real tokens (fails above --tolerance), and compares the MLM loss and gradients.
3. Times an inference forward (`torch.inference_mode`) and a training step (forward + `loss.backward()`, gradients
   zeroed outside the timed region) of both models, interleaved, alternating which goes first; reports medians.
4. Measures the fp32 GEMM rate of the shapes the model runs (`torch.mm`, real-token rows); the reference is the
   largest, the FFN expansion, sampled again between the model runs so it sees the same machine load. Counts the
   model's real-token FLOPs analytically (`workload.forward_flops`) and reports achieved GFLOP/s as % of that
   rate; a training step counts 3x the forward FLOPs.
5. Measures peak memory for one long sequence (default 4096 tokens) in a fresh subprocess per model and mode;
   see `PeakRSS` for the method.
6. Prints markdown tables to paste into benchmarks/RESULTS.md.

Timings are medians of --repeats after --warmup; on a shared machine re-run if min and max are far apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from statistics import median

import torch

from common import machine_lines, progress, spread, time_interleaved, time_once, verdict
from workload import (add_size_arguments, allocator_line, forward_flops, infer, keep_freed_memory, load_model,
                      padded_batch, parse_args, size_of, sparse_head_forward_flops, train_step, transformers_config)

TARGETS = {"infer speed-up": 2.0, "train speed-up": 2.2, "gemm fraction": 0.85, "memory ratio": 1 / 3}
SIDES = ("transformers", "roformer_hf")


# ---------------------------------------------------------------------------------------------------- models

def check_parity(models: dict, batch, tolerance: float) -> dict[str, float]:
    """Logits at real tokens must agree within `tolerance`; also reports the loss and gradient differences."""
    real = batch[1].bool()
    reference, ours = (infer(models[side], batch)[real] for side in SIDES)
    logits_diff = (reference - ours).abs().max().item()
    if not logits_diff <= tolerance:
        raise SystemExit(f"FAIL: logits differ at real tokens by {logits_diff:.3g} > tolerance {tolerance:g}")

    losses = {}
    for side in SIDES:
        models[side].train()
        models[side].zero_grad(set_to_none=True)
        losses[side] = train_step(models[side], batch).item()
    grads = {side: dict(models[side].named_parameters()) for side in SIDES}
    grad_diff, grad_scale = 0.0, 0.0
    for name, param in grads["roformer_hf"].items():
        reference_grad = grads["transformers"][name].grad
        grad_diff = max(grad_diff, (param.grad - reference_grad).abs().max().item())
        grad_scale = max(grad_scale, reference_grad.abs().max().item())
    loss_diff = abs(losses["transformers"] - losses["roformer_hf"])
    if not loss_diff <= tolerance * max(1.0, abs(losses["transformers"])):
        raise SystemExit(f"FAIL: MLM losses differ: {losses}")
    return {"logits": logits_diff, "loss": loss_diff, "grad": grad_diff, "grad_scale": grad_scale}


# ---------------------------------------------------------------------------------------------------- timing

class Gemm:
    """`torch.mm` of fp32 (M x K) @ (K x N), repeated enough times per sample (~0.05 s) to time reliably."""

    def __init__(self, m: int, k: int, n: int):
        self.flops = 2 * m * k * n
        self.a, self.b, self.out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
        self.inner = 1
        while self.sample() * self.inner < 0.05:  # doubles as the warm-up
            self.inner *= 2

    def sample(self) -> float:
        """Seconds per product."""
        start = time.perf_counter()
        for _ in range(self.inner):
            torch.mm(self.a, self.b, out=self.out)
        return (time.perf_counter() - start) / self.inner

    def gflops(self, samples: list[float]) -> float:
        return self.flops / median(samples) / 1e9


def timed_step(model, step, batch) -> float:
    model.zero_grad(set_to_none=True)  # outside the timed region
    return time_once(lambda: step(model, batch))


# ---------------------------------------------------------------------------------------------------- memory

def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak resident set size of this process while the block runs, above the resident size when it starts.

    Resident memory sees every allocation torch makes (tracemalloc does not). On Linux the kernel's high-water
    mark (VmHWM) is reset on entry through /proc/self/clear_refs and read on exit: exact, no sampling. Elsewhere a
    thread samples RSS every millisecond (can miss short spikes). Run it in a fresh process with glibc's mmap
    threshold fixed low (see `measure_memory`), so freed buffers go back to the OS and RSS follows live tensors.
    """

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.baseline = _proc_status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            self.method = "VmHWM"
        except OSError:
            import psutil
            process, self.method, self._stop = psutil.Process(), "RSS sampled every 1 ms", threading.Event()
            self.baseline, self._sampled = process.memory_info().rss, 0

            def sample():
                while not self._stop.wait(0.001):
                    self._sampled = max(self._sampled, process.memory_info().rss)
            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "VmHWM":
            self.peak = _proc_status("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            self.peak = self._sampled
        self.extra = self.peak - self.baseline


def memory_worker(args: argparse.Namespace) -> None:
    """Subprocess entry: peak memory of one model (`args.side`) in one mode on one sequence; prints JSON."""
    model = load_model(args.side, args.folder, args.attn)
    step = infer if args.mode == "infer" else train_step
    model.train(args.mode == "train")
    lengths = (min(16, args.memory_length), args.memory_length)
    short, full = (padded_batch((n,), args.vocab, args.seed) for n in lengths)
    step(model, short)  # one-off allocations (thread pools, kernel caches, .grad buffers) before the baseline
    model.zero_grad(set_to_none=False)  # keep .grad allocated: like the weights, it does not grow with length
    with PeakRSS() as peak:
        step(model, full)
    print(json.dumps({"extra": peak.extra, "baseline": peak.baseline, "method": peak.method}))


def measure_memory(side: str, mode: str, folder: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    command = [sys.executable, __file__, "--memory-worker", "--side", side, "--mode", mode, "--folder", folder,
               "--memory-length", str(args.memory_length), "--vocab", str(args.vocab), "--attn", args.attn,
               "--seed", str(args.seed), "--threads", str(torch.get_num_threads())]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"memory worker {side}/{mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------- report

def batch_labels(args) -> torch.Tensor:
    return padded_batch(args.lengths, args.vocab, args.seed)[2]


def report(args, size, flops, parity, times, rates, reference_gemm, memory) -> None:
    tokens, padded = sum(args.lengths), len(args.lengths) * max(args.lengths)
    total = sum(flops.values())
    print("\n## roformer_hf vs transformers' RoFormer, CPU fp32\n")
    print(f"Model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}, "
          f"vocab {size.vocab}, MLM head. Batch: {len(args.lengths)} sequences of "
          f"{'/'.join(map(str, args.lengths))} tokens, right-padded to {max(args.lengths)} "
          f"({tokens} real of {padded}, {tokens / padded:.0%}). roformer_hf attention: {args.attn}. "
          f"Allocator: {allocator_line(args)}.\n")
    print("| measurement | transformers | roformer_hf | ratio | target | met |")
    print("|---|---|---|---|---|---|")
    for mode, label, key in (("infer", "inference forward", "infer speed-up"),
                             ("train", "training step (forward + backward)", "train speed-up")):
        if mode not in times:
            continue
        ratio = median(times[mode]["transformers"]) / median(times[mode]["roformer_hf"])
        print(f"| {label}, s: median (min–max) of {args.repeats} | {spread(times[mode]['transformers'])} | "
              f"{spread(times[mode]['roformer_hf'])} | speed-up {ratio:.2f}x | ≥ {TARGETS[key]}x | "
              f"{verdict(ratio >= TARGETS[key])} |")
    # transformers computes every padded position too: its own FLOPs are those of B full-length sequences.
    padded_total = sum(forward_flops(size, (max(args.lengths),) * len(args.lengths)).values())
    print(f"| forward GFLOP: what each computes (transformers includes padding) | {padded_total / 1e9:.1f} | "
          f"{total / 1e9:.1f} | {padded_total / total:.2f}x: skipping padding alone, at equal GFLOP/s | | |")
    labelled = int((batch_labels(args) != -100).sum())
    # What roformer_hf computes in a training step: with sparse prediction the head sees the labelled tokens only.
    train_total = total if args.dense_prediction else sparse_head_forward_flops(flops, tokens, labelled)
    for mode, label, multiple in (("infer", "inference", 1), ("train", "training", 3)):
        if mode not in times:
            continue
        achieved = {side: multiple * total / median(times[mode][side]) / 1e9 for side in SIDES}
        if mode == "train":
            achieved["roformer_hf"] = multiple * train_total / median(times[mode]["roformer_hf"]) / 1e9
        padded_rate = multiple * padded_total / median(times[mode]["transformers"]) / 1e9
        fraction = achieved["roformer_hf"] / reference_gemm
        print(f"| {label}: real-token GFLOP/s (% of GEMM rate {reference_gemm:.0f}); transformers on its own "
              f"FLOPs | {achieved['transformers']:.1f} ({achieved['transformers'] / reference_gemm:.0%}); "
              f"{padded_rate:.1f} ({padded_rate / reference_gemm:.0%}) | {achieved['roformer_hf']:.1f} "
              f"({fraction:.0%}) | | ≥ {TARGETS['gemm fraction']:.0%} (roformer_hf) | "
              f"{verdict(fraction >= TARGETS['gemm fraction'])} |")
    for mode, label in (("infer", "inference"), ("train", "training step")):
        if mode not in memory:
            continue
        mb = {side: memory[mode][side]["extra"] / 2**20 for side in SIDES}
        ratio = mb["roformer_hf"] / mb["transformers"]
        print(f"| peak memory above weights, 1 x {args.memory_length} tokens, {label}, MiB | "
              f"{mb['transformers']:.0f} | {mb['roformer_hf']:.0f} | roformer_hf / transformers {ratio:.3f} | "
              f"≤ {TARGETS['memory ratio']:.3f} | "
              f"{verdict(ratio <= TARGETS['memory ratio'])} |")
    print(f"| max abs logit difference at real tokens | | {parity['logits']:.2e} | | ≤ {args.tolerance:g} | yes |")
    print(f"| MLM loss difference; max abs gradient difference (largest gradient) | | {parity['loss']:.2e}; "
          f"{parity['grad']:.2e} ({parity['grad_scale']:.2e}) | | | |")

    print(f"\nReal-token FLOPs of one forward: {total / 1e9:.1f} GFLOP (" +
          ", ".join(f"{name} {value / total:.0%}" for name, value in flops.items()) +
          "); the decoder counts on every real token, a training step counts 3x the forward"
          + ("." if args.dense_prediction else
             f"; roformer_hf's training step runs the MLM head on the {labelled} labelled tokens only "
             f"(sparse_prediction), {train_total / 1e9:.1f} GFLOP per forward, and its rate is counted on that."))
    print("\nfp32 GEMM rate of the model's shapes with the real tokens as rows, torch.mm, median of repeats:\n")
    print("| shape | GFLOP/s |\n|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")
    if memory:
        method = next(iter(next(iter(memory.values())).values()))["method"]
        print(f"\nPeak memory: a fresh process per model and mode, peak resident memory ({method}) above the "
              "resident size after loading the model and a short warm-up step (weights and .grad buffers "
              "excluded, identical in both); glibc's mmap threshold fixed at 64 KiB so freed tensors leave RSS. "
              "transformers' RoFormer needs max_position_embeddings ≥ the length; its checkpoint has "
              f"{max(args.memory_length, max(args.lengths))}.")
    print("\nMachine:\n")
    print("\n".join(machine_lines()))


# ---------------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per model and mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per model and mode first")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="roformer_hf's attention")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max abs logit difference allowed")
    parser.add_argument("--dense-prediction", action="store_true",
                        help="roformer_hf's MLM head on every token in training too (default: labelled tokens only)")
    parser.add_argument("--skip-train", action="store_true", help="time the inference forward only")
    parser.add_argument("--skip-memory", action="store_true", help="skip the long-sequence memory measurement")
    parser.add_argument("--skip-memory-train", action="store_true", help="measure inference memory only")
    parser.add_argument("--memory-length", type=int, default=4096)
    # Internal: the memory subprocess.
    parser.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("infer", "train"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = parse_args(build_parser())
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if args.memory_worker:
        return memory_worker(args)
    if args.keep_freed_memory:
        keep_freed_memory()  # timing only: the memory measurement runs in subprocesses with settings of its own

    size = size_of(args)
    batch = padded_batch(args.lengths, args.vocab, args.seed)
    flops = forward_flops(size, args.lengths)
    tokens = sum(args.lengths)

    with tempfile.TemporaryDirectory(prefix="roformer_bench_") as folder:
        from transformers import RoFormerForMaskedLM

        torch.manual_seed(args.seed)
        max_positions = max(args.memory_length, max(args.lengths))
        RoFormerForMaskedLM(transformers_config(size, max_positions)).save_pretrained(folder)
        models = {side: load_model(side, folder, args.attn, not args.dense_prediction).eval() for side in SIDES}

        progress("checking outputs")
        parity = check_parity(models, batch, args.tolerance)
        print(f"  max abs logit diff {parity['logits']:.2e}, loss diff {parity['loss']:.2e}, "
              f"max abs grad diff {parity['grad']:.2e}", flush=True)

        progress("fp32 GEMM rate")
        h, i, v = size.hidden, size.intermediate, size.vocab
        shapes = {f"({tokens} x {h}) @ ({h} x {i}), FFN up": (tokens, h, i),
                  f"({tokens} x {i}) @ ({i} x {h}), FFN down": (tokens, i, h),
                  f"({tokens} x {h}) @ ({h} x {h}), q/k/v/output": (tokens, h, h),
                  f"({tokens} x {h}) @ ({h} x {v}), decoder": (tokens, h, v)}
        gemms = {name: Gemm(*shape) for name, shape in shapes.items()}
        rates = {name: gemm.gflops([gemm.sample() for _ in range(max(10, args.repeats))])
                 for name, gemm in gemms.items()}
        # The reference rate (FFN up, the model's largest GEMM) is also sampled between the model runs below, so
        # that it sees the same machine load as they do.
        reference = gemms[next(iter(shapes))]

        times, gemm_samples = {}, []
        modes = {"infer": infer} if args.skip_train else {"infer": infer, "train": train_step}
        for mode, step in modes.items():
            progress(f"timing {'inference forward' if mode == 'infer' else 'training step'}")
            for model in models.values():
                model.train(mode == "train")
            runners = {side: (lambda side=side: timed_step(models[side], step, batch)) for side in SIDES}
            times[mode] = time_interleaved({**runners, "gemm": reference.sample}, args.warmup, args.repeats)
            gemm_samples += times[mode].pop("gemm")
        reference_gemm = reference.gflops(gemm_samples)
        rates["FFN up again, sampled between the model runs: the reference"] = reference_gemm
        del models
        gc.collect()

        memory = {}
        if not args.skip_memory:
            modes = ("infer",) if args.skip_memory_train else ("infer", "train")
            for mode in modes:
                progress(f"peak memory, {args.memory_length} tokens, {mode}")
                memory[mode] = {side: measure_memory(side, mode, folder, args) for side in SIDES}

    progress("done")
    report(args, size, flops, parity, times, rates, reference_gemm, memory)


if __name__ == "__main__":
    main()
