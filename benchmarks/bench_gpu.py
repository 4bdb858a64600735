"""GPU benchmark: roformer_hf against transformers' RoFormer and a ModernBERT of matching size, bf16, in one run.

    python benchmarks/bench_gpu.py                      # the GPU targets: base size, 12 layers, the CPU lengths x4
    python benchmarks/bench_gpu.py --repeat-batch 8     # a larger batch of the same length mix
    python benchmarks/bench_gpu.py --device cpu --quick --dtype fp32   # smoke run without a GPU (a minute or two)

What it does:
1. Builds transformers' `RoFormerForMaskedLM` (dropout 0), saves it, and loads the folder in transformers (eager
   attention, its only kernel) and in roformer_hf (`--attn`: flash-attn's varlen kernel when flash-attn is installed,
   else SDPA; sparse prediction), both cast to `--dtype` on `--device`.
2. ModernBERT (`transformers.ModernBertForMaskedLM`, random weights, roformer_hf's attention kernel) at a matching
   size: see `modernbert_config`.
3. `torch.compile` of roformer_hf on SDPA: the first call of each mode (compilation included) is timed on its own;
   its speed-up is against the same SDPA model in eager mode.
4. Accuracy: every RoFormer's logits at real tokens against transformers' model in fp32 on the same device, and the
   MLM loss computed from them. bf16 cannot match to 1e-5, so each side's error is reported; in fp32 roformer_hf
   must be within `--tolerance`.
5. Times the inference forward (`torch.inference_mode`) and the training step (forward + backward; gradients zeroed
   outside the timed region; no optimizer) of every model, interleaved (`common.time_interleaved`), the device
   synchronised before and after each call; reports medians.
6. Peak GPU memory of one call per model and mode: `torch.cuda.max_memory_allocated` above what was allocated just
   before (so the weights, and the other models, are excluded; a training step's gradients are included).
7. Model FLOPs utilisation: real-token FLOPs (`workload.forward_flops`; a training step counts 3x the forward, with
   the MLM head on the labelled tokens only for the models that skip the others) per second over `--peak-tflops`.
8. Prints markdown tables to paste into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import tempfile
from dataclasses import dataclass, field
from statistics import median

import torch
import workload
from common import machine_lines, progress, spread, time_interleaved, time_once, verdict

from roformer_hf.kernels import choose_kernel

TARGETS = {"infer speed-up": 3.0, "train speed-up": 3.0, "train MFU": 0.45}
# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, matched against the device name; the first match wins.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = {"infer": workload.infer, "train": workload.train_step}


@dataclass
class Contender:
    """One model under test, a row of the tables, and what was measured on it."""

    name: str
    attention: str
    model: torch.nn.Module  # possibly the torch.compile wrapper
    sparse_head: bool  # its training forward runs the MLM head on the labelled tokens only
    sparse_last_layer: bool = False  # and its last layer's queries (roformer_hf with a varlen attention kernel)
    times: dict[str, list[float]] = field(default_factory=dict)  # mode -> seconds per call
    memory: dict[str, float | None] = field(default_factory=dict)  # mode -> MiB, None off CUDA
    compile_seconds: dict[str, float] = field(default_factory=dict)  # mode -> first call, compiled models only


# ---------------------------------------------------------------------------------------------------- models

def flash_attn_importable() -> bool:
    """flash-attn installed and importable: transformers' check reads the package metadata only, and a wheel built
    for another torch release fails on import (undefined symbols)."""
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def resolve_attention(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` is flash-attn's kernel where it can run (CUDA, flash-attn importable, half precision), else SDPA."""
    flash_usable = device.type == "cuda" and dtype != torch.float32 and flash_attn_importable()
    if requested == "auto":
        return "flash_attention_2" if flash_usable else "sdpa"
    if requested == "flash_attention_2" and not flash_usable:
        raise SystemExit(f"--attn flash_attention_2 needs CUDA, an importable flash-attn and --dtype bf16; got "
                         f"device {device}, dtype {dtype}, flash-attn importable: {flash_attn_importable()}")
    return requested


def modernbert_config(size: workload.Size):
    """transformers' ModernBERT with RoFormer's hidden size, layers, heads and vocabulary, every layer global
    attention, no dropout, sparse prediction (as roformer_hf).

    ModernBERT's MLP is a GLU: `Wi` maps hidden -> 2 x intermediate, `Wo` intermediate -> hidden, 3·H·I weights,
    where RoFormer's GELU MLP has 2·H·I. Its `intermediate_size` is therefore 2/3 of RoFormer's (2048 for 3072):
    the same feed-forward weights and FLOPs per token, so `workload.forward_flops` counts both models alike. What
    still differs: ModernBERT has no biases and no token-type embeddings, and normalises before each sublayer.
    transformers' ModernBERT (5.x) does not skip padding in its linear layers: it computes them on the padded
    batch (its flash path unpads inside each attention call only).
    """
    from transformers import ModernBertConfig

    return ModernBertConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=round(2 * size.intermediate / 3),
        layer_types=["full_attention"] * size.layers, sparse_prediction=True,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None,
    )


def build_contenders(args: argparse.Namespace, folder: str, device: torch.device,
                     dtype: torch.dtype) -> dict[str, Contender]:
    """transformers' RoFormer (eager), roformer_hf on `args.attn`, and unless skipped roformer_hf compiled on SDPA
    (plus its eager-mode SDPA baseline when `args.attn` is not SDPA) and ModernBERT."""
    def ours(attn: str) -> torch.nn.Module:
        return workload.load_model("roformer_hf", folder, attn, dtype=dtype).to(device)

    contenders = {
        "transformers": Contender("transformers' RoFormer", "eager",
                                  workload.load_model("transformers", folder, dtype=dtype).to(device),
                                  sparse_head=False),
        "roformer_hf": Contender("roformer_hf", args.attn, ours(args.attn), sparse_head=True,
                                 sparse_last_layer=choose_kernel(args.attn, device).varlen is not None),
    }
    if not args.skip_compile:
        if args.attn != "sdpa":
            contenders["roformer_hf sdpa"] = Contender("roformer_hf", "sdpa", ours("sdpa"), sparse_head=True)
        eager_mode = contenders["roformer_hf sdpa" if args.attn != "sdpa" else "roformer_hf"].model
        contenders["compiled"] = Contender("roformer_hf, torch.compile", "sdpa", torch.compile(eager_mode),
                                           sparse_head=True)
    if not args.skip_modernbert:
        from transformers import AutoModelForMaskedLM

        torch.manual_seed(args.seed)
        modernbert = AutoModelForMaskedLM.from_config(modernbert_config(workload.size_of(args)),
                                                      attn_implementation=args.attn, dtype=dtype)
        contenders["modernbert"] = Contender("ModernBERT", args.attn, modernbert.to(device), sparse_head=True)
    return contenders


# ---------------------------------------------------------------------------------------------------- measuring

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(model: torch.nn.Module, step, batch, device: torch.device) -> float:
    """Seconds of one `step(model, batch)` until the device is done; gradients are zeroed before the clock starts."""
    model.zero_grad(set_to_none=True)
    synchronize(device)
    return time_once(lambda: (step(model, batch), synchronize(device)))


def peak_memory_mib(model: torch.nn.Module, step, batch, device: torch.device) -> float | None:
    """Peak CUDA memory allocated during one `step` above what was allocated before it; None off CUDA."""
    if device.type != "cuda":
        return None
    model.zero_grad(set_to_none=True)
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step(model, batch)
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def check_accuracy(folder: str, contenders: dict[str, Contender], batch, device: torch.device,
                   tolerance: float | None) -> dict[str, dict[str, float]]:
    """Logits at real tokens of every RoFormer (not ModernBERT: other weights) against transformers' RoFormer in
    fp32 on `device`: max abs error, that error over the largest reference logit, and the MLM loss computed from
    the logits. With a `tolerance`, roformer_hf's error must be within it."""
    _, attention_mask, labels = batch
    real = attention_mask.bool()
    reference = workload.load_model("transformers", folder, dtype=torch.float32).to(device).eval()
    expected = workload.infer(reference, batch)[real].float()  # (N, V)
    del reference

    def loss(logits: torch.Tensor) -> float:
        return torch.nn.functional.cross_entropy(logits, labels[real]).item()

    results = {"fp32 reference": {"logits": 0.0, "relative": 0.0, "loss": loss(expected)}}
    for key, contender in contenders.items():
        if key == "modernbert":
            continue
        contender.model.eval()
        logits = workload.infer(contender.model, batch)[real].float()
        error = (logits - expected).abs().max().item()
        results[key] = {"logits": error, "relative": error / expected.abs().max().item(), "loss": loss(logits)}
        if key != "transformers" and not error <= (math.inf if tolerance is None else tolerance):  # NaN fails
            raise SystemExit(f"FAIL: {contender.name} ({contender.attention}) logits differ from transformers' fp32 "
                             f"at real tokens by {error:.3g} (tolerance {tolerance})")
    return results


def default_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


# ---------------------------------------------------------------------------------------------------- report

def device_lines(device: torch.device) -> list[str]:
    try:
        flash = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        flash = "not installed"
    lines = machine_lines()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.insert(0, f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                        f"{props.major}.{props.minor}, CUDA {torch.version.cuda}")
    return lines + [f"- flash-attn {flash}"]


def report(args, size: workload.Size, lengths: tuple[int, ...], labelled: int, contenders: dict[str, Contender],
           accuracy: dict[str, dict[str, float]], peak_tflops: float | None, device: torch.device) -> None:
    flops = workload.forward_flops(size, lengths)
    tokens, padded = sum(lengths), len(lengths) * max(lengths)
    dense = sum(flops.values())
    sparse_head = workload.sparse_head_forward_flops(flops, tokens, labelled)
    sparse_last = workload.sparse_head_forward_flops(flops, tokens, labelled, size)

    def step_flops(contender: Contender, mode: str) -> float:
        """What the contender computes: a training forward's sparse head (and last layer) on the labelled tokens."""
        if mode == "infer":
            return dense
        if not contender.sparse_head:
            return 3 * dense
        return 3 * (sparse_last if contender.sparse_last_layer else sparse_head)

    def mfu(contender: Contender, mode: str) -> float | None:
        if peak_tflops is None:
            return None
        return step_flops(contender, mode) / median(contender.times[mode]) / (peak_tflops * 1e12)

    def percent(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    on_target = device.type == "cuda" and args.dtype == "bf16"
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    others = "transformers' RoFormer" + (" and ModernBERT" if "modernbert" in contenders else "")
    print(f"\n## roformer_hf vs {others}, {device_name}, {args.dtype}\n")
    print(f"Model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}, "
          f"vocab {size.vocab}, MLM head; {contenders['roformer_hf'].model.num_parameters() / 1e6:.1f} M parameters"
          + (f"; ModernBERT with intermediate {round(2 * size.intermediate / 3)} (GLU: same MLP size), "
             f"{contenders['modernbert'].model.num_parameters() / 1e6:.1f} M parameters"
             if "modernbert" in contenders else "") + ".")
    print(f"Batch: the lengths {'/'.join(map(str, args.lengths))} x{args.repeat_batch} = {len(lengths)} sequences "
          f"right-padded to {max(lengths)} ({tokens} real tokens of {padded}, {tokens / padded:.0%}; {labelled} "
          f"labelled for MLM). Timings: median (min–max) of {args.repeats} after {args.warmup} warm-up calls.\n")

    print("| model | attention | inference, ms | inference, real tokens/s | inference MFU | training step, ms | "
          "training, real tokens/s | training MFU | peak memory inference / training, MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for contender in contenders.values():
        cells = []
        for mode in MODES:
            cells += [spread([1000 * t for t in contender.times[mode]]),
                      f"{tokens / median(contender.times[mode]):,.0f}", percent(mfu(contender, mode))]
        memory = " / ".join("n/a" if contender.memory[m] is None else f"{contender.memory[m]:,.0f}" for m in MODES)
        print(f"| {contender.name} | {contender.attention} | {' | '.join(cells)} | {memory} |")

    ours, theirs = contenders["roformer_hf"], contenders["transformers"]
    speed_up = {mode: median(theirs.times[mode]) / median(ours.times[mode]) for mode in MODES}
    met = lambda ok: verdict(ok) if on_target else "n/a (targets: CUDA, bf16)"  # noqa: E731
    print("\n| measurement | value | target | met |\n|---|---|---|---|")
    for mode, label in (("infer", "inference"), ("train", "training-step")):
        target = TARGETS[f"{mode} speed-up"]
        print(f"| {label} speed-up of roformer_hf ({ours.attention}) over transformers' RoFormer (eager) | "
              f"{speed_up[mode]:.2f}x | ≥ {target:g}x | {met(speed_up[mode] >= target)} |")
    train_mfu = mfu(ours, "train")
    print(f"| training MFU of roformer_hf ({ours.attention}), real tokens, peak "
          f"{'n/a' if peak_tflops is None else f'{peak_tflops:g} TFLOP/s'} | {percent(train_mfu)} | "
          f"≥ {TARGETS['train MFU']:.0%} (base size, sequence 512) | "
          f"{'n/a' if train_mfu is None else met(train_mfu >= TARGETS['train MFU'])} |")
    if "compiled" in contenders:
        compiled = contenders["compiled"]
        eager_mode = contenders.get("roformer_hf sdpa", ours)
        print("| torch.compile speed-up over eager-mode roformer_hf (sdpa): inference / training step | " +
              " / ".join(f"{median(eager_mode.times[m]) / median(compiled.times[m]):.2f}x" for m in MODES) +
              " | reported | |")
        print("| torch.compile: first call (compilation included; less if inductor's on-disk cache is warm), "
              "inference / training step, s | " +
              " / ".join(f"{compiled.compile_seconds[m]:.1f}" for m in MODES) + " | reported | |")
    if "modernbert" in contenders:
        modernbert = contenders["modernbert"]
        print("| real tokens/s of roformer_hf / ModernBERT: inference / training step | " +
              " / ".join(f"{median(modernbert.times[m]) / median(ours.times[m]):.2f}x" for m in MODES) +
              " | reported | |")

    print(f"\nAccuracy: logits at the {tokens} real tokens against transformers' RoFormer in fp32 on the same device "
          f"(same weights); MLM loss computed from each model's logits.\n")
    print("| model | dtype | max abs logit error | relative to the largest fp32 logit | MLM loss |")
    print("|---|---|---|---|---|")
    for key, result in accuracy.items():
        name, dtype = ("transformers' RoFormer, eager (the reference)", "fp32") if key == "fp32 reference" else (
            f"{contenders[key].name}, {contenders[key].attention}", args.dtype)
        print(f"| {name} | {dtype} | {result['logits']:.2e} | {result['relative']:.2e} | {result['loss']:.5f} |")

    print(f"\nReal-token FLOPs of one forward: {dense / 1e9:.3g} GFLOP (" +
          ", ".join(f"{name} {value / dense:.0%}" for name, value in flops.items()) +
          f"); a training step counts 3x its forward, with the MLM head on the {labelled} labelled tokens only for "
          f"the models with sparse prediction ({sparse_head / 1e9:.3g} GFLOP per forward; "
          f"{sparse_last / 1e9:.3g} where roformer_hf's last layer also queries those tokens only) and on "
          "every real token for transformers' RoFormer (it has no such option). MFU = those FLOPs / median time / "
          "peak; padding that a model computes anyway earns nothing. Peak memory: torch.cuda.max_memory_allocated "
          "during one call above what was allocated before it (weights excluded; a training step's gradients "
          "included).")
    print("\nMachine:\n")
    print("\n".join(device_lines(device)))


# ---------------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = workload.timing_parser(__doc__.split("\n\n")[0], repeats=10, warmup=3, timed="calls per model and mode")
    parser.set_defaults(layers=12)  # the GPU targets are at base size
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--repeat-batch", type=int, default=4,
                        help="the --lengths mix repeated N times in one batch (default 4: 32 sequences)")
    parser.add_argument("--attn", default="auto", choices=("auto", "sdpa", "flash_attention_2"),
                        help="roformer_hf's and ModernBERT's attention; auto: flash_attention_2 when flash-attn is "
                             "installed (and the device and dtype allow it), else sdpa")
    parser.add_argument("--skip-compile", action="store_true", help="leave out torch.compile (slow to compile on CPU)")
    parser.add_argument("--skip-modernbert", action="store_true", help="leave out ModernBERT")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak TFLOP/s in --dtype for MFU (default: dense bf16 of H100 SXM 989, "
                             "H100 PCIe 756, H200 989, looked up from the GPU name; MFU is n/a otherwise)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="fp32 only: max abs logit difference allowed (bf16 errors are reported, not checked)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = workload.parse_args(build_parser(), argv, repeat_batch=1)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (`--device cpu --quick --dtype fp32` smoke-tests this)")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.attn = resolve_attention(args.attn, device, dtype)
    peak_tflops = args.peak_tflops or default_peak_tflops(device, dtype)
    from transformers import RoFormerForMaskedLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    size = workload.size_of(args)
    lengths = tuple(args.lengths) * args.repeat_batch
    batch = tuple(t.to(device) for t in workload.padded_batch(lengths, args.vocab, args.seed))
    with tempfile.TemporaryDirectory(prefix="roformer_bench_gpu_") as folder:
        torch.manual_seed(args.seed)
        RoFormerForMaskedLM(workload.transformers_config(size, max(lengths))).save_pretrained(folder)
        contenders = build_contenders(args, folder, device, dtype)
        if "compiled" in contenders:
            progress("torch.compile: first call of each mode")
            compiled = contenders["compiled"]
            for mode, step in MODES.items():
                compiled.model.train(mode == "train")
                compiled.compile_seconds[mode] = timed_call(compiled.model, step, batch, device)
        progress("checking outputs against transformers' RoFormer in fp32")
        accuracy = check_accuracy(folder, contenders, batch, device, args.tolerance if dtype == torch.float32 else None)

    for mode, step in MODES.items():
        progress(f"timing {'inference forward' if mode == 'infer' else 'training step'}")
        for contender in contenders.values():
            contender.model.train(mode == "train")
        runners = {key: (lambda c=contender: timed_call(c.model, step, batch, device))
                   for key, contender in contenders.items()}
        for key, samples in time_interleaved(runners, args.warmup, args.repeats).items():
            contenders[key].times[mode] = samples
        for contender in contenders.values():
            contender.memory[mode] = peak_memory_mib(contender.model, step, batch, device)

    progress("done")
    report(args, size, lengths, int((batch[2] != -100).sum()), contenders, accuracy, peak_tflops, device)


if __name__ == "__main__":
    main()
