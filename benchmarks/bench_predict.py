"""A served classifier's one input, eager against compiled, on CPU: the latency of `/predict` of one sentence and of
`/rerank` of one pair, through the server's own code in this process (`ServedModel.answer`: parsing, tokenizing, the
model, the answer; no HTTP), and what a start costs.

    python benchmarks/bench_predict.py            # base width, 4 layers, fp32 and int8 (a few minutes on 2 cores)
    python benchmarks/bench_predict.py --quick    # tiny model (about a minute)

It saves a cross-encoder's folder (a sequence classifier of one label, random weights) with a WordPiece tokenizer
trained on Shakespeare's lines (as bench_serving.py does), then for each precision loads it eagerly and with `compile`
into an empty compile cache (the classifier compiled; int8: quantized statically on a calibration file of 200 lines
that the measured ones are not among), loads it again from that cache, compares the compiled scores with the eager
model's (fp32: it stops with an error beyond FP32_SCORE_DIFF), and times the requests interleaved: each repeat runs
every request once on each model in turn.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
from bench_serving import sentence_sets, text_lines  # noqa: E402
from common import machine_lines, progress  # noqa: E402
from workload import add_size_arguments, parse_args, size_of  # noqa: E402

FP32_SCORE_DIFF = 1e-4  # the compiled classifier's fp32 scores against the eager model's, at most


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)  # --threads: torch threads (default: torch's own choice)
    parser.add_argument("--sentences", type=int, default=64, help="single-sentence and single-pair requests timed")
    parser.add_argument("--repeats", type=int, default=5, help="passes over the requests, each model in turn")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "int8"), default=["fp32", "int8"])
    return parser


def save_reranker_folder(folder: Path, size, lines: list[str]):
    """A cross-encoder of `size` (one label), with a tokenizer trained on `lines`."""
    from roformer_hf import RoFormerConfig, RoFormerForSequenceClassification, train_tokenizer

    tokenizer = train_tokenizer(lines, vocab_size=size.vocab, min_frequency=1, model_max_length=256)
    torch.manual_seed(0)
    config = RoFormerConfig(vocab_size=len(tokenizer), hidden_size=size.hidden, num_hidden_layers=size.layers,
                            num_attention_heads=size.heads, intermediate_size=size.intermediate,
                            max_position_embeddings=512, num_labels=1, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    RoFormerForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def requests(short: list[str]) -> dict[str, list[tuple[str, dict]]]:
    return {"/predict of one sentence": [("/predict", {"inputs": s, "raw_scores": True}) for s in short],
            "/rerank of one pair": [("/rerank", {"query": a, "texts": [b], "raw_scores": True})
                                    for a, b in zip(short, short[1:] + short[:1])]}


def score(answer) -> float:
    return answer[0]["score"]


def main(argv: list[str] | None = None) -> None:
    from roformer_hf.serving import ServedModel

    args = parse_args(build_parser(), argv, sentences=16, repeats=2)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = size_of(args)
    root = Path(tempfile.mkdtemp(prefix="bench_predict_"))
    try:
        lines = text_lines(4000, args.seed)
        folder = root / "reranker"
        tokenizer = save_reranker_folder(folder, size, lines)
        short, _ = sentence_sets(lines, tokenizer, args.sentences)
        calibration = root / "calibration.txt"
        measured = set(short)
        calibration.write_text("\n".join([line for line in lines[::-1] if line not in measured][:200]) + "\n")
        work = requests(short)
        print("\n".join(machine_lines()))
        print(f"- model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate "
              f"{size.intermediate}, vocab {len(tokenizer)}; one label; dropout 0; {torch.get_num_threads()} threads")
        print(f"- {args.sentences} requests of each kind, {args.repeats} passes, interleaved; ms per request: median "
              "(p90) over every request of every pass\n")
        print("| precision | request | eager | compiled | compiled / eager | largest score difference |")
        print("| --- | --- | --- | --- | --- | --- |")
        notes = []
        for precision in args.precisions:
            int8 = precision == "int8"
            extra = {"int8": True, "calibration": calibration} if int8 else {}
            progress(f"{precision}: loading eagerly")
            eager = ServedModel(folder, int8=int8)
            cache = root / f"cache-{precision}"
            progress(f"{precision}: compiling into an empty cache")
            start = time.perf_counter()
            ServedModel(folder, compile=True, compile_cache=cache, **extra)
            first = time.perf_counter() - start
            start = time.perf_counter()
            compiled = ServedModel(folder, compile=True, compile_cache=cache, **extra)
            again = time.perf_counter() - start
            assert compiled.loaded.compiled.loaded, "the second start did not load the package"
            notes.append(f"{precision}: start with compile {first:.1f} s into an empty cache, {again:.2f} s from it")
            for label, calls in work.items():
                times = {"eager": [], "compiled": []}
                worst = 0.0
                for path, body in calls:  # agreement, and a warm-up
                    diff = abs(score(eager.answer(path, body)) - score(compiled.answer(path, body)))
                    worst = max(worst, diff)
                if not int8 and worst > FP32_SCORE_DIFF:
                    raise SystemExit(f"{label}: the compiled classifier's fp32 scores differ from the eager model's "
                                     f"by up to {worst:.3g}; expected at most {FP32_SCORE_DIFF}")
                progress(f"{precision}: timing {label}")
                for _ in range(args.repeats):
                    for path, body in calls:
                        for name, served in (("eager", eager), ("compiled", compiled)):
                            start = time.perf_counter()
                            served.answer(path, body)
                            times[name].append(time.perf_counter() - start)
                cells = {name: (1e3 * median(t), 1e3 * sorted(t)[int(0.9 * len(t))]) for name, t in times.items()}
                ratio = cells["compiled"][0] / cells["eager"][0]
                print(f"| {precision} | {label} | {cells['eager'][0]:.2f} ({cells['eager'][1]:.2f}) | "
                      f"{cells['compiled'][0]:.2f} ({cells['compiled'][1]:.2f}) | {ratio:.2f}x | "
                      f"{worst:.2g} |")
        print()
        for note in notes:
            print(f"- {note}")
        print("- int8 eager is `quantize_int8` (activations quantized per call); int8 compiled is quantized "
              "statically on the calibration file: their scores differ by int8's rounding, not only the compiler's")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
