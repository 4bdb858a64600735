"""A/B of two versions of roformer_hf on the CPU benchmark's workload, interleaved in one process.

    python benchmarks/ab_versions.py --old 9b1fbda            # this checkout against an earlier commit
    python benchmarks/ab_versions.py --old 9b1fbda --quick    # tiny smoke configuration
    python benchmarks/ab_versions.py --old 9b1fbda --dtype bf16 --skip-train   # bf16 weights, forward only
    python benchmarks/ab_versions.py --old 9b1fbda --sentence 16 --skip-train --new-tokens 0 --repeats 20
                                                              # and one 16-token sentence, ten forwards in a row

For a change that must not cost speed (a refactor): both versions load the same transformers checkpoint and run
the same padded batch (the inference forward and the MLM training step of `bench_cpu.py`), alternating which goes
first, so machine load hits both alike. `--sentence N` adds a server's short input: ten forwards in a row of the encoder
(`model.roformer`, as `bench_latency.py` times `RoFormerModel`) on one sentence of N tokens with a mask of ones. The
earlier version is extracted with `git archive` and imported under another package name (its imports inside the
package are relative).

Before timing, `identical_paths.compare` runs both versions on small models along every path (heads, layouts, rope
types, kernels, training with dropout, the decoder and generation) and prints which outputs or gradients differ in
any bit (`--skip-paths` to leave it out).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from statistics import median

import torch
from common import machine_lines
from identical_paths import compare
from workload import (
    DTYPES,
    REPO_ROOT,
    add_size_arguments,
    infer,
    padded_batch,
    parse_args,
    size_of,
    train_step,
    transformers_config,
)


def import_old_version(revision: str, folder: Path):
    """roformer_hf as it was at `revision`, imported as the package `roformer_hf_old`."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision, "roformer_hf"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "roformer_hf").rename(folder / "roformer_hf_old")
    sys.path.insert(0, str(folder))
    return importlib.import_module("roformer_hf_old")


def prompt_batch(batch, fraction: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The first quarter (1 / `fraction`) of each row's real tokens as prompts, left-padded as generation pads."""
    lengths = (batch[1].sum(dim=1) // fraction).clamp(min=1).tolist()
    width = max(lengths)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:], mask[row, width - length:] = batch[0][row, :length], 1
    return ids, mask


def generate(model, prompts: tuple[torch.Tensor, torch.Tensor], new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(prompts[0], attention_mask=prompts[1], max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def ten_in_a_row(encoder, sentence: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        for _ in range(10):
            states = encoder(input_ids=sentence[0], attention_mask=sentence[1]).last_hidden_state
    return states


def print_identical_paths(old_package, new_package) -> None:
    results = compare(old_package, new_package)
    print(f"\n| path (old = {old_package.__name__}, new = this checkout) | outputs and gradients |")
    print("| --- | --- |")
    for name, differing in results:
        print(f"| {name} | {'identical' if not differing else 'DIFFER: ' + ', '.join(differing[:4])} |")
    same = sum(not differing for _, differing in results)
    print(f"\n{same} of {len(results)} paths bit-identical")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.add_argument("--old", required=True, help="the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="the weights of both versions")
    parser.add_argument("--skip-train", action="store_true", help="time the inference forward only")
    parser.add_argument("--skip-paths", action="store_true", help="leave out the bit-for-bit check of every path")
    parser.add_argument("--new-tokens", type=int, default=16,
                        help="greedy generation: tokens generated per row by the causal LM (0: leave it out)")
    parser.add_argument("--sentence", type=int, default=0,
                        help="also time ten encoder forwards in a row on one sentence of this many tokens (0: no)")
    args = parse_args(parser, argv, repeats=3)
    torch.manual_seed(args.seed)
    size = size_of(args)
    import transformers

    import roformer_hf

    with tempfile.TemporaryDirectory() as folder:
        old_package = import_old_version(args.old, Path(folder) / "code")
        if not args.skip_paths:
            print_identical_paths(old_package, roformer_hf)
        transformers.RoFormerForMaskedLM(transformers_config(size, max(args.lengths))).save_pretrained(folder)
        models = {name: package.RoFormerForMaskedLM.from_pretrained(folder, sparse_prediction=True,
                                                                    dtype=DTYPES[args.dtype])
                  for name, package in (("old", old_package), ("new", roformer_hf))}
        decoder_folder = Path(folder) / "decoder"
        decoder_config = transformers_config(size, max(args.lengths) + args.new_tokens)
        decoder_config.is_decoder = True
        transformers.RoFormerForCausalLM(decoder_config).save_pretrained(decoder_folder)
        decoders = {name: package.RoFormerForCausalLM.from_pretrained(decoder_folder, dtype=DTYPES[args.dtype]).eval()
                    for name, package in (("old", old_package), ("new", roformer_hf))}
    batch = padded_batch(args.lengths, size.vocab, args.seed)
    prompts = prompt_batch(batch)
    old_logits, new_logits = (infer(model.eval(), batch) for model in models.values())
    mask = batch[1].bool()
    difference = (old_logits[mask].float() - new_logits[mask].float()).abs().max().item()
    modes = {"infer": infer} if args.skip_train else {"infer": infer, "train": train_step}
    if args.new_tokens:
        modes["generate"] = lambda model, batch: generate(model, prompts, args.new_tokens)
        old_tokens, new_tokens = (generate(decoder, prompts, args.new_tokens) for decoder in decoders.values())
        print(f"greedy generation: the same {new_tokens.shape[1] - prompts[0].shape[1]} tokens per row from both "
              f"versions: {torch.equal(old_tokens, new_tokens)}")
    if args.sentence:
        sentence = (batch[0][:1, :args.sentence], torch.ones(1, args.sentence, dtype=torch.long))
        modes[f"{args.sentence} tokens x10"] = lambda model, batch: ten_in_a_row(model.roformer, sentence)
        old_states, new_states = (ten_in_a_row(model.eval().roformer, sentence) for model in models.values())
        print(f"one sentence of {args.sentence} tokens: the same last hidden states from both versions: "
              f"{torch.equal(old_states, new_states)}")
    times = {(name, mode): [] for name in models for mode in modes}
    for repeat in range(args.repeats + 1):
        for name in (list(models) if repeat % 2 else list(reversed(models))):
            for mode, step in modes.items():  # infer runs in inference_mode
                model = decoders[name] if mode == "generate" else models[name].train(mode == "train")
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                step(model, batch)
                if repeat:  # the first round warms up
                    times[(name, mode)].append(time.perf_counter() - start)
    print(f"\nold = {args.old}, new = this checkout; {size.layers} layers, hidden {size.hidden}, lengths "
          f"{args.lengths}; {args.dtype}, dropout 0, {torch.get_num_threads()} threads; median (min-max) of {args.repeats}; "
          f"max logit difference at real tokens {difference:.1e}\n")
    print("| | old | new | new / old |")
    print("| --- | --- | --- | --- |")
    for mode in modes:
        old, new = times[("old", mode)], times[("new", mode)]
        print(f"| {mode} | {median(old):.4f} s ({min(old):.4f}-{max(old):.4f}) | {median(new):.4f} s "
              f"({min(new):.4f}-{max(new):.4f}) | {median(new) / median(old):.3f} |")
    print("\n" + "\n".join(machine_lines()))


if __name__ == "__main__":
    main()
