"""The GEMM kernels a dense layer can take in CPU inference, per input shape, on this machine: the measurements behind
`roformer_hf.fused._dense_kernel`, the rule that picks one per call.

    python benchmarks/bench_dense.py            # the encoder's layers at base width (about 7 minutes on 2 cores)
    python benchmarks/bench_dense.py --quick    # hidden 64 (seconds)

For each dtype oneDNN computes here (fp32; bf16 on CPUs with AVX-512 bf16 or AMX), each row count of `--rows` (one
row: a decoding step; 16: a short sentence; 64; 626: the real tokens of 32 short sentences) and each dense layer of
an encoder layer (query/key/value side by side, attention output, FFN up, FFN down), times one call of:

- MKL: `nn.functional.linear`, what a plain `nn.Linear` runs (in bf16 PyTorch routes it to oneDNN itself);
- oneDNN: `torch.ops.mkldnn._linear_pointwise` on the layer's own weight;
- oneDNN packed: the same on the weight packed in oneDNN's blocked layout (`_reorder_linear_weight`);
- few rows: `roformer_hf.few_rows`' GEMM on the weight packed in its tiles (fp32, where it is available);

medians of `--repeats` calls after warm-up, and whether the packed weight gives the bits of the unpacked one. Then
the kernel `_dense_kernel` chooses for each shape, and how much slower it is than the fastest (1.00x: the rule picks
the best kernel). A rule that another CPU kind measures wrong shows here first.

Then the encoder's dense calls in a row (`DenseChain`: each layer's query/key/value, attention output with its
residual, FFN up with GELU, FFN down with its residual; no attention between them), at each row count: in fp32
roformer_hf's calls (`fused_linear`), plain `nn.Linear`s (MKL) and, where it is installed, OpenVINO's CPU plugin on
the same module (`openvino.convert_model`, the latency hint, fp32); in bf16 the module cast, and OpenVINO's bf16
inference precision; in int8 roformer_hf's `quantize_int8` and OpenVINO's graph quantized by nncf. With the kernels
OpenVINO chose for its dense layers: what the model's dense layers cost against what the same layers cost in the
runtime the latency target names. In fp32 roformer_hf's calls also run under each other CPU kind's rule
(`fused.DenseRule`), in the same turns: whether this CPU's rule is the fastest of them here. A layer timed alone keeps
its weight in the caches call after call; in a row, each reads its weight from memory, as a forward does, so the
rules are judged on the calls in a row. In int8 the chain also runs on each of `Int8Linear`'s kernels at every row
count, fbgemm's on weights packed once, oneDNN's and `few_rows`' int8 kernel (VNNI or AVX2) where it is available: the
measurements behind `quantization.few_row_limit` and `quantization.few_rows_int8_limit`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import math
import time
from collections import Counter
from statistics import median

import torch
from common import machine_lines
from transformers.activations import ACT2FN
from workload import add_size_arguments, parse_args, size_of

from roformer_hf import few_rows, fused, quantization
from roformer_hf.fused import fused_linear, fused_linears
from roformer_hf.quantization import quantize_int8

KERNELS = ("MKL", "oneDNN", "oneDNN packed", "few rows")
CHOSEN = {"module": "MKL", "onednn": "oneDNN", "packed": "oneDNN packed", "few_rows": "few rows",
          "few_rows_bf16": "few rows"}  # `_dense_kernel`'s


def time_call(call, repeats: int) -> float:
    for _ in range(3):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return median(samples)


def layer_shapes(size) -> dict[str, tuple[int, int]]:
    """(in, out) of each dense call of an encoder layer."""
    return {"q/k/v": (size.hidden, 3 * size.hidden), "attention output": (size.hidden, size.hidden),
            "FFN up": (size.hidden, size.intermediate), "FFN down": (size.intermediate, size.hidden)}


def measure(dtype: torch.dtype, rows: int, in_features: int, out_features: int, repeats: int) -> tuple[dict, bool]:
    """Microseconds per call of each kernel, and whether the packed weight gives the unpacked one's bits."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = (0.02 * torch.randn(out_features, in_features, generator=generator)).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, fused.PACKING_HINT)
    calls = {"MKL": lambda: torch.nn.functional.linear(x, weight, bias),
             "oneDNN": lambda: fused._KERNEL(x, weight, bias, "none", [], ""),
             "oneDNN packed": lambda: fused._KERNEL(x, packed, bias, "none", [], "")}
    if dtype == torch.float32 and few_rows.available():
        tiles = few_rows.pack(weight)
        calls["few rows"] = lambda: few_rows.linear(x, tiles, bias)
    if dtype == torch.bfloat16 and few_rows.bf16_available():
        bf16_tiles = few_rows.pack_bf16(weight)
        calls["few rows"] = lambda: few_rows.bf16_linear(x, bf16_tiles, bias)
    with torch.inference_mode():
        same_bits = torch.equal(calls["oneDNN"](), calls["oneDNN packed"]())
        return {name: 1e6 * time_call(call, repeats) for name, call in calls.items()}, same_bits


class DenseChain(torch.nn.Module):
    """The dense calls of `layers` encoder layers in a row, as the model makes them: query, key and value side by side,
    then the attention output (fed their sum, so that none is left unused) plus the residual, FFN up with GELU, FFN
    down plus the residual."""

    def __init__(self, size, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "query": torch.nn.Linear(size.hidden, size.hidden), "key": torch.nn.Linear(size.hidden, size.hidden),
            "value": torch.nn.Linear(size.hidden, size.hidden), "output": torch.nn.Linear(size.hidden, size.hidden),
            "up": torch.nn.Linear(size.hidden, size.intermediate), "down": torch.nn.Linear(size.intermediate, size.hidden),
        }) for _ in range(layers))
        self.gelu = ACT2FN["gelu"]  # transformers' (the erf form), RoFormer's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            query, key, value = fused_linears((block["query"], block["key"], block["value"]), x)
            x = fused_linear(block["output"], query + key + value, None, x)
            x = fused_linear(block["down"], fused_linear(block["up"], x, self.gelu), None, x)
        return x


CHAIN_BLOCK = 5  # calls of one path in a row per repeat, after those that settle it: its weights as a server keeps them
# Untimed calls of a path at the start of its turn: this many, or as many as this many seconds take, whichever ends
# first. On an Intel Xeon with AMX a path ran up to 1.3x slower for its first 20-30 calls after another path's.
SETTLE_CALLS, SETTLE_SECONDS = 25, 0.25
CHAIN_PATHS = ("roformer_hf", "nn.Linear (MKL)", "OpenVINO")
INT8_KERNELS = ("oneDNN", "fbgemm", "few rows")  # `Int8Linear`'s kernels, timed apart in int8
BF16_KERNELS = ("oneDNN packed", "few rows")  # bf16's, where `few_rows`' bf16 kernel is available
# Each CPU kind's `fused.DenseRule`, those that take `few_rows`' kernel as they are where it cannot be built, and, where
# it is built, this CPU's with `few_rows`' kernel at every row count (whether one packed copy could serve every input).
RULES = (*fused.RULES, *(dataclasses.replace(rule, cpu=f"{rule.cpu}, without few rows", few_rows_max_rows=0)
                         for rule in fused.RULES if rule.few_rows_max_rows),
         *([dataclasses.replace(fused.RULE, cpu=f"{fused.RULE.cpu}, few rows at every row count",
                                few_rows_max_rows=10**9)] if few_rows.available() else []))


def under_int8_limit(limit: float, call, vnni_rows: float = 0):
    """`call` with `Int8Linear` taking `few_rows`' int8 kernel up to `vnni_rows` rows (`quantization.FEW_ROWS_INT8_ROWS`),
    fbgemm's kernel below `limit` rows past those (`quantization.SMALL_BATCH_ROWS`) and oneDNN's beyond, in place of
    this CPU's limits; the layers must hold every kernel's copies (`int8_with_fbgemm`)."""
    def run():
        mine = quantization.SMALL_BATCH_ROWS, quantization.FEW_ROWS_INT8_ROWS
        quantization.SMALL_BATCH_ROWS, quantization.FEW_ROWS_INT8_ROWS = limit, vnni_rows
        try:
            return call()
        finally:
            quantization.SMALL_BATCH_ROWS, quantization.FEW_ROWS_INT8_ROWS = mine
    return run


def int8_with_fbgemm(chain: DenseChain) -> DenseChain:
    """`chain` quantized by `quantize_int8` with fbgemm's packed copies of the weights (and `few_rows`' int8 kernel's, where
    it is available) beside oneDNN's, whatever this CPU's limits: any kernel at any row count (`under_int8_limit`)."""
    mine = quantization.SMALL_BATCH_ROWS, quantization.FEW_ROWS_INT8_ROWS
    quantization.SMALL_BATCH_ROWS, quantization.FEW_ROWS_INT8_ROWS = math.inf, 1
    try:
        return quantize_int8(copy.deepcopy(chain))
    finally:
        quantization.SMALL_BATCH_ROWS, quantization.FEW_ROWS_INT8_ROWS = mine


def bf16_rows(limit: float) -> str:
    """The bf16 calls a rule gives `few_rows`' bf16 kernel, in words."""
    return "every call" if limit == math.inf else f"the calls of up to {limit} rows"


def under_rule(rule: fused.DenseRule, call):
    """`call` with the dense layers taking `rule`'s kernels instead of this CPU's."""
    def run():
        mine, fused.RULE = fused.RULE, rule
        try:
            return call()
        finally:
            fused.RULE = mine
    return run


def openvino_chain(chain: DenseChain, x: torch.Tensor, precision: str, threads: int):
    """The chain compiled by OpenVINO's CPU plugin (latency hint; bf16 inference precision for bf16, else fp32), its
    dense layers quantized by nncf for int8 (calibrated on random inputs of `x`'s shape, as a transformer); None
    without openvino (or nncf, for int8)."""
    if importlib.util.find_spec("openvino") is None or (precision == "int8" and importlib.util.find_spec("nncf") is None):
        return None
    import openvino

    graph = openvino.convert_model(chain, example_input=x)
    if precision == "int8":
        import nncf

        generator = torch.Generator().manual_seed(1)
        samples = [torch.randn(x.shape, generator=generator).numpy() for _ in range(8)]
        graph = nncf.quantize(graph, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(samples))
    hint = "bf16" if precision == "bf16" else "f32"
    return openvino.compile_model(graph, "CPU", config={"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
                                                        "INFERENCE_PRECISION_HINT": hint})


def chain_times(size, layers: int, rows: int, precision: str, repeats: int,
                threads: int) -> tuple[dict[str, float], str]:
    """Milliseconds per `DenseChain` forward of each path at `precision` (``"fp32"``, with roformer_hf also under each
    other CPU kind's rule; ``"bf16"``: the chain cast, OpenVINO's bf16 inference precision; ``"int8"``: roformer_hf's
    `quantize_int8` against OpenVINO's nncf quantization): the median over `repeats` of the mean of `CHAIN_BLOCK` calls
    in a row after `SETTLE_CALLS` untimed ones (at most `SETTLE_SECONDS`), the paths taking turns, each turn in an
    order rotated by one. And the kernels OpenVINO chose for its dense layers, or why it did not run."""
    torch.manual_seed(0)
    chain, x = DenseChain(size, layers).eval(), torch.randn(rows, size.hidden)
    compiled = openvino_chain(chain, x, precision, threads)
    calls = {}
    if precision == "int8":
        quantized, both = quantize_int8(copy.deepcopy(chain)), int8_with_fbgemm(chain)
        calls["roformer_hf"] = lambda: quantized(x)
        calls.update({f"int8: {name}": under_int8_limit(limit, lambda: both(x))
                      for name, limit in (("oneDNN", 0), ("fbgemm", math.inf))})
        if few_rows.int8_available():
            calls["int8: few rows"] = under_int8_limit(0, lambda: both(x), vnni_rows=math.inf)
    elif precision == "bf16":  # plain `nn.Linear` in bf16 is oneDNN's kernel already: no MKL path to time
        cast, x_bf16 = copy.deepcopy(chain).to(torch.bfloat16), x.bfloat16()
        calls["roformer_hf"] = lambda: cast(x_bf16).float()
        if few_rows.bf16_available():
            calls.update({f"bf16: {name}": under_rule(dataclasses.replace(fused.RULE, bf16_few_rows_max_rows=limit),
                                                      calls["roformer_hf"])
                          for name, limit in (("oneDNN packed", 0), ("few rows", 10 ** 9))})
    else:
        calls["roformer_hf"] = lambda: chain(x)
        calls.update({f"rule: {rule.cpu}": under_rule(rule, calls["roformer_hf"]) for rule in RULES
                      if rule != fused.RULE})

        def plain_linear():
            with torch.backends.mkldnn.flags(enabled=False):  # `fusion_applies` false: each call is the layer's own
                return chain(x)

        calls["nn.Linear (MKL)"] = plain_linear
    if compiled is not None:
        request, array = compiled.create_infer_request(), x.numpy()
        calls["OpenVINO"] = lambda: request.infer({0: array})
    samples = {name: [] for name in calls}
    with torch.inference_mode():
        expected = chain(x)
        for name, call in calls.items():
            output = call()
            if name != "OpenVINO":
                cosine = torch.nn.functional.cosine_similarity(output.flatten(), expected.flatten(), dim=0)
                assert cosine > 0.99, f"{name} ({precision}) strays from fp32: cosine {cosine:.4f}"
        names = list(calls)
        for repeat in range(repeats):  # each turn starts one path later
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                call, settling = calls[name], time.perf_counter()
                for _ in range(SETTLE_CALLS):
                    call()
                    if time.perf_counter() - settling > SETTLE_SECONDS:
                        break
                start = time.perf_counter()
                for _ in range(CHAIN_BLOCK):
                    call()
                samples[name].append((time.perf_counter() - start) / CHAIN_BLOCK)
    kernels = "openvino (and for int8 nncf) not installed: the `bench` extra"
    if compiled is not None:  # its kernels are chosen at the first inference
        chosen = Counter(node.get_rt_info()["primitiveType"].astype(str)
                         for node in compiled.get_runtime_model().get_ops()
                         if node.get_rt_info()["layerType"].astype(str) == "FullyConnected")
        kernels = ", ".join(f"{name} x{count}" for name, count in chosen.most_common())
    return {name: 1e3 * median(times) for name, times in samples.items()}, kernels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 626])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--chain-rows", type=int, nargs="*", default=[16, 64, 626],
                        help="row counts of the dense calls in a row (none: leave that table out)")
    parser.add_argument("--chain-precisions", nargs="+", choices=["fp32", "bf16", "int8"],
                        default=["fp32", *(["bf16"] if fused._BF16_GEMMS else []), "int8"],
                        help="default: fp32, bf16 where oneDNN computes it here, int8")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv, repeats=20)
    if fused._KERNEL is None or fused._PACK is None:
        raise SystemExit("this PyTorch has no oneDNN linear kernel or weight packing: nothing to compare")
    if args.threads:
        torch.set_num_threads(args.threads)
    size = size_of(args)
    dtypes = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if fused._BF16_GEMMS else {})}
    print("\n## Dense kernels per shape (µs per call, median)\n")
    print(*machine_lines(), sep="\n")
    print(f"- encoder layer: hidden {size.hidden}, intermediate {size.intermediate}; {args.repeats} calls each; "
          f"this CPU's rule (`fused.RULE`): {fused.RULE}\n")
    print("| dtype | rows | layer | " + " | ".join(KERNELS) + " | packed: same bits | `_dense_kernel` picks | "
          "its time / the fastest |")
    print("|---|---|---|" + "---|" * (len(KERNELS) + 3))
    worst = 1.0
    for label, dtype in dtypes.items():
        for rows in args.rows:
            chosen = CHOSEN[fused._dense_kernel(torch.empty(rows, size.hidden, dtype=dtype))]
            for layer, (in_features, out_features) in layer_shapes(size).items():
                times, same_bits = measure(dtype, rows, in_features, out_features, args.repeats)
                ratio = times[chosen] / min(times.values())
                worst = max(worst, ratio)
                print(f"| {label} | {rows} | {layer} | "
                      + " | ".join(f"{times[name]:.1f}" if name in times else "–" for name in KERNELS)
                      + f" | {'yes' if same_bits else 'no'} | {chosen} | {ratio:.2f}x |")
    print(f"\nThe rule's choice at most {worst:.2f}x the fastest kernel's time on a shape here.")
    if args.chain_rows:
        print(f"\n## The dense calls of {args.layers} encoder layers in a row (ms per chain: median of {args.repeats} "
              f"turns, each the mean of {CHAIN_BLOCK} calls in a row after {SETTLE_CALLS} untimed, at most "
              f"{SETTLE_SECONDS} s of them)\n")
        print("| precision | rows | " + " | ".join(CHAIN_PATHS) + " | roformer_hf / OpenVINO | OpenVINO's kernels |")
        print("|---|---|" + "---|" * (len(CHAIN_PATHS) + 2))
        by_rule, by_int8, by_bf16 = {}, {}, {}
        for precision in args.chain_precisions:
            for rows in args.chain_rows:
                times, kernels = chain_times(size, args.layers, rows, precision, args.repeats, torch.get_num_threads())
                cells = [f"{times[path]:.3f}" if path in times else "–" for path in CHAIN_PATHS]
                ratio = f"{times['roformer_hf'] / times['OpenVINO']:.2f}x" if "OpenVINO" in times else "–"
                print(f"| {precision} | {rows} | " + " | ".join(cells) + f" | {ratio} | {kernels} |")
                if precision == "fp32":
                    by_rule[rows] = [times["roformer_hf" if rule == fused.RULE else f"rule: {rule.cpu}"]
                                     for rule in RULES]
                if precision == "int8":
                    by_int8[rows] = [times.get(f"int8: {kernel}", math.nan) for kernel in INT8_KERNELS]
                if precision == "bf16" and "bf16: few rows" in times:
                    by_bf16[rows] = [times[f"bf16: {kernel}"] for kernel in BF16_KERNELS]
        if by_rule:
            print(f"\nThe fp32 calls in a row under each CPU kind's rule (ms, from the same turns; this CPU's: "
                  f"{fused.RULE.cpu}), each over the fastest:\n")
            print("| rows | " + " | ".join(rule.cpu for rule in RULES) + " |")
            print("|---|" + "---|" * len(RULES))
            for rows, times in by_rule.items():
                print(f"| {rows} | " + " | ".join(f"{time:.3f} ({time / min(times):.2f}x)" for time in times) + " |")
        if by_bf16:
            print(f"\nThe bf16 calls in a row on each kernel (ms, from the same turns), each over the fastest; this CPU's "
                  f"rule gives `few_rows`' bf16 kernel {bf16_rows(fused.RULE.bf16_few_rows_max_rows)} "
                  "(`DenseRule.bf16_few_rows_max_rows`), oneDNN's on the packed weight the rest:\n")
            print("| rows | " + " | ".join(BF16_KERNELS) + " |\n|---|" + "---|" * len(BF16_KERNELS))
            for rows, times in by_bf16.items():
                print(f"| {rows} | " + " | ".join(f"{time:.3f} ({time / min(times):.2f}x)" for time in times) + " |")
        if by_int8:
            print(f"\nThe int8 calls in a row on each kernel (ms, from the same turns), each over the fastest; this CPU "
                  f"gives `few_rows`' int8 kernel the calls of up to {quantization.FEW_ROWS_INT8_ROWS} rows "
                  f"(`quantization.few_rows_int8_limit`), fbgemm's those of fewer than {quantization.SMALL_BATCH_ROWS} "
                  "past them (`quantization.few_row_limit`), oneDNN's the rest:\n")
            print("| rows | " + " | ".join(INT8_KERNELS) + " |\n|---|" + "---|" * len(INT8_KERNELS))
            for rows, times in by_int8.items():
                fastest = min(time for time in times if not math.isnan(time))
                print(f"| {rows} | " + " | ".join("–" if math.isnan(time) else f"{time:.3f} ({time / fastest:.2f}x)"
                                                  for time in times) + " |")


if __name__ == "__main__":
    main()
