"""The GEMM kernels a dense layer can take in CPU inference, per input shape, on this machine: the measurements behind
`roformer_hf.fused._dense_kernel`, the rule that picks one per call.

    python benchmarks/bench_dense.py            # the encoder's layers at base width (about a minute on 2 cores)
    python benchmarks/bench_dense.py --quick    # hidden 64 (seconds)

For each dtype oneDNN computes here (fp32; bf16 on CPUs with AVX-512 bf16 or AMX), each row count of `--rows` (one
row: a decoding step; 16: a short sentence; 64; 626: the real tokens of 32 short sentences) and each dense layer of
an encoder layer (query/key/value side by side, attention output, FFN up, FFN down), times one call of:

- MKL: `nn.functional.linear`, what a plain `nn.Linear` runs (in bf16 PyTorch routes it to oneDNN itself);
- oneDNN: `torch.ops.mkldnn._linear_pointwise` on the layer's own weight;
- oneDNN packed: the same on the weight packed in oneDNN's blocked layout (`_reorder_linear_weight`);

medians of `--repeats` calls after warm-up, and whether the packed weight gives the bits of the unpacked one. Then
the kernel `_dense_kernel` chooses for each shape, and how much slower it is than the fastest (1.00x: the rule picks
the best kernel). A rule that another CPU kind measures wrong shows here first.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch
from common import machine_lines
from workload import add_size_arguments, parse_args, size_of

from roformer_hf import fused

KERNELS = ("MKL", "oneDNN", "oneDNN packed")
CHOSEN = {"module": "MKL", "onednn": "oneDNN", "packed": "oneDNN packed"}  # `_dense_kernel`'s names


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
    with torch.inference_mode():
        same_bits = torch.equal(calls["oneDNN"](), calls["oneDNN packed"]())
        return {name: 1e6 * time_call(call, repeats) for name, call in calls.items()}, same_bits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 626])
    parser.add_argument("--repeats", type=int, default=100)
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
          f"Intel CPU (`fused._INTEL`, MKL for one fp32 row): {fused._INTEL}\n")
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
                print(f"| {label} | {rows} | {layer} | " + " | ".join(f"{times[name]:.1f}" for name in KERNELS)
                      + f" | {'yes' if same_bits else 'no'} | {chosen} | {ratio:.2f}x |")
    print(f"\nThe rule's choice at most {worst:.2f}x the fastest kernel's time on a shape here.")


if __name__ == "__main__":
    main()
