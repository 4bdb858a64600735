"""Per-sequence attention on CPU, the way roformer_hf's inference forward runs it: SDPA against an explicit
``softmax(q k^T) v`` and, where it is built, `few_rows.attention` (a short input's attention in one call), in fp32 and
bf16, on the CPU benchmark's sequence lengths.

    python benchmarks/bench_attention.py              # base width (12 heads of 64), the benchmark's 8 lengths
    python benchmarks/bench_attention.py --lengths 16,32,64,128,256 --forward   # short inputs, and the forwards
    python benchmarks/bench_attention.py --quick      # tiny smoke configuration (seconds)

roformer_hf attends within each sequence with `F.scaled_dot_product_attention` (SDPA's fused CPU kernel: scores and
softmax in fp32 blocks whatever the input dtype). The explicit form is two batched GEMMs and a softmax in the input's
dtype, as transformers' eager attention computes it: in bf16 its scores are rounded to bf16 before the softmax.

For each dtype it reports one layer's attention time (the sum over the batch's sequences, each ``(1, heads, n, d)``
with the strided layout the model passes: views of ``(n, heads, d)``), its GFLOP/s (4 n^2 H per sequence), and the
relative error of its output against the same attention computed in float64 from the same (rounded) inputs.
Timings are medians of --repeats, the kernels interleaved. `few_rows.attention` runs twice: without rotation (the
same arithmetic as SDPA's rows) and with it, against the rotations and SDPA call it replaces in a forward
(`plan.few_token_attention`), whose error is measured against float64 attention of the same rotated inputs.

`--forward` also times a model's forward (`--layers`, `--hidden`, ... of the CPU benchmark; one sequence of each
length, then `--short` sentences of 8-32 tokens in one batch, their padding skipped) with `few_rows.attention` and
without it (SDPA: `plan.FEW_TOKENS_LONGEST` set to -1), interleaved, at each of `--precisions` (default: those the CPU
computes natively; int8 is `quantize_int8`'s). ``--short 0`` leaves the short sentences out.
"""

from __future__ import annotations

import argparse
import copy
from statistics import median

import torch
import torch.nn.functional as F
from bench_embeddings import batches, sentences
from common import machine_lines, native_precisions, spread, time_interleaved, time_once
from workload import DTYPES, add_size_arguments, parse_args

from roformer_hf import RoFormerConfig, RoFormerModel, few_rows, plan
from roformer_hf.quantization import quantize_int8
from roformer_hf.rotary import inverse_frequencies, rotary_phases, rotate


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (1, nh, n, n), in q's dtype
    return torch.matmul(scores.softmax(-1), v)


def few_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    heads, n, d = q.shape[1:]
    flat = (t[0].transpose(0, 1).flatten(-2) for t in (q, k, v))  # (n, heads * d) views of the projection
    return few_rows.attention(*flat, None, [n], heads, d ** -0.5).view(n, heads, d).transpose(0, 1).unsqueeze(0)


KERNELS = {"SDPA": sdpa, "explicit (eager)": explicit}
if few_rows.attention_available():
    KERNELS["few_rows.attention"] = few_tokens


def phases_of(q: torch.Tensor) -> torch.Tensor:
    """The rotation of positions ``0 .. n - 1`` for `q` ``(1, heads, n, d)``: ``(n, 1, d/2, 2)``."""
    return rotary_phases(torch.arange(q.shape[2]), inverse_frequencies(q.shape[3])).unsqueeze(-3)


def rotated_inputs(q: torch.Tensor, k: torch.Tensor, phases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a forward's two rotations make of `q` and `k` ``(1, heads, n, d)``: `rotary.rotate` on ``(n, heads, d)``,
    complex phases, as the model passes them."""
    turns = torch.view_as_complex(phases)
    return tuple(rotate(t[0].transpose(0, 1), turns).transpose(0, 1).unsqueeze(0) for t in (q, k))


def rotation_and_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    q, k = rotated_inputs(q, k, phases)
    return F.scaled_dot_product_attention(q, k, v)


def few_tokens_rotating(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    heads, n, d = q.shape[1:]
    flat = (t[0].transpose(0, 1).flatten(-2) for t in (q, k, v))
    return few_rows.attention(*flat, phases, [n], heads, d ** -0.5).view(n, heads, d).transpose(0, 1).unsqueeze(0)


ROTATING = {"rotations + SDPA": rotation_and_sdpa}
if few_rows.attention_available():
    ROTATING["few_rows.attention, rotation included"] = few_tokens_rotating


def sequences(lengths: tuple[int, ...], heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Per sequence, q, k, v as ``(1, heads, n, head_dim)`` views of one ``(n, 3, heads, head_dim)`` tensor."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for n in lengths:
        qkv = torch.randn(n, 3, heads, head_dim, generator=generator).to(dtype)
        batch.append(tuple(qkv[:, i].transpose(0, 1).unsqueeze(0) for i in range(3)))
    return batch


def relative_error(kernel, batch, rotating: bool = False) -> float:
    """``||out - reference|| / ||reference||`` over the batch, the reference in float64 from the same inputs (rotated
    as the forward rotates them, for a `rotating` kernel)."""
    squared_error, squared_norm = 0.0, 0.0
    for q, k, v in batch:
        output = kernel(q, k, v, phases_of(q)) if rotating else kernel(q, k, v)
        if rotating:
            q, k = rotated_inputs(q, k, phases_of(q))
        reference = explicit(q.double(), k.double(), v.double())
        squared_error += (output.double() - reference).square().sum().item()
        squared_norm += reference.square().sum().item()
    return (squared_error / squared_norm) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_arguments(parser)  # --lengths, --heads, --threads, --seed, --quick; the model of `--forward`
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of: " + ", ".join(DTYPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--forward", action="store_true", help="also time the model's forwards with and without "
                        "few_rows.attention")
    parser.add_argument("--short", type=int, default=32, help="short sentences in the --forward batch (0: none)")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16", "int8"), default=native_precisions(),
                        help="the --forward models' precisions (default: those this CPU computes natively, "
                        "%(default)s)")
    args = parse_args(parser, lengths=(64, 48, 32), heads=2, head_dim=16, repeats=2, short=4)
    if unknown := set(args.dtypes.split(",")) - set(DTYPES):
        parser.error(f"--dtypes {args.dtypes}: unknown {sorted(unknown)}; expected some of {', '.join(DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    flops = sum(4 * n * n * args.heads * args.head_dim for n in args.lengths)
    print(f"\n### Attention alone: {args.heads} heads of {args.head_dim}, sequences of "
          f"{'/'.join(map(str, args.lengths))} tokens, one layer ({flops / 1e9:.2f} GFLOP), inference\n")
    print("| dtype | kernel | ms per layer: median (min–max) | GFLOP/s | time / SDPA's (with rotations: theirs) | "
          "relative error vs float64 |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            batch = sequences(args.lengths, args.heads, args.head_dim, DTYPES[name], args.seed)
            phases = [phases_of(q) for q, _, _ in batch]
            runners = {kernel: (lambda f=f: time_once(lambda: [f(q, k, v) for q, k, v in batch]))
                       for kernel, f in KERNELS.items()}
            runners.update({kernel: (lambda f=f: time_once(lambda: [f(*qkv, p) for qkv, p in zip(batch, phases)]))
                            for kernel, f in ROTATING.items()})
            times = time_interleaved(runners, args.warmup, args.repeats)
            for kernel, f in {**KERNELS, **ROTATING}.items():
                seconds = median(times[kernel])
                baseline = median(times["rotations + SDPA" if kernel in ROTATING else "SDPA"])
                print(f"| {name} | {kernel} | {spread([t * 1e3 for t in times[kernel]])} | {flops / seconds / 1e9:.0f} "
                      f"| {seconds / baseline:.2f} | {relative_error(f, batch, kernel in ROTATING):.2e} |")
        if args.forward:
            forwards(args)
    print("\nMachine:\n")
    print("\n".join(machine_lines()))


def forwards(args: argparse.Namespace) -> None:
    """A model's forward with `few_rows.attention` and without it, at each precision, interleaved."""
    config = RoFormerConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, intermediate_size=args.intermediate,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(args.seed)
    fp32 = RoFormerModel(config).eval()
    made = {"fp32": lambda: fp32, "bf16": lambda: copy.deepcopy(fp32).to(torch.bfloat16),
            "int8": lambda: quantize_int8(copy.deepcopy(fp32))}
    models = {precision: made[precision]() for precision in args.precisions}
    inputs = [(f"one sentence of {n} tokens", torch.randint(5, args.vocab, (1, n))) for n in args.lengths]
    if args.short:
        ids, mask = batches(sentences(8, 32, args.short, args.vocab, args.seed), args.short)[0]
        inputs.append((f"{args.short} short sentences (8-32 tokens, padding skipped)", (ids, mask)))
    longest = plan.FEW_TOKENS_LONGEST
    print(f"\n### The forward with few_rows.attention and without it (SDPA): {args.layers} layers, "
          f"hidden {args.hidden}, "
          f"{args.heads} heads; few_rows.attention up to {longest} tokens\n")
    print("| precision | input | with (ms) | without (ms) | with / without |")
    print("|---|---|---|---|---|")

    def timed(model, batch, limit: int) -> float:
        plan.FEW_TOKENS_LONGEST = limit
        ids, mask = batch if isinstance(batch, tuple) else (batch, torch.ones_like(batch))
        return time_once(lambda: model(input_ids=ids, attention_mask=mask))
    try:
        for precision, model in models.items():
            for label, batch in inputs:
                runners = {"with": lambda: timed(model, batch, longest), "without": lambda: timed(model, batch, -1)}
                times = time_interleaved(runners, args.warmup, args.repeats * 3)
                with_, without = median(times["with"]), median(times["without"])
                print(f"| {precision} | {label} | {spread([t * 1e3 for t in times['with']])} | "
                      f"{spread([t * 1e3 for t in times['without']])} | {with_ / without:.3f}x |")
    finally:
        plan.FEW_TOKENS_LONGEST = longest


if __name__ == "__main__":
    main()
