"""Attention dropout on CPU: a training step with dropout 0 and 0.1, in one run; at length by default.

    python benchmarks/bench_dropout.py            # 4096 tokens, base width, 4 layers (a few minutes on 2 cores)
    python benchmarks/bench_dropout.py --quick    # tiny smoke configuration (seconds)
    python benchmarks/bench_dropout.py --attention-only --repeats 3   # one layer's attention, the kernels alone
    python benchmarks/bench_dropout.py --length 256 --batch 8 --attention-only --repeats 10   # the demo's attention

Four settings of roformer_hf's RoFormerForMaskedLM (MLM training step: forward + backward, fp32, labels on ~15%
of the tokens, sparse prediction) on `--batch` sequences of `--length` tokens, each in a fresh process so that its
peak memory (`ru_maxrss`) is its own:

- dropout 0 (hidden and attention): SDPA's fused CPU kernel;
- hidden dropout 0.1 (`nn.Dropout` on the hidden states), attention dropout 0: what hidden dropout alone costs;
- dropout 0.1: roformer_hf's attention dropout (`blocked_dropout_attention_forward`): beyond two blocks of
  `DROPOUT_BLOCK_ROWS` queries `BlockedDropoutAttention`, one block of queries of one head at a time, the heads
  shared out among the threads, the dropout mask kept as bits and the weights recomputed in the backward pass; up to
  two blocks `DropoutAttention`, every head's weights at once in batched products;
- dropout 0.1 through SDPA's math kernel, which keeps the ``(heads, L, L)`` weights, their mask and the dropped
  weights, and draws one random number per weight: what PyTorch's SDPA does with dropout on CPU.

`--attention-only` times one layer's attention instead (forward + backward on random ``(batch, heads, L, 64)``
tensors), interleaved in one process: SDPA's fused kernel with dropout 0, and with dropout 0.1 the kernel roformer_hf
takes at that length and SDPA's math kernel.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from statistics import median

import torch
from workload import parse_args, size_of, timing_parser

# name -> (hidden dropout, attention dropout, roformer_hf's attention dropout kernel; else SDPA's math kernel)
SETTINGS = {"dropout 0": (0.0, 0.0, True), "hidden dropout 0.1, attention dropout 0": (0.1, 0.0, True),
            "dropout 0.1": (0.1, 0.1, True), "dropout 0.1, SDPA's math kernel": (0.1, 0.1, False)}


def sdpa_math_kernel(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' SDPA function with the dropout asked in training, which PyTorch runs in its math kernel on CPU,
    in place of roformer_hf's attention dropout (`attention.SDPA_DROPOUT`), with the same arguments."""
    from roformer_hf import attention

    attention_mask = attention.causal_unless_masked(module, query, key, attention_mask, kwargs.get("is_causal"))
    return attention.ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                                     dropout=dropout if module.training else 0.0, is_causal=False)


# Backward nodes of the attention kernels, by the name the tables give each.
KERNEL_NODES = {"DropoutAttentionBackward": "DropoutAttention", "BlockedDropoutAttentionBackward":
                "BlockedDropoutAttention", "ScaledDotProductFlashAttentionForCpuBackward0": "SDPA fused kernel",
                "SafeSoftmaxBackward0": "SDPA math kernel"}


def attention_kernels(loss: torch.Tensor) -> list[str]:
    """The attention kernels `loss` was computed through, found by their nodes in its autograd graph."""
    seen, stack, found = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() in KERNEL_NODES:
            found.add(KERNEL_NODES[node.name()])
        stack.extend(parent for parent, _ in node.next_functions)
    return sorted(found)


def worker(args) -> None:
    """Runs one setting and prints its timings and peak memory as JSON."""
    import roformer_hf
    from roformer_hf import attention

    hidden_dropout, attention_dropout, ours = SETTINGS[args.setting]
    if not ours:
        attention.AttentionInterface.register(attention.SDPA_DROPOUT, sdpa_math_kernel)
    size = size_of(args)
    config = roformer_hf.RoFormerConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.intermediate, hidden_dropout_prob=hidden_dropout,
        attention_probs_dropout_prob=attention_dropout, sparse_prediction=True)
    torch.manual_seed(args.seed)
    model = roformer_hf.RoFormerForMaskedLM(config).train()
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(5, size.vocab, (args.batch, args.length), generator=generator)
    labels = torch.where(torch.rand(ids.shape, generator=generator) < 0.15, ids, -100)
    times = []
    for step in range(args.warmup + args.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = model(ids, labels=labels).loss
        kernels = attention_kernels(loss)
        loss.backward()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": median(times), "min": min(times), "max": max(times), "peak_mib": peak_mib,
                      "kernels": kernels}))


def attention_only(args) -> None:
    """Times one layer's attention, forward + backward, with and without dropout, interleaved."""
    from types import SimpleNamespace

    from roformer_hf.attention import blocked_dropout_attention_forward
    from roformer_hf.blocked_dropout import DROPOUT_BLOCK_ROWS

    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.length, args.hidden // args.heads)
    query, key, value = (torch.randn(shape, generator=generator, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, generator=generator).transpose(1, 2)  # the kernels' output: (B, L, nh, d)
    scaling = shape[-1] ** -0.5
    module = SimpleNamespace(training=True, is_causal=False)
    ours = (f"BlockedDropoutAttention, {DROPOUT_BLOCK_ROWS} queries per block" if args.length > 2 * DROPOUT_BLOCK_ROWS
            else "DropoutAttention, every weight at once")
    kernels = {
        "SDPA fused kernel, dropout 0": lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, scale=scaling).transpose(1, 2),
        f"{ours}, dropout 0.1": lambda: blocked_dropout_attention_forward(
            module, query, key, value, None, scaling, dropout=0.1)[0],
        "SDPA math kernel, dropout 0.1": lambda: sdpa_math_kernel(module, query, key, value, None, scaling,
                                                                  dropout=0.1)[0],
    }
    times = {name: [] for name in kernels}
    for step in range(args.warmup + args.repeats):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel().backward(grad)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
            query.grad = key.grad = value.grad = None
    base = median(next(iter(times.values())))
    print(f"\nattention of one layer, forward + backward: {shape} (batch, heads, tokens, head dim), fp32, CPU, "
          f"{torch.get_num_threads()} threads; interleaved, median of {args.repeats} after {args.warmup} warm-up\n")
    print("| kernel | forward + backward | / fused kernel |")
    print("| --- | --- | --- |")
    for name, seconds in times.items():
        print(f"| {name} | {1e3 * median(seconds):.1f} ms ({1e3 * min(seconds):.1f}-{1e3 * max(seconds):.1f}) "
              f"| {median(seconds) / base:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=2, warmup=1)
    parser.add_argument("--length", type=int, default=4096, help="tokens in each sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the batch")
    parser.add_argument("--attention-only", action="store_true", help="time one layer's attention kernels alone")
    parser.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parse_args(parser, argv, length=512, repeats=1)
    if args.attention_only:
        return attention_only(args)
    if args.setting:
        return worker(args)
    results = {}
    for setting in SETTINGS:
        command = [sys.executable, __file__, "--setting", setting, *(argv if argv is not None else sys.argv[1:])]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[setting] = json.loads(done.stdout.strip().splitlines()[-1])
    size = size_of(args)
    base = results["dropout 0"]
    print(f"\nroformer_hf MLM training step on {args.batch} x {args.length} tokens; {size.layers} layers, hidden "
          f"{size.hidden}, {size.heads} heads, intermediate {size.intermediate}, vocabulary {size.vocab}; fp32, "
          f"CPU, {torch.get_num_threads()} threads; median of {args.repeats} after {args.warmup} warm-up; peak "
          "memory = the process's maximum resident set\n")
    print("| dropout (hidden, attention) | attention kernel | step | peak memory | time / dropout 0 "
          "| memory / dropout 0 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for setting, result in results.items():
        print(f"| {setting} | {', '.join(result['kernels'])} "
              f"| {result['seconds']:.2f} s ({result['min']:.2f}-{result['max']:.2f}) "
              f"| {result['peak_mib']:,.0f} MiB | {result['seconds'] / base['seconds']:.2f}x "
              f"| {result['peak_mib'] / base['peak_mib']:.2f}x |")


if __name__ == "__main__":
    main()
