"""Quantized CPU inference: roformer_hf in int8 against ONNX Runtime's int8, and fp32 eager against torch.compile,
the same weights in all, timed in one run.

    python benchmarks/bench_quant.py            # the CPU benchmark's batch and model (a few minutes on 2 cores)
    python benchmarks/bench_quant.py --quick    # tiny smoke configuration (about a minute)

What it does:
1. Builds transformers' `RoFormerForMaskedLM` (dropout 0), saves it, and loads the folder in roformer_hf (fp32).
   transformers' fp32 eager logits are the reference: every path's argmax at the real tokens is compared with theirs.
2. The paths (each listed with what it costs to set up):
   - roformer_hf fp32, eager;
   - roformer_hf fp32 through `torch.compile` (inductor, with `freezing`, as for inference): first call timed;
   - roformer_hf int8, `roformer_hf.quantization.quantize_int8` (oneDNN's int8 GEMM, activations quantized per
     call, eager);
   - roformer_hf with PyTorch's legacy `torch.ao.quantization.quantize_dynamic` (fbgemm/x86 int8 linear layers);
   - roformer_hf with torchao's `Int8DynamicActivationInt8WeightConfig` and `torch.compile` (--torchao; by default
     only where the CPU has VNNI or AMX-INT8: without them torchao's int8 GEMM has no fast kernel and a forward
     takes minutes);
   - transformers' graph exported to ONNX (`onnx_runtime.py`) in ONNX Runtime, fp32 and int8 (ONNX Runtime's
     `quantize_dynamic`, int8 weights, uint8 activations quantized per call).
3. Times one forward of each (`torch.inference_mode`), interleaved, rotating which goes first; reports medians,
   the ratios of the int8 targets and the machine with its int8 and bf16 matrix instructions.

roformer_hf skips the padding in every PyTorch path; ONNX Runtime's graph computes it (static padded shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import tempfile
import time
import warnings
from statistics import median

import onnx_runtime
import torch
from common import cpu_info, int8_matrix_units, machine_lines, progress, spread, time_interleaved, verdict
from workload import (
    REPO_ROOT,
    infer,
    load_model,
    padded_batch,
    parse_args,
    size_of,
    timing_parser,
    transformers_config,
)

from roformer_hf.quantization import quantize_int8  # after workload, which puts this checkout first on sys.path

TARGETS = {"int8 over ONNX Runtime int8": 2.0, "int8 over fp32 eager": 1.8, "fp32 eager over compiled": 1.0}
INT8 = "roformer_hf int8 (quantize_int8)"
FP32 = "roformer_hf fp32 eager"
COMPILED = "roformer_hf fp32 torch.compile"
LEGACY = "roformer_hf + torch.ao quantize_dynamic"
TORCHAO = "roformer_hf + torchao int8 + torch.compile"
ORT_FP32 = "ONNX Runtime fp32 (transformers' graph)"
ORT_INT8 = "ONNX Runtime int8 quantize_dynamic (transformers' graph)"


def timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def torch_paths(folder: str, batch, args) -> tuple[dict, dict]:
    """The PyTorch paths: name -> model, and name -> its set-up cost, described."""
    fp32 = load_model("roformer_hf", folder).eval()
    models, setup = {FP32: fp32}, {FP32: "none"}
    int8, seconds = timed(lambda: quantize_int8(copy.deepcopy(fp32)))
    models[INT8], setup[INT8] = int8, f"quantize {seconds:.1f} s"
    with warnings.catch_warnings():  # its deprecation notice
        warnings.simplefilter("ignore")
        legacy, seconds = timed(lambda: torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {torch.nn.Linear}))
    models[LEGACY], setup[LEGACY] = legacy, f"quantize {seconds:.1f} s"
    if not args.skip_compile:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: inductor packs them for oneDNN and fuses around them
        compiled = torch.compile(load_model("roformer_hf", folder).eval())
        _, seconds = timed(lambda: infer(compiled, batch))
        models[COMPILED], setup[COMPILED] = compiled, f"first call (compilation) {seconds:.1f} s"
    if args.torchao:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        model = load_model("roformer_hf", folder).eval()
        _, quantize_seconds = timed(lambda: quantize_(model, Int8DynamicActivationInt8WeightConfig()))
        compiled = torch.compile(model)
        _, seconds = timed(lambda: infer(compiled, batch))
        models[TORCHAO] = compiled
        setup[TORCHAO] = f"quantize {quantize_seconds:.1f} s, first call (compilation) {seconds:.1f} s"
    return models, setup


def onnx_paths(reference_model, batch, folder: str) -> tuple[dict, dict]:
    """transformers' graph in ONNX Runtime, fp32 and ONNX Runtime's dynamic int8."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path, int8_path = os.path.join(folder, "transformers.onnx"), os.path.join(folder, "transformers.int8.onnx")
    export_seconds = onnx_runtime.export(reference_model, batch, path)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, quantize_seconds = timed(lambda: quantize_dynamic(path, int8_path, weight_type=QuantType.QInt8))
    threads = torch.get_num_threads()
    sessions = {ORT_FP32: onnx_runtime.OrtModel(path, threads), ORT_INT8: onnx_runtime.OrtModel(int8_path, threads)}
    setup = {ORT_FP32: f"export {export_seconds:.1f} s, session {sessions[ORT_FP32].load_seconds:.1f} s",
             ORT_INT8: f"export {export_seconds:.1f} s, quantize {quantize_seconds:.1f} s, session "
                       f"{sessions[ORT_INT8].load_seconds:.1f} s"}
    return sessions, setup


def accuracy(logits: torch.Tensor, reference: torch.Tensor, real: torch.Tensor) -> tuple[float, float]:
    """Argmax agreement with the reference at the real tokens, and the cosine similarity of the logits there."""
    ours, theirs = logits[real].double(), reference[real].double()
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0).item()
    return agreement, cosine


def commit() -> str:
    import subprocess

    result = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True)
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (result.stdout.strip() or "unknown") + (" (uncommitted changes)" if dirty else "")


def report(args, size, times, facts, setup, units, full_range, measured_commit: str) -> None:
    medians = {name: median(samples) for name, samples in times.items()}
    tokens, padded = sum(args.lengths), len(args.lengths) * max(args.lengths)
    print(f"\n## Quantized CPU inference, {time.strftime('%Y-%m-%d', time.gmtime())}, commit {measured_commit}\n")
    print(f"Model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}, "
          f"vocab {size.vocab}, MLM head, dropout 0, random weights (one checkpoint for all). Batch: "
          f"{len(args.lengths)} sequences of {'/'.join(map(str, args.lengths))} tokens, right-padded to "
          f"{max(args.lengths)} ({tokens} real of {padded}). Forward with logits, median (min–max) of {args.repeats} "
          f"after {args.warmup} warm-up, paths interleaved. Accuracy: against transformers' fp32 eager logits at the "
          f"real tokens. CPU int8 matrix instructions: {units}.\n")
    print("| path | forward, s | vs ONNX Runtime int8 | vs roformer_hf fp32 eager | argmax agreement | logits cosine "
          "| set-up |")
    print("|---|---|---|---|---|---|---|")
    for name in times:
        agreement, cosine = facts[name]
        versus_ort = f"{medians[ORT_INT8] / medians[name]:.2f}x" if ORT_INT8 in medians else "n/a"
        print(f"| {name} | {spread(times[name])} | {versus_ort} | "
              f"{medians[FP32] / medians[name]:.2f}x | {agreement:.4f} | {cosine:.6f} | {setup[name]} |")
    if full_range:
        print(f"\nThis CPU has no VNNI, so `quantize_int8` scales its weights so that no int16 pair sum can saturate "
              f"(`saturation_safe`: exact). With plain 8-bit scales, as it runs on CPUs with VNNI or AMX-INT8 (here "
              f"not exact: its int16 pair sums may saturate), the argmax agreement is {full_range[0]:.4f} and the "
              f"logits cosine {full_range[1]:.6f}.")
    print("\n| target | measured | met |\n|---|---|---|")
    if ORT_INT8 in medians:
        ratio = medians[ORT_INT8] / medians[INT8]
        print(f"| int8 forward ≥ {TARGETS['int8 over ONNX Runtime int8']:g}x faster than ONNX Runtime's int8 | "
              f"{ratio:.2f}x | {verdict(ratio >= TARGETS['int8 over ONNX Runtime int8'])} |")
        ours, theirs = facts[INT8][0], facts[ORT_INT8][0]
        print(f"| int8 argmax agreement ≥ ONNX Runtime int8's | {ours:.4f} vs {theirs:.4f} | "
              f"{verdict(ours >= theirs)} |")
    ratio = medians[FP32] / medians[INT8]
    print(f"| int8 forward ≥ {TARGETS['int8 over fp32 eager']:g}x faster than roformer_hf's fp32 eager | "
          f"{ratio:.2f}x "
          f"| {verdict(ratio >= TARGETS['int8 over fp32 eager'])} |")
    if COMPILED in medians:
        ratio = medians[FP32] / medians[COMPILED]
        print(f"| compiled fp32 at least as fast as eager (eager / compiled ≥ 1) | {ratio:.2f}x | "
              f"{verdict(ratio >= TARGETS['fp32 eager over compiled'])} |")
    print("\nMachine:\n")
    print("\n".join(machine_lines()))


def build_parser() -> argparse.ArgumentParser:
    parser = timing_parser(__doc__.split("\n\n")[0], repeats=5, warmup=1, timed="forwards per path")
    parser.add_argument("--skip-onnx", action="store_true", help="skip the ONNX Runtime paths")
    parser.add_argument("--skip-compile", action="store_true", help="skip the torch.compile fp32 path")
    parser.add_argument("--torchao", action=argparse.BooleanOptionalAction, default=None,
                        help="time torchao's int8 + torch.compile (default: where the CPU has VNNI or AMX-INT8)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv, repeats=2)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    measured_commit = commit()  # at the start: the code this run imported
    units = int8_matrix_units(cpu_info()[1])
    if args.torchao is None:
        args.torchao = units != "none"
    if args.torchao and importlib_missing("torchao"):
        raise SystemExit("--torchao needs torchao (pip install -e '.[quantization]')")
    size = size_of(args)
    batch = padded_batch(args.lengths, size.vocab, args.seed)
    real = batch[1].bool()
    with tempfile.TemporaryDirectory(prefix="roformer_quant_") as folder:
        from transformers import RoFormerForMaskedLM

        torch.manual_seed(args.seed)
        RoFormerForMaskedLM(transformers_config(size, max(args.lengths))).save_pretrained(folder)
        reference_model = load_model("transformers", folder).eval()
        reference = infer(reference_model, batch)
        progress("loading and quantizing the PyTorch paths")
        models, setup = torch_paths(folder, batch, args)
        runners = {name: (lambda model=model: infer(model, batch)) for name, model in models.items()}
        if args.skip_onnx or onnx_runtime.missing():
            progress(f"ONNX Runtime paths skipped: {'--skip-onnx' if args.skip_onnx else onnx_runtime.missing()}")
        else:
            progress("exporting transformers' RoFormer to ONNX, quantizing it with ONNX Runtime")
            sessions, onnx_setup = onnx_paths(reference_model, batch, folder)
            runners.update({name: (lambda session=session: session.logits(batch))
                            for name, session in sessions.items()})
            setup.update(onnx_setup)
        del reference_model
        progress("accuracy")
        facts = {name: accuracy(run(), reference, real) for name, run in runners.items()}
        full_range = None
        if models[INT8].roformer.encoder.layer[0].intermediate.dense.saturation_safe:
            # What a CPU with VNNI or AMX-INT8 computes exactly (8-bit weights); here its int16 sums may saturate.
            full = quantize_int8(load_model("roformer_hf", folder).eval(), saturation_safe=False)
            full_range = accuracy(infer(full, batch), reference, real)
            del full
        progress("timing")
        times = time_interleaved({name: (lambda run=run: timed(run)[1]) for name, run in runners.items()},
                                 args.warmup, args.repeats)
    progress("done")
    report(args, size, times, facts, setup, units, full_range, measured_commit)


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    main()
