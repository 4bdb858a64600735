"""Where roformer_hf spends its CPU time: the inference forward and a training step under torch.profiler.

    python benchmarks/profile_cpu.py              # the CPU target settings (see workload.py)
    python benchmarks/profile_cpu.py --dtype bf16 # the same with bf16 weights and activations
    python benchmarks/profile_cpu.py --quick      # tiny configuration
    python benchmarks/profile_cpu.py --trace /tmp/roformer   # also write Chrome traces (chrome://tracing)

Prints the top operators by self CPU time for each, with the share of the step they take. The model is a randomly
initialised roformer_hf model (speed does not depend on the weights) in --dtype; dropout is off, as in bench_cpu.py.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from common import machine_lines
from torch.profiler import ProfilerActivity, profile
from workload import DTYPES, add_size_arguments, allocator_line, keep_freed_memory, padded_batch, parse_args, size_of

# Operator-name fragments -> the part of the model they stand for; the first match wins.
CATEGORIES = (
    ("GEMM (linear layers, decoder)", ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")),
    ("attention kernel", ("scaled_dot_product", "aten::_softmax", "aten::_softmax_backward")),
    ("index ops (pack/unpack padding; embedding lookup and its backward)",
     ("aten::index", "aten::nonzero", "aten::masked_select", "aten::scatter", "aten::gather", "aten::embedding")),
    ("GELU", ("aten::gelu",)),
    ("LayerNorm", ("layer_norm",)),
    ("MLM loss (log-softmax over the vocabulary, NLL)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("copies, layout changes", ("aten::copy_", "aten::clone", "aten::cat", "aten::stack", "aten::contiguous")),
    ("zero-filling (new_zeros, zero_grad, fill_)", ("aten::fill_", "aten::zero_", "aten::zeros")),
    ("other elementwise (rotary, residual add, bias grads)", ("aten::add", "aten::mul", "aten::sub", "aten::neg",
                                                               "aten::div", "aten::sum")),
)


def build_model(args: argparse.Namespace):
    import roformer_hf

    size = size_of(args)
    config = roformer_hf.RoFormerConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.intermediate, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation=args.attn, sparse_prediction=not args.dense_prediction,
    )
    torch.manual_seed(args.seed)
    return roformer_hf.RoFormerForMaskedLM(config).to(DTYPES[args.dtype])


def categorize(averages, total: float) -> dict[str, tuple[float, list[str]]]:
    """Share of `total` self CPU time per category, with the category's operators, largest first."""
    members: dict[str, list] = {}
    for event in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True):
        category = next((name for name, fragments in CATEGORIES if any(f in event.key for f in fragments)),
                        "other")
        members.setdefault(category, []).append(event)
    return {category: (sum(e.self_cpu_time_total for e in events) / total, [e.key for e in events])
            for category, events in members.items()}


def profile_step(name: str, step, warmup: int, args: argparse.Namespace) -> None:
    for _ in range(warmup):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    step()
    unprofiled = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        start = time.perf_counter()
        step()
        profiled = time.perf_counter() - start
    averages = prof.key_averages(group_by_input_shape=args.shapes)
    total = sum(event.self_cpu_time_total for event in averages)
    print(f"\n## {name}: {total / 1e6:.3f} s of self CPU time; wall time {profiled:.3f} s profiled, "
          f"{unprofiled:.3f} s unprofiled just before, with {faults} page faults ({faults * 4 / 1024:.0f} MiB of fresh "
          "pages; their cost shows in whichever operator first writes them)\n")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    print(f"Top {args.rows} by share of self CPU time:")
    for event in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]:
        print(f"  {event.self_cpu_time_total / total:6.1%}  {event.self_cpu_time_total / 1e3:9.1f} ms  "
              f"{event.count:5d} calls  {event.key}")
    print("\nBy part of the model (self CPU time):")
    for category, (share, ops) in sorted(categorize(averages, total).items(), key=lambda item: -item[1][0]):
        print(f"  {share:6.1%}  {category}: {', '.join(ops[:4])}{', ...' if len(ops) > 4 else ''}")
    if args.trace:
        path = f"{args.trace}_{name.replace(' ', '_')}.json"
        prof.export_chrome_trace(path)
        print(f"trace written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_arguments(parser)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="weights and activations")
    parser.add_argument("--dense-prediction", action="store_true",
                        help="training runs the MLM head on every token (default: labelled ones only, as bench_cpu.py)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rows", type=int, default=15, help="operators to list")
    parser.add_argument("--shapes", action="store_true", help="record input shapes and group by them")
    parser.add_argument("--trace", default=None, help="path prefix for Chrome traces")
    args = parse_args(parser)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.keep_freed_memory:
        keep_freed_memory()

    model = build_model(args)
    input_ids, attention_mask, labels = padded_batch(args.lengths, args.vocab, args.seed)
    print(f"roformer_hf {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, lengths "
          f"{'/'.join(map(str, args.lengths))}, {args.dtype}, {torch.get_num_threads()} threads, attention {args.attn}\n"
          f"allocator: {allocator_line(args)}")

    def forward():
        with torch.inference_mode():
            model(input_ids, attention_mask=attention_mask)

    def train_step():
        model.zero_grad(set_to_none=True)
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()

    model.eval()
    profile_step("inference forward", forward, args.warmup, args)
    model.train()
    profile_step("training step", train_step, args.warmup, args)
    print("\nMachine:\n\n" + "\n".join(machine_lines()))


if __name__ == "__main__":
    main()
