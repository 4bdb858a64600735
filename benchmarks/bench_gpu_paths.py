"""The GPU paths bench_gpu.py does not time, in one run on one device: packed rows against padded ones, time and peak
memory at long lengths, generation with the cache, and the forward a serving replica runs per batch.

    python benchmarks/bench_gpu_paths.py                                     # CUDA, bf16, base size
    python benchmarks/bench_gpu_paths.py --device cpu --dtype fp32 --quick   # smoke run without a GPU (seconds)

Every model comes from a checkpoint that transformers' RoFormer saved (random weights, dropout 0), loaded by both
implementations: roformer_hf on SDPA (sparse prediction in training), transformers' RoFormer on eager attention (its
only kernel), both cast to `--dtype` on `--device`. Times are medians of `--repeats` calls after `--warmup`, the
device synchronised before and after each call. Each section prints a markdown table; a section that fails prints its
error, and the others still run (the exit status is then 1).

- packing: one MLM training step (forward + backward) on bench_packing.py's two workloads (`--lengths` repeated
  `--repeat-batch` times; 64 short lines): transformers padded, roformer_hf padded, roformer_hf on one packed row
  (what `DataCollatorWithFlattening` gives). Real tokens per second, and each loss against transformers'.
- long: one sequence of each of `--long-lengths` tokens: the inference forward and the training step, seconds and peak
  memory above what was allocated before the call (`torch.cuda.max_memory_allocated`: the weights excluded, a
  training step's gradients included); "out of memory" where the device ran out.
- generation: causal LMs at bench_generate.py's size, greedy, cache on (each model's own), prompts of mixed lengths
  left-padded, `--new-tokens` each: new tokens per second. And how many generated tokens agree on unpadded prompts
  (bf16 rounding can tip a greedy choice, after which a continuation differs).
- replica: the forward `roformer-hf serve` runs for an embeddings request (`RoFormerModel`, mean pooling over the
  attention mask): one 16-token sentence, and 32 sentences of 8 to 32 tokens padded to the longest; sentences per
  second of each model. Ray Serve's own cost is not in it (bench_serving.py measures requests end to end).
- profile: the operators of roformer_hf's training step on the mixed-length batch, by self device time.
"""

from __future__ import annotations

import argparse
import tempfile
import traceback
from collections.abc import Callable
from statistics import median

import bench_generate
import bench_packing
import torch
import transformers
import workload
from bench_gpu import DTYPES, device_lines, peak_memory_mib, synchronize
from common import progress, time_interleaved, time_once

import roformer_hf

SECTIONS = ("packing", "long", "generation", "replica", "profile")
SIDES = ("transformers", "roformer_hf")


def device_seconds(call: Callable[[], object], device: torch.device) -> float:
    """Seconds of `call()` until the device is done with it."""
    synchronize(device)
    return time_once(lambda: (call(), synchronize(device)))


def to_device(inputs: dict, device: torch.device) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}


def masked_lm(folder: str, side: str, args: argparse.Namespace) -> torch.nn.Module:
    return workload.load_model(side, folder, dtype=DTYPES[args.dtype]).to(args.device)


def save_checkpoint(folder: str, args: argparse.Namespace, max_positions: int) -> None:
    torch.manual_seed(args.seed)
    transformers.RoFormerForMaskedLM(workload.transformers_config(workload.size_of(args), max_positions)
                                     ).save_pretrained(folder)


def median_ms(samples: list[float]) -> str:
    return f"{1000 * median(samples):.1f}"


# ---------------------------------------------------------------------------------------------------- sections

def packing(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    workloads = {f"mixed lengths x{args.repeat_batch}": tuple(args.lengths) * args.repeat_batch,
                 "short lines": bench_packing.short_line_lengths(bench_packing.SHORT_LINES, args.seed)}
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, args, max(max(lengths) for lengths in workloads.values()))
        models = {side: masked_lm(folder, side, args).train() for side in SIDES}
    print("\n### Packed rows against padded batches: MLM training step, real tokens per second\n")
    print("| workload | real tokens (padded) | transformers, padded | roformer_hf, padded | roformer_hf, packed | "
          "packed / our padded | packed / transformers | largest loss difference from transformers' |")
    print("|---|---|---|---|---|---|---|---|")
    for name, lengths in workloads.items():
        examples = bench_packing.examples(lengths, args.vocab, args.seed)
        ways = {"transformers, padded": (models["transformers"], bench_packing.padded_inputs(examples)),
                "roformer_hf, padded": (models["roformer_hf"], bench_packing.padded_inputs(examples)),
                "roformer_hf, packed": (models["roformer_hf"], bench_packing.packed_inputs(examples))}
        losses = {}

        def runner(key: str, model: torch.nn.Module, inputs: dict) -> Callable[[], float]:
            def run() -> float:
                model.zero_grad(set_to_none=True)
                return device_seconds(lambda: losses.__setitem__(key, workload_step(model, inputs)), device)
            return run

        times = time_interleaved({key: runner(key, model, to_device(inputs, device))
                                  for key, (model, inputs) in ways.items()}, args.warmup, args.repeats)
        rates = {key: sum(lengths) / median(samples) for key, samples in times.items()}
        reference = losses["transformers, padded"].item()
        difference = max(abs(loss.item() - reference) for loss in losses.values())
        packed = rates["roformer_hf, packed"]
        print(f"| {name} | {sum(lengths)} ({len(lengths) * max(lengths)}) | "
              + " | ".join(f"{rate:,.0f}" for rate in rates.values())
              + f" | {packed / rates['roformer_hf, padded']:.2f}x | {packed / rates['transformers, padded']:.2f}x | "
              f"{difference:.2g} |")


def workload_step(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach()


def long_sequences(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    print("\n### One long sequence: seconds and peak memory above the weights\n")
    print("| tokens | model | inference, ms | inference peak, MiB | training step, ms | training peak, MiB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, args, max(args.long_lengths))
        for length in args.long_lengths:
            batch = tuple(t.to(device) for t in workload.padded_batch((length,), args.vocab, args.seed))
            for side in ("roformer_hf", "transformers"):
                model = masked_lm(folder, side, args)
                cells = []
                for mode, step in (("infer", workload.infer), ("train", workload.train_step)):
                    model.train(mode == "train")
                    cells += measure_once(model, step, batch, device)
                print(f"| {length:,} | {side} | {' | '.join(cells)} |", flush=True)
                del model
                torch.cuda.empty_cache() if device.type == "cuda" else None


def measure_once(model: torch.nn.Module, step, batch, device: torch.device) -> list[str]:
    """[milliseconds, peak MiB] of `step(model, batch)`: the peak of a first call, the time of a second."""
    try:
        memory = peak_memory_mib(model, step, batch, device)
        model.zero_grad(set_to_none=True)
        seconds = device_seconds(lambda: step(model, batch), device)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return ["out of memory", "out of memory"]
    finally:
        model.zero_grad(set_to_none=True)
    return [f"{1000 * seconds:,.0f}", "n/a" if memory is None else f"{memory:,.0f}"]


def generation(args: argparse.Namespace) -> None:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    size = bench_generate.QUICK if args.quick else bench_generate.BASE
    lengths = [40, 17, 64, 9, 33, 52, 25, 12] * args.repeat_batch
    models = {side: model.to(device, dtype)
              for side, model in bench_generate.build_models(size, max(lengths) + args.new_tokens).items()}
    ids, mask = (t.to(device) for t in bench_generate.left_padded_prompts(lengths, size["vocab_size"]))
    times = time_interleaved(
        {side: lambda model=model: device_seconds(lambda: bench_generate.generate(model, ids, mask, args.new_tokens),
                                                   device) for side, model in models.items()},
        1, args.repeats)
    rates = {side: len(lengths) * args.new_tokens / median(samples) for side, samples in times.items()}
    prompts = torch.randint(1, size["vocab_size"], (len(lengths), 16),
                            generator=torch.Generator().manual_seed(args.seed)).to(device)
    tokens = {side: bench_generate.generate(model, prompts, torch.ones_like(prompts), args.new_tokens)
              for side, model in models.items()}
    agree = (tokens["roformer_hf"] == tokens["transformers"]).float().mean().item()
    print(f"\n### Generation: {size['num_hidden_layers']} layers of hidden {size['hidden_size']}, vocab "
          f"{size['vocab_size']}, {len(lengths)} prompts of 9-64 tokens left-padded, {args.new_tokens} new tokens "
          "each, greedy, cache on\n")
    print("| model | seconds | new tokens / s |\n|---|---|---|")
    for side, samples in times.items():
        print(f"| {side} | {median(samples):.3f} ({min(samples):.3f}-{max(samples):.3f}) | {rates[side]:,.0f} |")
    print(f"\nroformer_hf / transformers new tokens per second: **{rates['roformer_hf'] / rates['transformers']:.2f}x**."
          f" Unpadded 16-token prompts: {agree:.1%} of the generated tokens are transformers' ({args.dtype}).")


def replica(args: argparse.Namespace) -> None:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed)
    requests = {"one 16-token sentence": [16],
                "32 sentences of 8-32 tokens": torch.randint(8, 33, (32,), generator=generator).tolist()}
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, args, 512)
        encoders = {"transformers": transformers.RoFormerModel.from_pretrained(folder, attn_implementation="eager",
                                                                               dtype=dtype),
                    "roformer_hf": roformer_hf.RoFormerModel.from_pretrained(folder, attn_implementation="sdpa",
                                                                             dtype=dtype)}
    encoders = {side: encoder.to(device).eval() for side, encoder in encoders.items()}
    print("\n### The encoder forward of an embeddings request (mean pooling), sentences per second\n")
    print("| request | transformers, ms | roformer_hf, ms | transformers, sentences/s | roformer_hf, sentences/s | "
          "speed-up |\n|---|---|---|---|---|---|")
    for name, lengths in requests.items():
        ids, mask, _ = (t.to(device) for t in workload.padded_batch(tuple(lengths), args.vocab, args.seed))

        def embed(encoder: torch.nn.Module) -> torch.Tensor:
            with torch.inference_mode():
                hidden = encoder(ids, attention_mask=mask).last_hidden_state
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                return (hidden * weights).sum(1) / weights.sum(1)

        times = time_interleaved({side: lambda encoder=encoder: device_seconds(lambda: embed(encoder), device)
                                  for side, encoder in encoders.items()}, args.warmup, args.repeats)
        ms = {side: median(samples) for side, samples in times.items()}
        print(f"| {name} | {median_ms(times['transformers'])} | {median_ms(times['roformer_hf'])} | "
              f"{len(lengths) / ms['transformers']:,.0f} | {len(lengths) / ms['roformer_hf']:,.0f} | "
              f"{ms['transformers'] / ms['roformer_hf']:.2f}x |")


def profile(args: argparse.Namespace) -> None:
    """The operators of roformer_hf's training step on the mixed-length batch, by device time (torch.profiler)."""
    device = torch.device(args.device)
    lengths = tuple(args.lengths) * args.repeat_batch
    batch = tuple(t.to(device) for t in workload.padded_batch(lengths, args.vocab, args.seed))
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, args, max(lengths))
        model = masked_lm(folder, "roformer_hf", args).train()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        workload.train_step(model, batch)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=activities) as profiler:
        workload.train_step(model, batch)
        synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n### roformer_hf's training step, operators by device time ({len(lengths)} sequences)\n\n```")
    print(profiler.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
    print("```")


RUN = {"packing": packing, "long": long_sequences, "generation": generation, "replica": replica, "profile": profile}


# ---------------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = workload.timing_parser(__doc__.split("\n\n")[0], repeats=10, warmup=3, timed="calls per model")
    parser.set_defaults(layers=12)  # the GPU targets are at base size
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--repeat-batch", type=int, default=4,
                        help="the --lengths mix (packing) and the prompt mix (generation) repeated N times")
    parser.add_argument("--long-lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = workload.parse_args(build_parser(), argv, repeat_batch=1, long_lengths=[128, 256], new_tokens=8)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (`--device cpu --dtype fp32 --quick` smoke-tests this)")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"## GPU paths: roformer_hf against transformers' RoFormer, {args.dtype}\n")
    print(f"Masked LM: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, intermediate "
          f"{args.intermediate}, vocab {args.vocab}; dropout 0.\n")
    failed = []
    for section in args.sections:
        progress(section)
        try:
            RUN[section](args)
        except Exception:  # report and go on: one run on a lent GPU should bring back every section it can
            failed.append(section)
            print(f"\nFAIL: section {section}\n\n```\n{traceback.format_exc()}```")
    print("\nMachine:\n\n" + "\n".join(device_lines(torch.device(args.device))))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
