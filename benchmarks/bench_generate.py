"""Generation on CPU: roformer_hf's RoFormerForCausalLM against transformers' on the same weights, in one run.

    python benchmarks/bench_generate.py            # 8 prompts of mixed lengths, 64 new tokens, 4 layers of base width
    python benchmarks/bench_generate.py --quick    # tiny smoke configuration

Two measurements, both fp32, dropout 0, greedy decoding with the cache (transformers' `DynamicCache`), and the same
for roformer_hf's model in int8 (`roformer_hf.quantization.quantize_int8`; `--no-int8` to skip it):

- throughput: `generate()` on a left-padded batch of prompts of mixed lengths, exactly `--new-tokens` new tokens per
  prompt, interleaved between the two models; new tokens per second of each, and the ratio. transformers' RoFormer
  counts the left padding in its positions, so the two generate different tokens from padded rows; the work per
  step is the same.
- for int8, how many of the new tokens are those of roformer_hf's fp32 model (greedy decoding compounds a first
  difference, so this counts whole continuations, not single predictions);
- the cost of one decoding step as the prefix grows: the batch's cache (the one each model makes: transformers'
  `DynamicCache`, roformer_hf's `GrowingCache`) filled with `P` tokens per row, then the mean time of `--steps`
  one-token forwards, for each `P` in `--prefixes`. The GEMMs are those of one token per row whatever `P`; what grows
  with `P` is attention reading the cache, and, in a `DynamicCache`, the copy of the whole cache at every step.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from statistics import median

import torch
import transformers
from common import machine_lines, progress

import roformer_hf
from roformer_hf.quantization import int8_kernel_available, quantize_int8

INT8 = "roformer_hf int8"

BASE = {"vocab_size": 12000, "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
        "intermediate_size": 3072}
QUICK = {"vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, few tokens: checks that the script runs")
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 17, 64, 9, 33, 52, 25, 12],
                        help="the prompts' lengths (one prompt each)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=16, help="one-token steps timed at each prefix length")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=None,
                        help="also roformer_hf in int8 (default: where PyTorch has oneDNN's int8 kernel)")
    args = parser.parse_args(argv)
    if args.int8 is None:
        args.int8 = int8_kernel_available()
    if args.quick:
        args.lengths, args.new_tokens, args.repeats = [6, 3, 5], 4, 1
        args.prefixes, args.steps = [8, 32], 2
    return args


def build_models(size: dict, max_positions: int):
    """transformers' RoFormerForCausalLM with random weights, and roformer_hf's loaded from the folder it saved."""
    torch.manual_seed(0)
    config = transformers.RoFormerConfig(**size, is_decoder=True, max_position_embeddings=max_positions,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    reference = transformers.RoFormerForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        ours = roformer_hf.RoFormerForCausalLM.from_pretrained(folder).eval()
    return {"transformers": reference, "roformer_hf": ours}


def left_padded_prompts(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    longest = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), longest), generator=generator)
    mask = (torch.arange(longest)[None] >= longest - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def generate(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return out[:, ids.shape[1]:]


def time_generation(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    generate(model, ids, mask, new_tokens)
    return time.perf_counter() - start


def step_time(model, batch_size: int, prefix: int, steps: int, vocab: int) -> float:
    """Mean seconds of a one-token forward after a cache of `prefix` tokens per row."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, vocab, (batch_size, prefix + steps), generator=generator)
    with torch.inference_mode():
        cache = model(ids[:, :prefix], use_cache=True).past_key_values  # the cache each model makes for itself
        start = time.perf_counter()
        for step in range(steps):
            model(ids[:, prefix + step:prefix + step + 1], past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    size = QUICK if args.quick else BASE
    max_positions = max(max(args.prefixes) + args.steps, max(args.lengths) + args.new_tokens)
    models = build_models(size, max_positions)
    if args.int8:
        models[INT8] = quantize_int8(copy.deepcopy(models["roformer_hf"]))
    ids, mask = left_padded_prompts(args.lengths, size["vocab_size"])
    progress(f"throughput: {len(args.lengths)} prompts, {args.new_tokens} new tokens each")
    times = {name: [] for name in models}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in (list(models) if repeat % 2 else list(reversed(models))):
            seconds = time_generation(models[name], ids, mask, args.new_tokens)
            if repeat:
                times[name].append(seconds)
    tokens = len(args.lengths) * args.new_tokens
    rate = {name: tokens / median(samples) for name, samples in times.items()}

    progress(f"step cost at prefixes {args.prefixes}")
    steps = {(name, prefix): step_time(model, len(args.lengths), prefix, args.steps, size["vocab_size"])
             for prefix in args.prefixes for name, model in models.items()}

    print(f"\n## Generation on CPU ({time.strftime('%Y-%m-%d')})\n")
    print(f"{size['num_hidden_layers']} layers, hidden {size['hidden_size']}, {size['num_attention_heads']} heads, "
          f"vocab {size['vocab_size']}; fp32, dropout 0, greedy, cache on; prompts {args.lengths} (left-padded), "
          f"{args.new_tokens} new tokens each; median of {args.repeats}\n")
    print("| model | seconds | new tokens / s |")
    print("| --- | --- | --- |")
    for name, samples in times.items():
        print(f"| {name} | {median(samples):.3f} ({min(samples):.3f}-{max(samples):.3f}) | {rate[name]:.1f} |")
    print(f"\nroformer_hf / transformers tokens per second: **{rate['roformer_hf'] / rate['transformers']:.2f}x** "
          f"(target: at least 1x)\n")
    if INT8 in models:
        fp32, int8 = (generate(models[name], ids, mask, args.new_tokens) for name in ("roformer_hf", INT8))
        same = (fp32 == int8).double().mean().item()
        whole = (fp32 == int8).all(dim=1).sum().item()
        print(f"roformer_hf int8 / fp32 tokens per second: **{rate[INT8] / rate['roformer_hf']:.2f}x**; its new tokens "
              f"equal fp32's at {same:.1%} of positions ({whole} of {len(args.lengths)} continuations whole)\n")
    print(f"One decoding step ({len(args.lengths)} rows, one token each) after a cache of P tokens per row, mean of "
          f"{args.steps} steps:\n")
    print("| P | " + " | ".join(f"{name} (ms)" for name in models) + " |")
    print("| --- |" + " --- |" * len(models))
    for prefix in args.prefixes:
        print(f"| {prefix} | " + " | ".join(f"{1e3 * steps[(name, prefix)]:.2f}" for name in models) + " |")
    first, last = args.prefixes[0], args.prefixes[-1]
    growth = {name: steps[(name, last)] / steps[(name, first)] for name in models}
    print(f"\nstep cost at P={last} over P={first}: " + ", ".join(f"{name} {g:.2f}x" for name, g in growth.items()))
    print("\n" + "\n".join(machine_lines()))


if __name__ == "__main__":
    main()
