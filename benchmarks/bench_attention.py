"""Per-sequence attention on CPU, the way roformer_hf's inference forward runs it: SDPA against an explicit
``softmax(q k^T) v``, in fp32 and bf16, on the CPU benchmark's sequence lengths.

    python benchmarks/bench_attention.py              # base width (12 heads of 64), the benchmark's 8 lengths
    python benchmarks/bench_attention.py --quick      # tiny smoke configuration (seconds)

roformer_hf attends within each sequence with `F.scaled_dot_product_attention` (SDPA's fused CPU kernel: scores and
softmax in fp32 blocks whatever the input dtype). The explicit form is two batched GEMMs and a softmax in the input's
dtype, as transformers' eager attention computes it: in bf16 its scores are rounded to bf16 before the softmax.

For each dtype it reports one layer's attention time (the sum over the batch's sequences, each ``(1, heads, n, d)``
with the strided layout the model passes: views of ``(n, heads, d)``), its GFLOP/s (4 n^2 H per sequence), and the
relative error of its output against the same attention computed in float64 from the same (rounded) inputs.
Timings are medians of --repeats, the kernels interleaved.
"""

from __future__ import annotations

import argparse
from statistics import median

import torch
import torch.nn.functional as F
from common import machine_lines, spread, time_interleaved, time_once
from workload import DTYPES, TARGET_LENGTHS, parse_args


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (1, nh, n, n), in q's dtype
    return torch.matmul(scores.softmax(-1), v)


KERNELS = {"SDPA": sdpa, "explicit (eager)": explicit}


def sequences(lengths: tuple[int, ...], heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Per sequence, q, k, v as ``(1, heads, n, head_dim)`` views of one ``(n, 3, heads, head_dim)`` tensor."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for n in lengths:
        qkv = torch.randn(n, 3, heads, head_dim, generator=generator).to(dtype)
        batch.append(tuple(qkv[:, i].transpose(0, 1).unsqueeze(0) for i in range(3)))
    return batch


def relative_error(kernel, batch) -> float:
    """``||out - reference|| / ||reference||`` over the batch, the reference in float64 from the same inputs."""
    squared_error, squared_norm = 0.0, 0.0
    for q, k, v in batch:
        reference = explicit(q.double(), k.double(), v.double())
        squared_error += (kernel(q, k, v).double() - reference).square().sum().item()
        squared_norm += reference.square().sum().item()
    return (squared_error / squared_norm) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=TARGET_LENGTHS)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of: " + ", ".join(DTYPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds)")
    args = parse_args(parser, lengths=(64, 48, 32), heads=2, head_dim=16, repeats=2)
    if unknown := set(args.dtypes.split(",")) - set(DTYPES):
        parser.error(f"--dtypes {args.dtypes}: unknown {sorted(unknown)}; expected some of {', '.join(DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    flops = sum(4 * n * n * args.heads * args.head_dim for n in args.lengths)
    print(f"\n### Attention alone: {args.heads} heads of {args.head_dim}, sequences of "
          f"{'/'.join(map(str, args.lengths))} tokens, one layer ({flops / 1e9:.2f} GFLOP), inference\n")
    print("| dtype | kernel | ms per layer: median (min–max) | GFLOP/s | time / SDPA's | relative error vs float64 |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            batch = sequences(args.lengths, args.heads, args.head_dim, DTYPES[name], args.seed)
            runners = {kernel: (lambda f=f: time_once(lambda: [f(q, k, v) for q, k, v in batch]))
                       for kernel, f in KERNELS.items()}
            times = time_interleaved(runners, args.warmup, args.repeats)
            for kernel, f in KERNELS.items():
                seconds = median(times[kernel])
                print(f"| {name} | {kernel} | {spread([t * 1e3 for t in times[kernel]])} | {flops / seconds / 1e9:.0f} "
                      f"| {seconds / median(times['SDPA']):.2f} | {relative_error(f, batch):.2e} |")
    print("\nMachine:\n")
    print("\n".join(machine_lines()))


if __name__ == "__main__":
    main()
