"""Where the served compiled encoder pays on this CPU: one input of each length, the eager model against the package
`roformer-hf serve --compile` builds, and the longest input the CPU kind's rule sends to the package.

    python benchmarks/bench_compiled.py           # 4 layers of base width, lengths 8 to 512 (about 2 minutes on 2 cores)
    python benchmarks/bench_compiled.py --quick   # tiny model (about a minute: the compile)

It builds a randomly initialised `RoFormerModel` of the size flags (dropout 0), compiles the encoder for one input as
a server started with `--compile` does (`serving.compiled.compiled_package` on `serving.compiled.OneInput`: exported
with the length dynamic, AOTInductor with frozen weights; here unsaved, so nothing is left behind), checks its last
hidden states against the eager model's at every length (at most `FP32_DIFF` apart), then times one forward of each
at every length of `--one-lengths`, interleaved (`common.time_interleaved`), as the server runs them: the eager model
on the ids and a mask of ones, the package on the ids alone. It reports each median, compiled over eager, and the
longest length of a run from the shortest where the package was faster, beside the longest input this CPU kind's
rule sends to it (`fused.RULE.compiled_max_tokens`); longer inputs run eagerly.
"""

from __future__ import annotations

import math
from statistics import median

import torch
from common import machine_lines, progress, time_interleaved, time_once
from workload import parse_args, size_of, timing_parser

from roformer_hf import RoFormerConfig, RoFormerModel, fused
from roformer_hf.serving.compiled import CompiledEncoder, OneInput, compiled_package

FP32_DIFF = 1e-4  # the package's last hidden states against the eager model's, at most (fp32)
LENGTHS = (8, 16, 24, 32, 48, 64, 96, 128, 256, 512)


def compiled_encoder(model: RoFormerModel, max_length: int) -> CompiledEncoder:
    """`model` compiled for one input of 2 to `max_length` tokens, as `roformer-hf serve --compile` compiles it,
    unsaved."""
    example = (torch.randint(5, model.config.vocab_size, (1, 16)),)
    return compiled_package(lambda: OneInput(model).eval(), example, max_length, {"key": "bench"},
                            check=lambda package: None, cache=None)


def crossover(ratios: dict[int, float]) -> int | None:
    """The longest length of the run of lengths, from the shortest, at which compiled took less time than eager;
    None where it did not at the shortest."""
    longest = None
    for length in sorted(ratios):
        if ratios[length] >= 1.0:
            break
        longest = length
    return longest


def main(argv: list[str] | None = None) -> None:
    parser = timing_parser(__doc__.split("\n\n")[0], repeats=20, warmup=2, timed="forwards per path and length")
    parser.add_argument("--one-lengths", type=int, nargs="+", default=list(LENGTHS),
                        help="tokens of the one input timed")
    args = parse_args(parser, argv, one_lengths=[8, 16, 64])
    if args.threads:
        torch.set_num_threads(args.threads)
    size = size_of(args)
    longest = max(args.one_lengths)
    torch.manual_seed(args.seed)
    config = RoFormerConfig(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                            num_attention_heads=size.heads, intermediate_size=size.intermediate,
                            max_position_embeddings=max(512, longest), hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    model = RoFormerModel(config).eval()
    progress("compiling the encoder for one input")
    package = compiled_encoder(model, config.max_position_embeddings)

    rows = {}
    with torch.no_grad():
        for length in args.one_lengths:
            ids = torch.randint(5, size.vocab, (1, length), generator=torch.Generator().manual_seed(length))
            mask = torch.ones_like(ids)
            eager = model(input_ids=ids, attention_mask=mask).last_hidden_state
            difference = (package(input_ids=ids).last_hidden_state - eager).abs().max().item()
            if difference > FP32_DIFF:
                raise RuntimeError(f"the compiled encoder's last hidden states differ from the eager model's by "
                                   f"{difference:.3g} at {length} tokens; expected at most {FP32_DIFF}")
            runners = {"eager": lambda ids=ids, mask=mask: time_once(lambda: model(input_ids=ids, attention_mask=mask)),
                       "compiled": lambda ids=ids: time_once(lambda: package(input_ids=ids))}
            times = time_interleaved(runners, args.warmup, args.repeats)
            rows[length] = (median(times["eager"]), median(times["compiled"]), difference)
            progress(f"{length} tokens timed")

    rule = fused.RULE
    ratios = {length: compiled / eager for length, (eager, compiled, _) in rows.items()}
    found = crossover(ratios)
    print(f"# The served compiled encoder against the eager model, one input, fp32 ({rule.cpu} rule)\n")
    print("\n".join(machine_lines()))
    print(f"- model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate "
          f"{size.intermediate}, vocabulary {size.vocab}; dropout 0; medians of {args.repeats} interleaved calls after "
          f"{args.warmup}\n")
    print("| tokens | eager ms | compiled ms | compiled / eager | largest difference | the rule sends it to |")
    print("| --- | --- | --- | --- | --- | --- |")
    for length, (eager, compiled, difference) in rows.items():
        sent = "compiled" if length <= rule.compiled_max_tokens else "eager"
        print(f"| {length} | {eager * 1e3:.2f} | {compiled * 1e3:.2f} | {ratios[length]:.2f}x | {difference:.1e} | "
              f"{sent} |")
    limit = "every length" if math.isinf(rule.compiled_max_tokens) else f"up to {rule.compiled_max_tokens} tokens"
    print(f"\ncompiled faster from the shortest up to: {found if found is not None else 'none'} tokens; "
          f"the {rule.cpu} rule sends one input to the compiled encoder {limit}")


if __name__ == "__main__":
    main()
