#!/usr/bin/env python
"""Masked-LM loss on inputs longer than training, without scaling and with each RoPE scaling type.

Trains a small RoFormer on the built-in Shakespeare text in blocks of `--train_length` tokens (a few minutes on two
CPU cores), then evaluates it, unchanged, on the same validation tokens cut into blocks of 1x to 8x that length,
under each `rope_parameters` (only the rotation frequencies and the attention factor change; the weights do not):

- none: `{"rope_type": "default"}`, the rotation the model was trained with, carried on to new positions;
- linear, yarn, longrope, llama3: configured for each evaluation length, `factor` = length / training length
  (`original_max_position_embeddings` = the training length); LongRoPE's `long_factor`s, normally searched per
  model, are set here to a geometric ramp from 1 (fastest frequency) to `factor` (slowest);
- dynamic: one setting, `factor` 2, that adapts to the length of each batch.

At 1x every type is the unscaled rotation, so the first column is the same for all. Writes a plot
(`<output_dir>/length_extrapolation.png`) and prints a Markdown table of the losses (docs/roformer-family.md shows
both).

    python examples/length_extrapolation.py                 # writes docs/length_extrapolation.png
    python examples/length_extrapolation.py --steps 200 --output_dir /tmp/extrapolation   # a quick look
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from lib.shakespeare import mlm_corpus_splits

import roformer_hf
from roformer_hf.configuration import ROPE_TYPES as ROPE_TABLE

logger = logging.getLogger("length_extrapolation")

# Small enough to train in minutes on two cores; the MLM head runs on the masked tokens only (sparse_prediction).
MODEL = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "sparse_prediction": True}
MULTIPLES = (1, 2, 4, 8)
# Every rope type of roformer_hf, by the name its row has in the table and plot: "none" is the trained rotation.
ROPE_TYPES = {"none" if rope_type == "default" else rope_type: rope_type for rope_type in ROPE_TABLE}
DYNAMIC_FACTOR = 2.0


def rope_parameters(rope_type: str, factor: float, head_dim: int, train_length: int) -> dict:
    """The `rope_parameters` of `rope_type` for inputs `factor` times the training length: a value for each key of
    its row of `ROPE_TYPES` that this example sets (the others keep transformers' defaults)."""
    half = head_dim // 2
    values = {"factor": DYNAMIC_FACTOR if rope_type == "dynamic" else factor,
              "original_max_position_embeddings": train_length,
              "short_factor": [1.0] * half, "long_factor": [factor ** (i / max(half - 1, 1)) for i in range(half)],
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return {"rope_type": rope_type, **{key: values[key] for key in ROPE_TABLE[rope_type].reads if key in values}}


def token_stream(texts, tokenizer) -> torch.Tensor:
    """All lines' tokens, one after the other, without special tokens: blocks of any length are cut from it."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return torch.tensor([token for line in ids for token in line])


def mask_tokens(ids: torch.Tensor, tokenizer, generator: torch.Generator, probability: float = 0.15):
    """BERT's masking: `probability` of the tokens are predicted; of those 80% become [MASK], 10% a random token."""
    labels = ids.clone()
    chosen = torch.rand(ids.shape, generator=generator) < probability
    labels[~chosen] = -100
    inputs = ids.clone()
    draw = torch.rand(ids.shape, generator=generator)
    inputs[chosen & (draw < 0.8)] = tokenizer.mask_token_id
    randomised = chosen & (draw >= 0.8) & (draw < 0.9)
    inputs[randomised] = torch.randint(5, len(tokenizer), (int(randomised.sum()),), generator=generator)
    return inputs, labels


def train(model, stream: torch.Tensor, tokenizer, args) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    blocks = stream[: len(stream) // args.train_length * args.train_length].view(-1, args.train_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, max(0.0, (args.steps - step) / (args.steps - warmup))))
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        rows = torch.randint(len(blocks), (args.batch_size,), generator=generator)
        inputs, labels = mask_tokens(blocks[rows], tokenizer, generator)
        loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            logger.info("step %d/%d  loss %.3f  (%.0f s)", step, args.steps, loss.item(), time.perf_counter() - start)


@torch.no_grad()
def evaluate(trained, stream: torch.Tensor, tokenizer, args) -> dict[str, dict[int, float]]:
    """Masked-LM loss per rope type and evaluation length, on the same tokens masked the same way for every length."""
    longest = args.train_length * MULTIPLES[-1]
    usable = min(len(stream), args.eval_tokens) // longest * longest
    inputs, labels = mask_tokens(stream[:usable], tokenizer, torch.Generator().manual_seed(args.seed + 1))
    losses: dict[str, dict[int, float]] = {}
    for name, rope_type in ROPE_TYPES.items():
        losses[name] = {}
        for multiple in MULTIPLES:
            length = args.train_length * multiple
            config = roformer_hf.RoFormerConfig(**{
                **trained.config.to_dict(),
                "rope_parameters": rope_parameters(rope_type, float(multiple), trained.config.head_dim,
                                                   args.train_length)})
            model = roformer_hf.RoFormerForMaskedLM(config).eval()
            model.load_state_dict(trained.state_dict())
            total, count = 0.0, 0
            for batch_inputs, batch_labels in zip(inputs.view(-1, length).split(args.eval_batch_tokens // length),
                                                  labels.view(-1, length).split(args.eval_batch_tokens // length)):
                logits = model(input_ids=batch_inputs).logits
                total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch_labels.flatten(),
                                                           reduction="sum").item()
                count += int((batch_labels != -100).sum())
            losses[name][length] = total / count
            logger.info("%-8s length %4d: loss %.3f", name, length, losses[name][length])
    return losses


def format_table(losses: dict[str, dict[int, float]], args) -> str:
    lengths = list(next(iter(losses.values())))
    header = "| rope_parameters | " + " | ".join(f"{length} ({length // args.train_length}x)" for length in lengths)
    lines = [header + " |", "|" + " --- |" * (len(lengths) + 1)]
    for rope_type, by_length in losses.items():
        lines.append(f"| {rope_type} | " + " | ".join(f"{loss:.3f}" for loss in by_length.values()) + " |")
    lines.append("")
    lines.append(f"Masked-LM loss (cross-entropy, nats) on held-out plays; trained {args.steps} steps at "
                 f"{args.train_length} tokens. Lower is better.")
    return "\n".join(lines) + "\n"


def plot(losses: dict[str, dict[int, float]], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rope_type, by_length in losses.items():
        ax.plot(list(by_length), list(by_length.values()), "o-", label=rope_type)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(next(iter(losses.values()))), [str(length) for length in next(iter(losses.values()))])
    ax.axvline(args.train_length, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="evaluation length (tokens)", ylabel="masked-LM loss",
           title=f"RoFormer trained at {args.train_length} tokens, evaluated longer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    parser.add_argument("--train_length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--vocab_size", type=int, default=2000)
    parser.add_argument("--eval_tokens", type=int, default=16384, help="validation tokens scored at every length")
    parser.add_argument("--eval_batch_tokens", type=int, default=4096)
    parser.add_argument("--max_lines", type=int, default=None, help="use only the first lines of each split")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[int, float]]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    splits = mlm_corpus_splits(seed=args.seed)
    train_text, validation_text = (splits[split]["text"][:args.max_lines] for split in ("train", "validation"))
    tokenizer = roformer_hf.train_tokenizer(train_text, vocab_size=args.vocab_size)
    train_stream, validation_stream = token_stream(train_text, tokenizer), token_stream(validation_text, tokenizer)
    config = roformer_hf.RoFormerConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        max_position_embeddings=args.train_length, **MODEL)
    model = roformer_hf.RoFormerForMaskedLM(config)
    logger.info("%.2fM parameters; %d training tokens, %d validation tokens", model.num_parameters() / 1e6,
                len(train_stream), len(validation_stream))
    train(model, train_stream, tokenizer, args)
    losses = evaluate(model, validation_stream, tokenizer, args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    plot(losses, args, args.output_dir / "length_extrapolation.png")
    print(format_table(losses, args))
    return losses


if __name__ == "__main__":
    main()
