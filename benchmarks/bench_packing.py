"""Training throughput with packed rows (padding-free batches) against padded ones, on CPU, in one run.

    python benchmarks/bench_packing.py            # base width, both workloads (a few minutes on 2 cores)
    python benchmarks/bench_packing.py --quick    # tiny smoke configuration (seconds)

Three ways to train on the same examples, one MLM training step (forward + backward) each, fp32, dropout 0:

- transformers' RoFormer on the padded batch (eager attention, its only kernel);
- roformer_hf on the padded batch (it skips the padding internally);
- roformer_hf on one packed row, as `DataCollatorWithFlattening` gives it (positions restart per example,
  `cu_seq_lens_q/k` passed).

Two workloads: the CPU benchmark's mixed lengths (8 sequences of 512...128 tokens), and a spread of short lines
(64 lines, lengths log-normal around 20 tokens, 4 to 128, like lines of verse or chat turns). Throughput is real
(non-padding) tokens per second; all three see the same labelled tokens and must give the same loss.
"""

from __future__ import annotations

import tempfile
import time
from statistics import median

import torch
from common import machine_lines
from workload import allocator_line, keep_freed_memory, parse_args, size_of, timing_parser, transformers_config

SHORT_LINES = 64


def short_line_lengths(count: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(count, generator=generator) * 0.6 + torch.log(torch.tensor(20.0)))
    return tuple(int(n) for n in lengths.round().clamp(4, 128))


def examples(lengths: tuple[int, ...], vocab: int, seed: int, mlm_fraction: float = 0.15):
    """Random ids and MLM labels (~15% of tokens) for each example."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, vocab, (n,), generator=generator)
        labels = torch.where(torch.rand(n, generator=generator) < mlm_fraction, ids, -100)
        out.append((ids, labels))
    return out


def padded_inputs(batch) -> dict[str, torch.Tensor]:
    length = max(len(ids) for ids, _ in batch)
    input_ids = torch.zeros(len(batch), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (ids, row_labels) in enumerate(batch):
        input_ids[row, :len(ids)], attention_mask[row, :len(ids)], labels[row, :len(ids)] = ids, 1, row_labels
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_inputs(batch) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(ids) for ids, _ in batch])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return {
        "input_ids": torch.cat([ids for ids, _ in batch])[None],
        "labels": torch.cat([labels for _, labels in batch])[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()])[None],
        "cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets,
        "max_length_q": int(lengths.max()), "max_length_k": int(lengths.max()),
    }


def train_step(model, inputs) -> tuple[float, float]:
    """(seconds, loss) of one forward + backward; gradients cleared outside the timed region."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(**inputs).loss
    loss.backward()
    return time.perf_counter() - start, loss.item()


def run_workload(name: str, lengths: tuple[int, ...], models: dict, args) -> dict:
    batch = examples(lengths, args.vocab, args.seed)
    contenders = {
        "transformers, padded": (models["transformers"], padded_inputs(batch)),
        "roformer_hf, padded": (models["roformer_hf"], padded_inputs(batch)),
        "roformer_hf, packed": (models["roformer_hf"], packed_inputs(batch)),
    }
    times = {key: [] for key in contenders}
    losses = {}
    for repeat in range(args.warmup + args.repeats):
        order = list(contenders) if repeat % 2 == 0 else list(reversed(contenders))
        for key in order:
            seconds, losses[key] = train_step(*contenders[key])
            if repeat >= args.warmup:
                times[key].append(seconds)
    reference = losses["transformers, padded"]
    for key, loss in losses.items():
        if abs(loss - reference) > args.tolerance:
            raise SystemExit(f"{name}: the loss of {key} is {loss}, transformers' padded {reference}")
    tokens = sum(lengths)
    padded_tokens = len(lengths) * max(lengths)
    rates = {key: tokens / median(values) for key, values in times.items()}
    return {"name": name, "lengths": lengths, "tokens": tokens, "padded_tokens": padded_tokens, "rates": rates,
            "spread": {key: (tokens / max(values), tokens / min(values)) for key, values in times.items()},
            "loss_diff": max(abs(loss - reference) for loss in losses.values())}


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__, repeats=5, warmup=1, timed="steps per way and workload")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max loss difference allowed")
    args = parse_args(parser, argv, repeats=3)
    if args.keep_freed_memory:
        keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    size = size_of(args)
    short = short_line_lengths(16 if args.quick else SHORT_LINES, args.seed)
    workloads = [("mixed lengths", args.lengths), ("short lines", short)]

    import transformers

    import roformer_hf

    with tempfile.TemporaryDirectory() as folder:
        reference = transformers.RoFormerForMaskedLM(transformers_config(size, max(max(args.lengths), 128)))
        reference.save_pretrained(folder)
        models = {"transformers": reference.train(),
                  "roformer_hf": roformer_hf.RoFormerForMaskedLM.from_pretrained(
                      folder, attn_implementation="sdpa", sparse_prediction=True).train()}
        results = [run_workload(name, lengths, models, args) for name, lengths in workloads]

    print("\n" + "\n".join(machine_lines()) + f"\n- allocator: {allocator_line(args)}")
    print(f"model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}, "
          f"vocabulary {size.vocab}; MLM training step (forward + backward), fp32, dropout 0, "
          f"median of {args.repeats} after {args.warmup} warm-up\n")
    print("| workload | real tokens (padded) | transformers padded | roformer_hf padded | roformer_hf packed | "
          "packed / our padded | packed / transformers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        rates = result["rates"]
        packed = rates["roformer_hf, packed"]
        print(f"| {result['name']} ({len(result['lengths'])} examples) | {result['tokens']} ({result['padded_tokens']}) "
              f"| {rates['transformers, padded']:,.0f} tok/s | {rates['roformer_hf, padded']:,.0f} tok/s "
              f"| {packed:,.0f} tok/s | {packed / rates['roformer_hf, padded']:.2f}x "
              f"| {packed / rates['transformers, padded']:.2f}x |")
    print("\nmin-max tokens/s over the timed steps:")
    for result in results:
        spread = ", ".join(f"{key} {low:,.0f}-{high:,.0f}" for key, (low, high) in result["spread"].items())
        print(f"- {result['name']}: {spread}; largest loss difference {result['loss_diff']:.1e}")


if __name__ == "__main__":
    main()
