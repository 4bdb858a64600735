"""CPU benchmark: roformer_hf against transformers' RoFormer and ONNX Runtime, the same weights in all, in one run.

    python benchmarks/bench_cpu.py                 # the fp32 CPU targets (a few minutes on 2 cores)
    python benchmarks/bench_cpu.py --dtype bf16    # the bf16 targets (bf16 weights in both models)
    python benchmarks/bench_cpu.py --quick         # tiny smoke configuration (seconds)

What it does:
1. Builds transformers' `RoFormerForMaskedLM` (eager attention, its only kernel; dropout 0 so outputs can be
   compared), saves it, and loads the folder with `roformer_hf.RoFormerForMaskedLM.from_pretrained`.
2. Checks logits equal at real tokens in fp32 (fails above --tolerance), and compares the MLM loss and gradients.
   With `--dtype bf16` both models are then loaded again with bf16 weights, and the relative error of each one's
   bf16 logits against the fp32 logits is reported (roformer_hf's must stay within transformers' own bf16 error).
3. Exports transformers' RoFormer and roformer_hf (fp32) to ONNX and runs them in ONNX Runtime
   (`onnx_runtime.py`); checks their logits against transformers' eager ones. Skipped when the `onnx` extra is
   missing (--skip-onnx skips it anyway).
4. Times an inference forward (`torch.inference_mode`) and a training step (forward + `loss.backward()`, gradients
   zeroed outside the timed region; in bf16 the weights and gradients are bf16, no autocast) of both models,
   interleaved with the ONNX Runtime sessions (inference), alternating which goes first; reports medians.
5. Measures the GEMM rate in --dtype of the shapes the model runs (real-token rows) with MKL's kernel (`torch.mm`,
   what `nn.Linear` and autograd run) and oneDNN's (what roformer_hf's `fused_linear` runs in inference); the
   reference is the largest, the FFN expansion, sampled again between the model runs so it sees the same machine
   load, with the kernel the step runs (inference: oneDNN, or MKL where the CPU's dense rule, `fused.RULE`, hands
   the batch's rows to it; training: MKL). Counts
   the model's real-token FLOPs analytically (`workload.forward_flops`) and reports achieved GFLOP/s as % of that
   rate; a training step counts 3x the forward FLOPs.
6. Measures peak memory for one long sequence (default 4096 tokens) in a fresh subprocess per model and mode;
   see `PeakRSS` for the method.
7. Prints markdown tables to paste into benchmarks/RESULTS.md, with the CPU's bf16 matrix units: the bf16 targets
   assume AMX; without it they are reported as not applicable (with what they would have been).

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

import onnx_runtime
import torch
from common import cpu_bf16_units, machine_lines, progress, spread, time_interleaved, time_once, verdict
from workload import (
    DTYPES,
    allocator_line,
    forward_flops,
    infer,
    keep_freed_memory,
    load_model,
    padded_batch,
    parse_args,
    size_of,
    sparse_head_forward_flops,
    timing_parser,
    train_step,
    transformers_config,
)

from roformer_hf import fused  # after workload, which puts this checkout first on sys.path

# Per dtype; the bf16 ones assume bf16 matrix units (AMX). "onnx speed-up": roformer_hf's forward over ONNX Runtime's
# fp32 one (transformers' graph). A missing key: no target in that dtype.
TARGETS = {
    "fp32": {"infer speed-up": 2.0, "train speed-up": 2.2, "gemm fraction": 0.85, "train gemm fraction": 0.85,
             "memory ratio": 1 / 3, "onnx speed-up": 1.0},
    "bf16": {"infer speed-up": 5.0, "train speed-up": 4.0, "gemm fraction": 0.65, "onnx speed-up": 3.0},
}
SIDES = ("transformers", "roformer_hf")
ONNX_SIDES = {"onnx transformers": "transformers", "onnx roformer_hf": "roformer_hf"}
ONNX_LABELS = {"onnx transformers": "transformers' RoFormer", "onnx roformer_hf": "roformer_hf"}


# ---------------------------------------------------------------------------------------------------- models

def check_parity(models: dict, batch, tolerance: float) -> dict[str, float]:
    """Logits at real tokens must agree within `tolerance`; also reports the loss and gradient differences, and
    returns transformers' logits at the real tokens (`"reference"`) for the other checks."""
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
    return {"logits": logits_diff, "loss": loss_diff, "grad": grad_diff, "grad_scale": grad_scale,
            "reference": reference, "fp32 loss": losses["transformers"]}


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """``||logits - reference|| / ||reference||`` (Frobenius norms, in fp32)."""
    return ((logits.float() - reference).norm() / reference.norm()).item()


def check_low_precision(models: dict, batch, parity: dict) -> dict[str, dict[str, float]]:
    """Each model's logits in its low-precision dtype against the fp32 logits at real tokens, and its MLM loss.
    roformer_hf must not be far less accurate than transformers in the same dtype (it rotates and attends
    differently): it fails above 1.5x transformers' relative error (and 0.05)."""
    real = batch[1].bool()
    errors = {}
    for side in SIDES:
        logits = infer(models[side], batch)[real]
        with torch.inference_mode():
            loss = models[side](batch[0], attention_mask=batch[1], labels=batch[2]).loss.item()
        errors[side] = {"relative": relative_error(logits, parity["reference"]),
                        "max abs": (logits.float() - parity["reference"]).abs().max().item(),
                        "loss": loss}
    if not errors["roformer_hf"]["relative"] <= max(1.5 * errors["transformers"]["relative"], 0.05):
        raise SystemExit(f"FAIL: roformer_hf's low-precision logits are far less accurate than transformers': {errors}")
    return errors


def onnx_contenders(models: dict, batch, folder: str, parity: dict) -> tuple[dict, dict]:
    """Both fp32 models exported and loaded in ONNX Runtime (`onnx_runtime.py`), keyed as `ONNX_SIDES`, and what
    the report says about each: export and session times, max abs logit difference to transformers' eager."""
    real = batch[1].bool()
    sessions, facts = {}, {}
    for name, side in ONNX_SIDES.items():
        path = os.path.join(folder, f"{side}.onnx")
        export_seconds = onnx_runtime.export(models[side], batch, path)
        sessions[name] = onnx_runtime.OrtModel(path, torch.get_num_threads())
        difference = (sessions[name].logits(batch)[real] - parity["reference"]).abs().max().item()
        facts[name] = {"export": export_seconds, "load": sessions[name].load_seconds, "logits": difference}
        print(f"  {name}: exported in {export_seconds:.1f} s, session in {sessions[name].load_seconds:.1f} s, "
              f"max abs logit difference to transformers' eager {difference:.2e}", flush=True)
    return sessions, facts


# ---------------------------------------------------------------------------------------------------- timing

GEMM_KERNELS = ("torch.mm", "oneDNN")  # MKL's GEMM, as nn.Linear runs it; oneDNN's, as roformer_hf's `fused_linear`


def gemm_kernels(dtype: torch.dtype) -> tuple[str, ...]:
    """The `GEMM_KERNELS` that compute `dtype` here: MKL's always; oneDNN's where PyTorch has it and it computes
    `dtype` on this CPU (bf16: AVX-512 bf16 or AMX), as `fused.fused_linear` takes it."""
    return GEMM_KERNELS if fused._KERNEL is not None and dtype in fused._KERNEL_DTYPES else GEMM_KERNELS[:1]


class Gemm:
    """(M x K) @ (K x N) in `dtype` with one of `GEMM_KERNELS`, repeated enough times per sample (~0.05 s) to time
    reliably."""

    def __init__(self, m: int, k: int, n: int, dtype: torch.dtype = torch.float32, kernel: str = "torch.mm"):
        self.flops = 2 * m * k * n
        self.a, self.b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        self.out = torch.empty(m, n, dtype=dtype)
        if kernel == "oneDNN":
            weight = self.b.t().contiguous()  # (N, K), as a linear layer holds it
            self.product = lambda: torch.ops.mkldnn._linear_pointwise(self.a, weight, None, "none", [], "")
        else:
            self.product = lambda: torch.mm(self.a, self.b, out=self.out)
        self.inner = 1
        while self.sample() * self.inner < 0.05:  # doubles as the warm-up
            self.inner *= 2

    def sample(self) -> float:
        """Seconds per product."""
        start = time.perf_counter()
        for _ in range(self.inner):
            self.product()
        return (time.perf_counter() - start) / self.inner

    def gflops(self, samples: list[float]) -> float:
        return self.flops / median(samples) / 1e9


def timed_step(model, step, batch) -> float:
    model.zero_grad(set_to_none=True)  # outside the timed region
    return time_once(lambda: step(model, batch))


# ---------------------------------------------------------------------------------------------------- memory

def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
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
            with open("/proc/self/clear_refs", "w", encoding="utf-8") as clear_refs:
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
    model = load_model(args.side, args.folder, args.attn, dtype=DTYPES[args.dtype])
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
               "--seed", str(args.seed), "--threads", str(torch.get_num_threads()), "--dtype", args.dtype]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"memory worker {side}/{mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------- report

def batch_labels(args) -> torch.Tensor:
    return padded_batch(args.lengths, args.vocab, args.seed)[2]


class Judge:
    """Target verdicts for one dtype: the bf16 targets assume AMX; without it they read "n/a", with what they would
    have been."""

    def __init__(self, dtype: str, bf16_units: str):
        self.targets = TARGETS[dtype]
        self.applies = dtype == "fp32" or bf16_units == "amx"

    def __call__(self, ok: bool) -> str:
        return verdict(ok) if self.applies else f"n/a (no AMX; {'met' if ok else 'not met'} here)"


def report(args, size, flops, parity, low_precision, onnx, times, rates, reference_gemm, memory,
           compile_seconds) -> None:
    tokens, padded = sum(args.lengths), len(args.lengths) * max(args.lengths)
    total = sum(flops.values())
    units = cpu_bf16_units()
    judge, targets = Judge(args.dtype, units), TARGETS[args.dtype]
    print(f"\n## roformer_hf vs transformers' RoFormer, CPU {args.dtype}\n")
    print(f"Model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}, "
          f"vocab {size.vocab}, MLM head, dropout 0. Weights and activations: {args.dtype}"
          f"{' (bf16 weights, no autocast; training updates bf16 gradients)' if args.dtype == 'bf16' else ''}. "
          f"Batch: {len(args.lengths)} sequences of "
          f"{'/'.join(map(str, args.lengths))} tokens, right-padded to {max(args.lengths)} "
          f"({tokens} real of {padded}, {tokens / padded:.0%}). roformer_hf attention: {args.attn}"
          f"{compiled_line(compile_seconds, args.compile_backend)}. "
          f"Allocator: {allocator_line(args)}. CPU bf16 matrix units: {units}"
          f"{'' if judge.applies else ' (the bf16 targets assume AMX: not applicable here)'}.\n")
    print("| measurement | transformers | roformer_hf | ratio | target | met |")
    print("|---|---|---|---|---|---|")
    for mode, label, key in (("infer", "inference forward", "infer speed-up"),
                             ("train", "training step (forward + backward)", "train speed-up")):
        if mode not in times:
            continue
        ratio = median(times[mode]["transformers"]) / median(times[mode]["roformer_hf"])
        print(f"| {label}, {args.dtype}, s: median (min–max) of {args.repeats} | {spread(times[mode]['transformers'])} | "
              f"{spread(times[mode]['roformer_hf'])} | speed-up {ratio:.2f}x | ≥ {targets[key]}x | "
              f"{judge(ratio >= targets[key])} |")
    # transformers computes every padded position too: its own FLOPs are those of B full-length sequences.
    padded_total = sum(forward_flops(size, (max(args.lengths),) * len(args.lengths)).values())
    print(f"| forward GFLOP: what each computes (transformers includes padding) | {padded_total / 1e9:.1f} | "
          f"{total / 1e9:.1f} | {padded_total / total:.2f}x: skipping padding alone, at equal GFLOP/s | | |")
    labelled = int((batch_labels(args) != -100).sum())
    # What roformer_hf computes in a training step: with sparse prediction the head and the last layer's queries
    # see the labelled tokens only.
    train_total = total if args.dense_prediction else sparse_head_forward_flops(flops, tokens, labelled, size)
    for mode, label, multiple, key in (("infer", "inference", 1, "gemm fraction"),
                                       ("train", "training", 3, "train gemm fraction")):
        if mode not in times:
            continue
        seconds = {side: median(times[mode][side]) for side in SIDES}
        ours = multiple * (train_total if mode == "train" else total)  # the FLOPs roformer_hf computes
        achieved = {"transformers": multiple * total / seconds["transformers"] / 1e9,
                    "roformer_hf": ours / seconds["roformer_hf"] / 1e9}
        padded_rate = multiple * padded_total / seconds["transformers"] / 1e9
        kernel, reference = reference_gemm[mode]
        fraction = achieved["roformer_hf"] / reference
        target = (f"≥ {targets[key]:.0%} (roformer_hf) | {judge(fraction >= targets[key])}" if key in targets
                  else "| ")
        print(f"| {label}: real-token GFLOP/s (% of {kernel}'s {args.dtype} GEMM rate {reference:.0f}); transformers "
              f"on its own FLOPs | {achieved['transformers']:.1f} ({achieved['transformers'] / reference:.0%}); "
              f"{padded_rate:.1f} ({padded_rate / reference:.0%}) | {achieved['roformer_hf']:.1f} "
              f"({fraction:.0%}) | | {target} |")
        # roformer_hf's FLOPs at 100% of the reference GEMM rate against transformers' time: about the most any
        # implementation of them could have shown in this run (the other GEMM shapes run within a few percent of the
        # reference; attention's products, with 64-wide heads, run well below it). Speed-up / bound = the fraction above.
        floor = ours / (reference * 1e9)
        print(f"| {label}: roformer_hf's {ours / 1e9:.1f} GFLOP at 100% of the reference GEMM rate, s (about the most "
              f"any implementation could reach in this run) | {seconds['transformers']:.3f} | {floor:.3f} | "
              f"speed-up bound {seconds['transformers'] / floor:.2f}x | | |")
    for mode, label in (("infer", "inference"), ("train", "training step")):
        if mode not in memory:
            continue
        mb = {side: memory[mode][side]["extra"] / 2**20 for side in SIDES}
        ratio = mb["roformer_hf"] / mb["transformers"]
        target = (f"≤ {targets['memory ratio']:.3f} | {judge(ratio <= targets['memory ratio'])}"
                  if "memory ratio" in targets else "| ")
        print(f"| peak memory above weights, 1 x {args.memory_length} tokens, {label}, {args.dtype}, MiB | "
              f"{mb['transformers']:.0f} | {mb['roformer_hf']:.0f} | roformer_hf / transformers {ratio:.3f} | "
              f"{target} |")
    print(f"| fp32: max abs logit difference at real tokens | | {parity['logits']:.2e} | | ≤ {args.tolerance:g} | yes |")
    print(f"| fp32: MLM loss difference; max abs gradient difference (largest gradient) | | {parity['loss']:.2e}; "
          f"{parity['grad']:.2e} ({parity['grad_scale']:.2e}) | | | |")
    if low_precision:
        errors = {side: low_precision[side] for side in SIDES}
        print(f"| {args.dtype} logits against the fp32 ones at real tokens: relative error (max abs) | "
              f"{errors['transformers']['relative']:.2e} ({errors['transformers']['max abs']:.2e}) | "
              f"{errors['roformer_hf']['relative']:.2e} ({errors['roformer_hf']['max abs']:.2e}) | | ≤ 1.5x "
              f"transformers' | yes |")
        print(f"| {args.dtype} MLM loss (fp32: {parity['fp32 loss']:.4f}) | {errors['transformers']['loss']:.4f} | "
              f"{errors['roformer_hf']['loss']:.4f} | | | |")

    onnx_report(args, onnx, times, judge)

    print(f"\nReal-token FLOPs of one forward: {total / 1e9:.1f} GFLOP (" +
          ", ".join(f"{name} {value / total:.0%}" for name, value in flops.items()) +
          "); the decoder counts on every real token, a training step counts 3x the forward"
          + ("." if args.dense_prediction else
             f"; roformer_hf's training step runs the MLM head and its last layer's queries on the {labelled} "
             f"labelled tokens only (sparse_prediction), {train_total / 1e9:.1f} GFLOP per forward, and its rate is "
             "counted on that."))
    kernels = list(dict.fromkeys(kernel for _, kernel in rates))
    print(f"\n{args.dtype} GEMM rate of the model's shapes with the real tokens as rows, GFLOP/s, median of repeats, "
          "with MKL (torch.mm, what nn.Linear runs) and oneDNN (what roformer_hf's fused_linear runs in inference); "
          "the reference rates above are FFN up sampled between the model runs, with the kernel each step runs "
          f"(inference: {reference_gemm['infer'][0]}, by this CPU's dense rule ({fused.RULE.cpu}); training: "
          f"{reference_gemm['train'][0]}):\n")
    print(f"| shape | {' | '.join(kernels)} |\n|---|{'---|' * len(kernels)}")
    for name in dict.fromkeys(name for name, _ in rates):
        print(f"| {name} | {' | '.join(f'{rates[name, kernel]:.1f}' for kernel in kernels)} |")
    if memory:
        method = next(iter(next(iter(memory.values())).values()))["method"]
        print(f"\nPeak memory: a fresh process per model and mode, peak resident memory ({method}) above the "
              "resident size after loading the model and a short warm-up step (weights and .grad buffers "
              "excluded, identical in both); glibc's mmap threshold fixed at 64 KiB so freed tensors leave RSS. "
              "transformers' RoFormer needs max_position_embeddings ≥ the length; its checkpoint has "
              f"{max(args.memory_length, max(args.lengths))}.")
    print("\nMachine:\n")
    print("\n".join(machine_lines()))


def compiled_line(compile_seconds: dict[str, float], backend: str) -> str:
    """What the header says of `--compile`: the first call of each step, compilation included."""
    if not compile_seconds:
        return ""
    calls = ", ".join(f"{'inference' if mode == 'infer' else 'training step'} {seconds:.1f} s"
                      for mode, seconds in compile_seconds.items())
    return f"; roformer_hf through torch.compile ({backend}), first call with compilation: {calls}"


def onnx_report(args, onnx: dict | str, times: dict, judge: Judge) -> None:
    """The ONNX Runtime section: `onnx` holds each session's facts, or says why the section was skipped."""
    print("\n### ONNX Runtime (fp32, the same padded batch)\n")
    if isinstance(onnx, str):
        print(f"Skipped: {onnx}.")
        return
    sessions = onnx["facts"]
    version = onnx["version"]
    ours = median(times["infer"]["roformer_hf"])
    target = judge.targets["onnx speed-up"]
    print(f"onnxruntime {version}, CPUExecutionProvider, graph optimizations ORT_ENABLE_ALL, "
          f"{torch.get_num_threads()} intra-op threads; graphs exported from fp32 PyTorch with "
          "torch.onnx.export(..., dynamo=True) for this batch's shapes; roformer_hf's graph keeps the padded layout. "
          f"Timed interleaved with the inference forwards above.\n")
    print("| graph in ONNX Runtime | forward, s: median (min–max) | roformer_hf "
          f"{args.dtype} forward is faster by | target | met | max abs logit diff to transformers' eager | "
          "export, session load |")
    print("|---|---|---|---|---|---|---|")
    for name, facts in sessions.items():
        ratio = median(times["infer"][name]) / ours
        goal, met = (f"≥ {target:g}x", judge(ratio >= target)) if name == "onnx transformers" else ("", "")
        print(f"| {ONNX_LABELS[name]} | {spread(times['infer'][name])} | {ratio:.2f}x | {goal} | {met} | "
              f"{facts['logits']:.2e} | {facts['export']:.1f} s, {facts['load']:.1f} s |")


# ---------------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = timing_parser(__doc__.split("\n\n")[0], repeats=5, warmup=1, timed="runs per model and mode")
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES),
                        help="weights and activations of both models (the GEMM reference too)")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="roformer_hf's attention")
    parser.add_argument("--skip-onnx", action="store_true", help="skip the ONNX Runtime section")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max abs logit difference allowed")
    parser.add_argument("--dense-prediction", action="store_true",
                        help="roformer_hf's MLM head on every token in training too (default: labelled tokens only)")
    parser.add_argument("--skip-train", action="store_true", help="time the inference forward only")
    parser.add_argument("--compile", action="store_true",
                        help="time roformer_hf through torch.compile; reports each step's first call, "
                             "compilation included")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for --compile (default: %(default)s)")
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
    dtype = DTYPES[args.dtype]

    with tempfile.TemporaryDirectory(prefix="roformer_bench_") as folder:
        from transformers import RoFormerForMaskedLM

        torch.manual_seed(args.seed)
        max_positions = max(args.memory_length, max(args.lengths))
        RoFormerForMaskedLM(transformers_config(size, max_positions)).save_pretrained(folder)
        models = {side: load_model(side, folder, args.attn, not args.dense_prediction).eval() for side in SIDES}

        progress("checking outputs (fp32)")
        parity = check_parity(models, batch, args.tolerance)
        print(f"  max abs logit diff {parity['logits']:.2e}, loss diff {parity['loss']:.2e}, "
              f"max abs grad diff {parity['grad']:.2e}", flush=True)

        sessions = {}
        if args.skip_onnx:
            onnx = "--skip-onnx"
        elif absent := onnx_runtime.missing():
            onnx = f"not installed: {absent} (pip install -e '.[onnx]')"
        else:
            progress("exporting to ONNX, loading in ONNX Runtime")
            for model in models.values():
                model.eval()
            sessions, facts = onnx_contenders(models, batch, folder, parity)
            onnx = {"facts": facts, "version": next(iter(sessions.values())).version}

        low_precision = None
        if dtype != torch.float32:
            progress(f"loading both models in {args.dtype}, checking their logits against fp32")
            models = {side: load_model(side, folder, args.attn, not args.dense_prediction, dtype=dtype).eval()
                      for side in SIDES}
            low_precision = check_low_precision(models, batch, parity)
            for side in SIDES:
                print(f"  {side}: relative error {low_precision[side]['relative']:.2e}", flush=True)

        progress(f"{args.dtype} GEMM rate")
        h, i, v = size.hidden, size.intermediate, size.vocab
        shapes = {f"({tokens} x {h}) @ ({h} x {i}), FFN up": (tokens, h, i),
                  f"({tokens} x {i}) @ ({i} x {h}), FFN down": (tokens, i, h),
                  f"({tokens} x {h}) @ ({h} x {h}), q/k/v/output": (tokens, h, h),
                  f"({tokens} x {h}) @ ({h} x {v}), decoder": (tokens, h, v)}
        kernels = gemm_kernels(dtype)
        gemms = {(name, kernel): Gemm(*shape, dtype=dtype, kernel=kernel)
                 for name, shape in shapes.items() for kernel in kernels}
        rates = {key: gemm.gflops([gemm.sample() for _ in range(max(10, args.repeats))]) for key, gemm in gemms.items()}
        # The reference rate: FFN up (the model's largest GEMM) with the faster kernel, each sampled between the model
        # runs below so that it sees the same machine load as they do.
        references = {f"gemm {kernel}": gemms[next(iter(shapes)), kernel] for kernel in kernels}

        times, gemm_samples, compile_seconds = {}, {name: [] for name in references}, {}
        if args.compile:  # opt-in path: the ONNX export and the parity checks above used the eager model
            models["roformer_hf"] = torch.compile(models["roformer_hf"], backend=args.compile_backend)
        modes = {"infer": infer} if args.skip_train else {"infer": infer, "train": train_step}
        for mode, step in modes.items():
            progress(f"timing {'inference forward' if mode == 'infer' else 'training step'}")
            for model in models.values():
                model.train(mode == "train")
            if args.compile:  # the first call of each step compiles it
                compile_seconds[mode] = timed_step(models["roformer_hf"], step, batch)
            runners = {side: (lambda model=models[side]: timed_step(model, step, batch)) for side in SIDES}
            if mode == "infer":
                runners.update({name: (lambda session=session: session.timed(batch))
                                for name, session in sessions.items()})
            samplers = {name: gemm.sample for name, gemm in references.items()}
            times[mode] = time_interleaved({**runners, **samplers}, args.warmup, args.repeats)
            for name in references:
                gemm_samples[name] += times[mode].pop(name)
        for (name, gemm), kernel in zip(references.items(), kernels):
            rates["FFN up again, sampled between the model runs", kernel] = gemm.gflops(gemm_samples[name])
        # Each step against the GEMM kernel it runs: inference through fused_linear (oneDNN where this CPU's dense
        # rule takes it at these rows, MKL's where the rule hands the rows to the layer's own call), training through
        # autograd's (MKL's), or oneDNN's where the rule trains on it (`fused.DenseRule.onednn_training_macs`).
        infer_kernel = kernels[-1]
        if fused._dense_kernel(torch.empty(tokens, h, dtype=dtype)) == "module":
            infer_kernel = GEMM_KERNELS[0]
        train_kernel = kernels[0]
        if dtype == torch.float32 and tokens * h * i >= fused.RULE.onednn_training_macs:
            train_kernel = kernels[-1]
        reference_gemm = {"infer": (infer_kernel, rates["FFN up again, sampled between the model runs", infer_kernel]),
                          "train": (train_kernel, rates["FFN up again, sampled between the model runs", train_kernel])}
        del models, sessions, runners  # runners hold the models too
        gc.collect()

        memory = {}
        if not args.skip_memory:
            modes = ("infer",) if args.skip_memory_train else ("infer", "train")
            for mode in modes:
                progress(f"peak memory, {args.memory_length} tokens, {mode}, {args.dtype}")
                memory[mode] = {side: measure_memory(side, mode, folder, args) for side in SIDES}

    progress("done")
    report(args, size, flops, parity, low_precision, onnx, times, rates, reference_gemm, memory, compile_seconds)


if __name__ == "__main__":
    main()
