"""A server's inputs in turn on one model: one 16-token sentence after 32 short sentences, and back.

    python benchmarks/bench_mixed.py            # 4 layers of base width (about a minute on 2 cores)
    python benchmarks/bench_mixed.py --quick    # tiny model (seconds)

A server's batches change size from one forward to the next, and with them the dense layers' kernels (`fused.RULE`:
`few_rows`' up to its rows, oneDNN's on its packed weight beyond, on CPUs whose rule takes both). It builds a
randomly initialised `RoFormerModel` of the size flags (dropout 0), checks that both inputs give the same last hidden
states in turn as in a run of their own kind, then times each forward both ways, `--repeats` times: in a run of its
own kind (the first of each run untimed), and in turn with the other input. A forward in turn should take the time of
its own kind's: a layer keeps a packed copy of its weight for each kernel its inputs call for, and packs none again.
"""

from __future__ import annotations

from statistics import median

import torch
from bench_embeddings import SETS, batches, sentences
from common import machine_lines, native_precisions, progress, time_once
from workload import parse_args, size_of, timing_parser

from roformer_hf import RoFormerConfig, RoFormerModel, fused

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__.split("\n\n")[0], repeats=10, warmup=1, timed="forwards of each input each way")
    parser.add_argument("--length", type=int, default=16, help="tokens of the one sentence")
    args = parse_args(parser, argv, repeats=3)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = size_of(args)
    config = RoFormerConfig(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                            num_attention_heads=size.heads, intermediate_size=size.intermediate,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs = {f"1 sentence of {args.length} tokens": batches(sentences(args.length, args.length, 1, size.vocab,
                                                                       args.seed), 1)[0],
              "32 short sentences (8-32 tokens)": batches(sentences(*SETS["short"], 32, size.vocab, args.seed), 32)[0]}
    print(f"{size.layers} layers, hidden {size.hidden}, vocabulary {size.vocab}; dropout 0 (eval); "
          f"{torch.get_num_threads()} threads; median of {args.repeats}; dense kernels by `fused.RULE`: "
          f"{fused.RULE.cpu}\n")
    print("| precision | input | in a run of its kind | in turn with the other | in turn / alone | same output |")
    print("| --- | --- | --- | --- | --- | --- |")
    for precision in [name for name in native_precisions() if name in PRECISIONS]:
        progress(f"{precision}: one model, both inputs")
        torch.manual_seed(0)
        model = RoFormerModel(config).eval().to(PRECISIONS[precision])
        alone, in_turn, same = {name: [] for name in inputs}, {name: [] for name in inputs}, {}

        def forward(ids_mask):
            return model(input_ids=ids_mask[0], attention_mask=ids_mask[1]).last_hidden_state

        with torch.inference_mode():
            expected = {name: forward(batch) for name, batch in inputs.items()}
            for name, batch in inputs.items():
                for _ in range(args.warmup):
                    forward(batch)
                alone[name] = [time_once(lambda: forward(batch)) for _ in range(args.repeats)]
            for _ in range(args.warmup):
                for batch in inputs.values():
                    forward(batch)
            for _ in range(args.repeats):
                for name, batch in inputs.items():
                    in_turn[name].append(time_once(lambda: forward(batch)))
            same = {name: torch.equal(forward(batch), expected[name]) for name, batch in inputs.items()}
        for name in inputs:
            ratio = median(in_turn[name]) / median(alone[name])
            print(f"| {precision} | {name} | {1e3 * median(alone[name]):.2f} ms | {1e3 * median(in_turn[name]):.2f} ms "
                  f"| {ratio:.2f}x | {'yes' if same[name] else 'no'} |")
    print("\n" + "\n".join(machine_lines()))


if __name__ == "__main__":
    main()
