#!/usr/bin/env python
"""Numerical parity with transformers' RoFormer on the same weights, printed as a table.

For each head and variant, a transformers RoFormer model with random weights is saved and loaded by roformer_hf;
both run the same padded batch and the largest absolute difference on real tokens is printed. The "longer input"
rows feed sequences past the checkpoint's max_position_embeddings and compare with transformers' model given a
longer sinusoidal table (it cannot run them otherwise).

    python benchmarks/parity.py
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import roformer_hf

HEADS = ("RoFormerModel", "RoFormerForMaskedLM", "RoFormerForSequenceClassification",
         "RoFormerForTokenClassification", "RoFormerForQuestionAnswering")
VARIANTS = {"default": {}, "embedding_size != hidden_size": {"embedding_size": 64},
            "rotary_value=True": {"rotary_value": True}}


def max_difference(head: str, size: dict, variant: dict, lengths: list[int], max_positions: int) -> float:
    torch.manual_seed(0)
    config = transformers.RoFormerConfig(**size, **variant, max_position_embeddings=max_positions,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    reference = getattr(transformers, head)(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        ours = getattr(roformer_hf, head).from_pretrained(folder).eval()
    if max(lengths) > max_positions:  # the same weights with a table long enough for transformers to run
        longer = getattr(transformers, head)(transformers.RoFormerConfig.from_dict(
            {**config.to_dict(), "max_position_embeddings": max(lengths)})).eval()
        state = {k: v for k, v in reference.state_dict().items() if "embed_positions" not in k}
        longer.load_state_dict(state, strict=False)
        reference = longer
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, size["vocab_size"], (len(lengths), max(lengths)), generator=generator)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        expected, actual = reference(ids, attention_mask=mask), ours(ids, attention_mask=mask)
    if head == "RoFormerForSequenceClassification":
        return (expected.logits - actual.logits).abs().max().item()
    field = "start_logits" if head == "RoFormerForQuestionAnswering" else 0
    return (expected[field] - actual[field]).abs()[mask.bool()].max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=5000)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    size = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, intermediate_size=4 * args.hidden)
    print(f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; padded batch; fp32\n")
    print("| head | variant | input | max abs difference on real tokens |\n|---|---|---|---|")
    for head in HEADS:
        for name, variant in VARIANTS.items():
            for label, lengths, max_positions in (("lengths 64/40/9, table 64", [64, 40, 9], 64),
                                                  ("longer input: 300/150 tokens, table 128", [300, 150], 128)):
                diff = max_difference(head, size, variant, lengths, max_positions)
                print(f"| {head} | {name} | {label} | {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
