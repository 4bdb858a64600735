"""Sentence embeddings on CPU, where embedding users live: short sentences, in sorted batches or one at a time.

    python benchmarks/bench_embeddings.py            # base width, 4 layers (several minutes on 2 cores)
    python benchmarks/bench_embeddings.py --quick    # tiny smoke configuration (seconds)
    python benchmarks/bench_embeddings.py --dtype bf16   # every model cast to bf16 (AVX-512 bf16 or AMX CPUs)

What it does:
1. Builds transformers' `RoFormerModel` (dropout 0, eager attention, its only kernel), saves it, and loads the folder
   in roformer_hf: the same weights. ModernBERT (transformers' `ModernBertModel`, SDPA) at the same width and depth,
   GeGLU intermediate 2/3 of RoFormer's so that both do the same multiply-adds per token, random weights of its own.
2. Three sets of sentences (random ids): "short" (8-32 tokens), "~128" (120-136 tokens) and "mixed" (8-256
   tokens), each embedded as sentence-transformers does: sorted by length, batches of 32, mean pooling of the last
   hidden state over the real tokens; and one sentence at a time (batch 1, the first `--single` sentences).
3. Checks roformer_hf's embeddings against transformers' (cosine at least 0.99999), then times every model on every
   set, interleaved (rotating which goes first) under `torch.inference_mode`, and reports sentences per second,
   roformer_hf over transformers, and the share of the CPU's GEMM rate that roformer_hf reaches on the short set.
4. roformer_hf int8 (`roformer_hf.quantization.quantize_int8` on the loaded model): speed over transformers' fp32 and
   the cosine of its embeddings with fp32's (lowest over the sentences). With `--dtype bf16` every model is cast
   with `.to(torch.bfloat16)` instead (int8 left out), each bf16 model's embeddings are checked against transformers'
   fp32 ones (cosine at least 0.999), and the goal is 1.5x transformers' bf16, on CPUs with AMX: elsewhere bf16
   computes at fp32's rate or slower (`common.machine_lines` names the CPU's bf16 units).
5. The bound of the short set in batches of 32: the encoder's dense calls alone on each batch's real tokens
   (`bench_dense.DenseChain`, through the kernels roformer_hf's layers take for those rows), timed as many times as
   the models; transformers' time over theirs is the most roformer_hf's speed-up over transformers can be with these
   GEMM kernels, however little the rest of its forward costs.
6. Where a short batch's time goes: roformer_hf's operators on one batch of 32 short sentences (torch.profiler).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_lines, progress, spread, time_interleaved, verdict  # noqa: E402
from workload import parse_args, size_of, timing_parser, transformers_config  # noqa: E402

SETS = {"short": (8, 32), "~128": (120, 136), "mixed": (8, 256)}
COSINE_TARGET, INT8_TARGET, INT8_COSINE_TARGET = 0.99999, 1.5, 0.999
BF16_COSINE_TARGET = 0.999  # a bf16 model's embeddings against transformers' fp32 ones
# roformer_hf over transformers on short sentences in batches of 32, at each dtype (bf16: on CPUs with AMX)
SHORT_TARGETS = {"fp32": 1.25, "bf16": 1.5}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sentences(low: int, high: int, count: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """`count` random id sequences of `low`..`high` tokens ([CLS]=2 ... [SEP]=3, ids from 5)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.cat([torch.tensor([2]), torch.randint(5, vocab, (n - 2,), generator=generator), torch.tensor([3])])
            for n in lengths]


def batches(seqs: list[torch.Tensor], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """sentence-transformers' batching: longest first, `batch_size` at a time, right-padded with 0."""
    ordered = sorted(seqs, key=len, reverse=True)
    out = []
    for start in range(0, len(ordered), batch_size):
        group = ordered[start:start + batch_size]
        ids = torch.nn.utils.rnn.pad_sequence(group, batch_first=True)
        mask = (torch.arange(ids.shape[1])[None] < torch.tensor([len(s) for s in group])[:, None]).long()
        out.append((ids, mask))
    return out


def embed(model, batch_list) -> torch.Tensor:
    """Mean pooling over the real tokens, as sentence-transformers' Pooling module computes it."""
    vectors = []
    with torch.inference_mode():
        for ids, mask in batch_list:
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            vectors.append((hidden * weights).sum(1) / weights.sum(1))
    return torch.cat(vectors).float()


def gemm_rate(tokens: int, hidden: int, intermediate: int, repeats: int = 5,
              dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s in `dtype` of the feed-forward's first GEMM at `tokens` rows, the best of `repeats`, through the call
    roformer_hf's layers make (`fused.fused_linear` in inference): the kernel this CPU's dense rule takes at that many
    rows (oneDNN's, on the packed weight or not, or MKL's), the layer's own call where no oneDNN kernel applies."""
    from roformer_hf import fused

    a, layer = torch.randn(tokens, hidden, dtype=dtype), torch.nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
    with torch.inference_mode():
        fused.fused_linear(layer, a)  # packs the weight, where the rule packs
        best = min(_timed_call(lambda: fused.fused_linear(layer, a)) for _ in range(repeats))
    return 2 * tokens * hidden * intermediate / best / 1e9


def _timed_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dense_calls_alone(size, batch_list, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    """Seconds the encoder's dense calls take alone on the real tokens of every batch in `batch_list`, the median of
    `repeats`: `bench_dense.DenseChain` of the model's size in `dtype`, each batch's rows in a row, through the kernels
    `fused.fused_linear` takes for them."""
    from bench_dense import DenseChain

    chain = DenseChain(size, size.layers).to(dtype).eval()
    inputs = [torch.randn(int(mask.sum()), size.hidden, dtype=dtype) for _, mask in batch_list]
    with torch.inference_mode():
        for x in inputs:  # packs the weights for every kernel the rows take
            chain(x)
        return median(_timed_call(lambda: [chain(x) for x in inputs]) for _ in range(repeats))


def flops_per_token(size, length: float) -> float:
    """Forward multiply-adds x2 of one RoFormer token: projections, feed-forward, attention over `length` keys."""
    h, i = size.hidden, size.intermediate
    return 2 * size.layers * (4 * h * h + 2 * h * i + 2 * h * length)


def build_models(size, max_positions: int, folder: str, dtype: str = "fp32") -> dict[str, torch.nn.Module]:
    """The models timed, in `dtype` (``"fp32"``: with roformer_hf's int8; ``"bf16"``: each cast, no int8), and under
    "reference" transformers' RoFormer in fp32, which every model's embeddings are checked against."""
    import transformers

    import roformer_hf
    import roformer_hf.quantization

    torch.manual_seed(0)
    reference = transformers.RoFormerModel(transformers_config(size, max_positions)).eval()
    reference.save_pretrained(folder)
    ours = roformer_hf.RoFormerModel.from_pretrained(folder).eval()
    modernbert = transformers.ModernBertModel(transformers.ModernBertConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.intermediate * 2 // 3,
        max_position_embeddings=max_positions, attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
        attn_implementation="sdpa")).eval()
    if dtype == "bf16":
        return {"transformers RoFormer": copy.deepcopy(reference).to(torch.bfloat16),
                "roformer_hf": ours.to(torch.bfloat16), "ModernBERT (sdpa)": modernbert.to(torch.bfloat16),
                "reference": reference}
    int8 = roformer_hf.quantization.quantize_int8(copy.deepcopy(ours))
    return {"transformers RoFormer": reference, "roformer_hf": ours, "roformer_hf int8": int8,
            "ModernBERT (sdpa)": modernbert, "reference": reference}


def where_time_goes(model, batch, rows: int = 10) -> str:
    ids, mask = batch
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model(input_ids=ids, attention_mask=mask)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def build_parser() -> argparse.ArgumentParser:
    parser = timing_parser(__doc__.split("\n\n")[0], repeats=5, warmup=1)
    parser.add_argument("--count", type=int, default=256, help="sentences per set (batch 32)")
    parser.add_argument("--single", type=int, default=32, help="sentences timed one at a time per set")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="every model's dtype (bf16: each cast; roformer_hf int8 only with fp32)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv, count=32, single=4, repeats=2)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = size_of(args)
    progress(f"model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}")
    with tempfile.TemporaryDirectory() as folder:
        models = build_models(size, 512, folder, args.dtype)
    fp32_reference = models.pop("reference")
    floating = {name: {p.dtype for p in model.parameters() if p.is_floating_point()} for name, model in models.items()
                if "int8" not in name}
    if any(dtypes != {DTYPES[args.dtype]} for dtypes in floating.values()):
        raise RuntimeError(f"expected every model's weights in {args.dtype}, found {floating}")
    rows, checks = [], []
    short_batches = None
    for set_name, (low, high) in SETS.items():
        seqs = sentences(low, high, args.count, size.vocab, args.seed)
        work = {32: batches(seqs, 32), 1: batches(seqs[:args.single], 1)}
        if set_name == "short":
            short_batches = work[32]
        reference = embed(fp32_reference, work[32])
        cosines = {name: F.cosine_similarity(embed(models[name], work[32]), reference, dim=-1).min().item()
                   for name in models if name.startswith("roformer_hf")
                   or (name == "transformers RoFormer" and args.dtype != "fp32")}
        checks.append((set_name, cosines))
        floor = COSINE_TARGET if args.dtype == "fp32" else BF16_COSINE_TARGET
        if cosines["roformer_hf"] < floor:
            raise RuntimeError(f"{set_name}: roformer_hf's {args.dtype} embeddings differ from transformers' fp32 ones "
                               f"(cosine {cosines['roformer_hf']}, expected at least {floor})")
        for batch_size, batch_list in work.items():
            progress(f"timing {set_name}, batch {batch_size}")
            runners = {name: (lambda m=model, b=batch_list: _timed(m, b)) for name, model in models.items()}
            times = time_interleaved(runners, args.warmup, args.repeats)
            count = sum(len(ids) for ids, _ in batch_list)
            tokens = sum(int(mask.sum()) for _, mask in batch_list)
            rows.append((set_name, batch_size, count, tokens, times))
    dtype = DTYPES[args.dtype]
    rate = gemm_rate(sum(int(m.sum()) for _, m in short_batches[:1]), size.hidden, size.intermediate, dtype=dtype)
    progress("timing the dense calls alone on the short batches")
    dense = dense_calls_alone(size, short_batches, args.repeats, dtype)
    report(args, size, rows, checks, rate, dense)
    print(f"\nWhere one batch of 32 short sentences spends roformer_hf's time ({args.dtype}, 3 forwards):\n")
    print(where_time_goes(models["roformer_hf"], short_batches[0]))


def _timed(model, batch_list) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batch_list:
            model(input_ids=ids, attention_mask=mask)
    return time.perf_counter() - start


def report(args, size, rows, checks, rate, dense: float) -> None:
    from roformer_hf import fused

    names = list(rows[0][4])
    int8 = "roformer_hf int8" in names
    target = SHORT_TARGETS[args.dtype]
    print(f"\n## Sentence embeddings on CPU, {args.dtype} (sentences per second, median of the interleaved repeats)\n")
    print(*machine_lines(), sep="\n")
    print(f"- model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}, "
          f"vocab {size.vocab}; {args.dtype} GEMM rate ({size.hidden}x{size.intermediate}, one short batch's rows, the "
          f"dense rule's kernel, {fused.RULE.cpu}): "
          f"{rate:.0f} GFLOP/s; repeats {args.repeats}\n")
    print("| set | batch | sentences | " + " | ".join(names) + " | roformer_hf / transformers |"
          + (" int8 / transformers |" if int8 else "") + " roformer_hf % of GEMM rate |")
    print("|---|---|---|" + "---|" * (len(names) + 2 + int8))
    for set_name, batch_size, count, tokens, times in rows:
        per_second = {name: count / median(samples) for name, samples in times.items()}
        ratio = per_second["roformer_hf"] / per_second["transformers RoFormer"]
        achieved = flops_per_token(size, tokens / count) * tokens / median(times["roformer_hf"]) / 1e9
        cells = " | ".join(f"{per_second[name]:.1f}" for name in names)
        if int8:
            ratio8 = per_second["roformer_hf int8"] / per_second["transformers RoFormer"]
            cells += f" | {ratio:.2f}x ({verdict(ratio >= 1.0)}) | {ratio8:.2f}x ({verdict(ratio8 >= INT8_TARGET)})"
        else:
            cells += f" | {ratio:.2f}x ({verdict(ratio >= 1.0)})"
        print(f"| {set_name} | {batch_size} | {count} | {cells} | {100 * achieved / rate:.0f}% |")
    short = next(times for set_name, batch_size, _, _, times in rows if set_name == "short" and batch_size == 32)
    reference = median(short["transformers RoFormer"])
    where = " on CPUs with AMX" if args.dtype == "bf16" else ""
    bound, measured = reference / dense, reference / median(short["roformer_hf"])
    print(f"\nshort, batch 32: the dense calls alone on the real tokens take {dense:.3f} s with roformer_hf's kernels "
          f"({fused.RULE.cpu}), transformers' forward {reference:.3f} s: with these kernels "
          f"roformer_hf / transformers is at most {bound:.2f}x (the goal, {target}x{where}, within it: "
          f"{verdict(bound >= target)}; measured {measured:.2f}x: {verdict(measured >= target)})")
    print("\nseconds per set, median (min-max):")
    for set_name, batch_size, _, _, times in rows:
        print(f"- {set_name}, batch {batch_size}: " + "; ".join(f"{n} {spread(s)}" for n, s in times.items()))
    print("\nembeddings, lowest cosine over the sentences (batch 32):")
    for set_name, cosines in checks:
        if int8:
            cos, cos8 = cosines["roformer_hf"], cosines["roformer_hf int8"]
            print(f"- {set_name}: roformer_hf fp32 vs transformers {cos:.6f}; int8 vs transformers fp32 {cos8:.5f} "
                  f"({verdict(cos8 >= INT8_COSINE_TARGET)} at {INT8_COSINE_TARGET})")
        else:
            print(f"- {set_name}: against transformers' fp32 embeddings, roformer_hf {args.dtype} "
                  f"{cosines['roformer_hf']:.5f}, transformers' RoFormer {args.dtype} "
                  f"{cosines['transformers RoFormer']:.5f} (at least {BF16_COSINE_TARGET})")


if __name__ == "__main__":
    main()
