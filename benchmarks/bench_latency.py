"""Latency on CPU: milliseconds per call of roformer_hf, transformers' RoFormer and OpenVINO on the same weights.

    python benchmarks/bench_latency.py              # 4 layers of base width, every core (a few minutes on 2 cores)
    python benchmarks/bench_latency.py --quick      # tiny smoke configuration (seconds)
    python benchmarks/bench_latency.py --workloads sentence --block 10 --repeats 10 --compile   # batch 1, back to back

What it does:
1. Builds transformers' `RoFormerModel` (dropout 0, eager attention, its only kernel), saves it, and loads the folder in
   roformer_hf (`RoFormerModel`, SDPA): the same weights. Converts transformers' model to OpenVINO with
   `openvino.convert_model` (traced on the one-sentence input; both input dimensions stay dynamic, so one compiled
   model serves every workload).
2. For each precision of `--precisions` (default: those the CPU computes natively: fp32; bf16 where oneDNN has bf16
   GEMMs, i.e. AVX-512 bf16 or AMX; int8): the PyTorch models cast to bf16 (`.to(torch.bfloat16)`), or roformer_hf's
   `quantize_int8` (transformers has no int8 path); OpenVINO compiled for the CPU plugin with the latency hint,
   `--threads` inference threads and the precision's inference precision hint, its int8 from nncf's post-training
   quantization of the graph, calibrated on 64 short sentences (`pip install nncf`; without it, no OpenVINO int8).
3. The workloads (`--workloads`): one sentence of `--length` tokens (batch 1); 32 short sentences (8-32 tokens,
   sorted longest first and right-padded, as sentence-transformers batches them); the padded batch of `--lengths`
   (the CPU targets' 8 x 512..128). On each, checks every model's last hidden state against transformers' fp32 one at
   the real tokens (fp32: max abs difference at most `--tolerance`; bf16 and int8: every token's cosine at least
   `--min-cosine`), then times one forward of each (`torch.inference_mode`), interleaved, rotating which goes first,
   `--repeats` times after `--warmup` rounds (`--block N`: N calls of a model in a row per turn, as a server runs one
   model, the first of each left out); reports the median and the 90th percentile, and each median over OpenVINO's.
   `--compile` adds roformer_hf's model compiled for latency at each precision (`compiled_for_latency`:
   docs/export.md's recipe; in bf16 on the model cast; in int8 on docs/quantization.md's static quantization, torchao's
   PT2E flow calibrated on OpenVINO's sentences) on the one sentence.
4. The floor of the one sentence at each precision: the bytes of the encoder's parameters and buffers (what a
   forward reads whatever its input) over the read bandwidth this process measures on a buffer of that size, read
   again right after (as a forward reads the weights the previous one read), and the sentence's time over it; beside
   it the arithmetic floor, the forward's FLOPs over the rate of a large GEMM at that precision (`gemm_rate`): at 16
   tokens a forward of base width is bound by its arithmetic, not by reading its weights.
5. `decode`: one decoding step of roformer_hf's `RoFormerForCausalLM` (batch 1, one token, on the cache it makes)
   after a prompt of P tokens, for each P of `--prefixes`, interleaved the same way; each step adds a token to the
   cache. roformer_hf only (the first step's logits are checked against transformers' first), to follow the step's
   cost from commit to commit.

The model's size comes from `workload.add_size_arguments`; `--threads` defaults to every core this process may run on,
for torch and OpenVINO alike. OpenVINO is the `bench` extra (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import tempfile
import time
from statistics import median

import torch
from bench_embeddings import SETS, batches, sentences
from common import available_cores, machine_lines, native_precisions, progress, time_interleaved, time_once, verdict
from workload import add_size_arguments, forward_flops, padded_batch, parse_args, size_of, transformers_config

import roformer_hf  # after workload, which puts this checkout first on sys.path
from roformer_hf import fused, quantization

WORKLOADS = ("sentence", "short", "padded", "decode")
MODELS = ("roformer_hf", "transformers", "OpenVINO")
COMPILED = "roformer_hf compiled"  # `--compile`: `compiled_for_latency`
SHORT_TARGET = 1.0  # roformer_hf's latency over OpenVINO's at the same precision, one or 32 short sentences, at most
FLOOR_TARGET = 1.5  # roformer_hf's batch-1 latency over the weights' read time, at most


def load_pair(head: str, config, folder: str) -> dict[str, torch.nn.Module]:
    """transformers' `head` with random weights, saved to `folder`, and roformer_hf's `head` loaded from it."""
    import transformers

    torch.manual_seed(0)
    reference = getattr(transformers, head)(config).eval()
    reference.save_pretrained(folder)
    ours, info = getattr(roformer_hf, head).from_pretrained(folder, output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"roformer_hf did not load every weight of the checkpoint: {info}")
    return {"roformer_hf": ours.eval(), "transformers": reference}


def compiled_for_latency(folder: str, backend: str = "inductor", precision: str = "fp32",
                         calibration: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.nn.Module:
    """roformer_hf's model of `folder` as docs/export.md compiles it for latency: the padded layout
    (``unpad_inputs=False``: nothing depends on the mask's values, so the forward is one graph), dynamic shapes (a new
    length compiles nothing new), frozen weights (inductor packs them and fuses the activations into its oneDNN
    GEMMs; with AVX2 only, GELU after them, `fused._gelu_written_out`) and inductor's C++ wrapper (its kernels called from C++, not one by one from Python). It compiles on its
    first call, which must run without autograd. Both are inductor's global settings, read when a graph compiles:
    `torch.compile`'s ``options={"freezing": True}`` does not reach freezing (measured with torch 2.13: the GEMMs
    stayed unpacked, 2.2x slower). `backend`: torch.compile's (both settings are inductor's).

    `precision`: ``"fp32"``; ``"bf16"``, the model cast first; ``"int8"``, the model exported and quantized
    statically as docs/quantization.md does it (`static_int8`), its activations' scales from `calibration`."""
    import torch._inductor.config

    torch._inductor.config.freezing = torch._inductor.config.cpp_wrapper = True
    model = roformer_hf.RoFormerModel.from_pretrained(folder, unpad_inputs=False).eval()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    elif precision == "int8":
        model = static_int8(model, calibration)
    return torch.compile(model, dynamic=True, backend=backend)


def static_int8(model: torch.nn.Module, calibration: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.nn.Module:
    """docs/quantization.md's static int8 for latency: `model` (padded layout) exported with a dynamic batch and
    length and quantized statically (`roformer_hf.quantization.static_int8`), its activations' scales fixed from the
    `calibration` batches ``(input_ids, attention_mask)``."""
    dims = {0: torch.export.Dim("batch", max=1024), 1: torch.export.Dim("length", max=512)}
    return quantization.static_int8(model, [{"input_ids": ids, "attention_mask": mask} for ids, mask in calibration],
                                    dynamic_shapes={"input_ids": dims, "attention_mask": dims})


PRECISIONS = ("fp32", "bf16", "int8")
OPENVINO_HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}  # int8: the ops nncf left unquantized, as ours


class OpenVinoModel:
    """transformers' RoFormerModel converted by `openvino.convert_model` and compiled for the CPU plugin: dynamic
    batch and length, `PERFORMANCE_HINT` LATENCY, `threads` inference threads, the `precision`'s inference precision
    hint (int8: nncf's post-training quantization of the converted graph, calibrated on `calibration`, the other ops
    in fp32)."""

    def __init__(self, graph, threads: int, precision: str = "fp32",
                 calibration: list[tuple[torch.Tensor, torch.Tensor]] = ()):
        import openvino

        self.config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
                       "INFERENCE_PRECISION_HINT": OPENVINO_HINTS[precision]}
        start = time.perf_counter()
        if precision == "int8":
            import nncf

            dataset = nncf.Dataset([{"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
                                    for ids, mask in calibration])
            graph = nncf.quantize(graph, dataset, model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=len(calibration))
        self.request = openvino.compile_model(graph, "CPU", config=self.config).create_infer_request()
        self.compile_seconds = time.perf_counter() - start

    @staticmethod
    def convert(model: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor]):
        """`model` as an OpenVINO graph, traced on `example`, both input dimensions dynamic."""
        import openvino

        input_ids, attention_mask = example
        return openvino.convert_model(model, example_input={"input_ids": input_ids, "attention_mask": attention_mask})

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        outputs = self.request.infer({"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
        return torch.from_numpy(outputs[0])  # last_hidden_state, (B, L, H)


def openvino_available(precision: str) -> str | None:
    """Why OpenVINO cannot run `precision` here, or None."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed (the `bench` extra)"
    if precision == "int8" and importlib.util.find_spec("nncf") is None:
        return "nncf is not installed (OpenVINO's int8 quantizer: `pip install nncf`)"
    return None


def at_precision(models: dict[str, torch.nn.Module], precision: str) -> dict[str, torch.nn.Module]:
    """roformer_hf's and transformers' fp32 models at `precision`: cast to bf16, or roformer_hf's `quantize_int8`
    (transformers' RoFormer has no int8 path of its own)."""
    from roformer_hf.quantization import quantize_int8

    if precision == "fp32":
        return dict(models)
    if precision == "bf16":
        return {name: copy.deepcopy(model).to(torch.bfloat16) for name, model in models.items()}
    return {"roformer_hf": quantize_int8(copy.deepcopy(models["roformer_hf"]))}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the encoder's parameters and buffers: what one forward reads whatever its input (the embeddings'
    lookup reads a few rows only)."""
    encoder = model.encoder
    return sum(t.numel() * t.element_size() for t in (*encoder.parameters(), *encoder.buffers()))


def read_bandwidth(size: int, repeats: int = 20) -> float:
    """Bytes per second at which this process's threads read a buffer of `size` bytes that was read just before (as
    a forward reads weights it read on the previous call): the best of `repeats` sums over it."""
    buffer = torch.ones(max(size // 4, 1))
    buffer.sum()
    return size / min(time_once(buffer.sum) for _ in range(repeats))


def gemm_rate(precision: str, hidden: int, intermediate: int, rows: int = 2048, repeats: int = 5) -> float:
    """FLOP/s (two per multiply-add) of this process's threads on one large product at `precision`: the
    feed-forward's expansion over `rows` tokens, ``(rows x hidden) @ (hidden x intermediate)``, where the GEMM runs at
    the CPU's arithmetic rate rather than waiting on its weights; fp32 and bf16 through the faster of
    `nn.functional.linear` (MKL's in fp32) and oneDNN's kernel (on an AMD Zen 5 twice MKL's fp32 rate), int8 through
    roformer_hf's `quantization.Int8Linear` (the kernel its int8 forward takes at that many rows: oneDNN's, or
    fbgemm's, on CPUs without VNNI, where `torch._int_mm` has no fast kernel). The best of `repeats`."""
    if precision == "int8":
        x = torch.randn(rows, hidden)
        layer = quantization.Int8Linear(torch.nn.Linear(hidden, intermediate, bias=False))

        def product():
            with torch.inference_mode():
                return layer(x)
        products = [product]
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        x, weight = torch.randn(rows, hidden, dtype=dtype), torch.randn(intermediate, hidden, dtype=dtype)
        products = [lambda: torch.nn.functional.linear(x, weight)]
        if fused._KERNEL is not None and dtype in fused._KERNEL_DTYPES:
            products.append(lambda: fused._KERNEL(x, weight, None, "none", [], ""))
    for one in products:
        one()  # warm-up
    return max(2 * rows * hidden * intermediate / min(time_once(one) for _ in range(repeats)) for one in products)


def last_hidden_state(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    if isinstance(model, OpenVinoModel):
        return model(input_ids, attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def encoder_inputs(workload: str, args) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, each `(B, L)`, of an encoder workload."""
    if workload == "sentence":
        return batches(sentences(args.length, args.length, 1, args.vocab, args.seed), 1)[0]
    if workload == "short":
        return batches(sentences(*SETS["short"], 32, args.vocab, args.seed), 32)[0]
    return padded_batch(args.lengths, args.vocab, args.seed)[:2]


def agreement(hidden: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference from `reference` and the smallest cosine similarity of a token's vector to
    its reference vector, over the rows given (real tokens)."""
    hidden = hidden.float()
    cosine = torch.nn.functional.cosine_similarity(hidden, reference, dim=-1).min().item()
    return (hidden - reference).abs().max().item(), cosine


def encoder_latency(models: dict, inputs, precision: str, reference_model,
                    args) -> tuple[dict[str, list[float]], dict[str, tuple[float, float]]]:
    """Each model's seconds per forward on `inputs`, and its `agreement` with the fp32 `reference_model`
    (transformers') at the real tokens, checked before timing: fp32 within `args.tolerance`, lower precisions at
    least `args.min_cosine` on every token."""
    input_ids, attention_mask = inputs
    real = attention_mask.bool()
    with torch.inference_mode():
        reference = last_hidden_state(reference_model, *inputs)[real]
        agreements = {name: agreement(last_hidden_state(model, *inputs)[real], reference)
                      for name, model in models.items()}
        wrong = {name: found for name, found in agreements.items()
                 if (found[0] > args.tolerance if precision == "fp32" else found[1] < args.min_cosine)}
        if wrong:
            raise RuntimeError(f"{precision} last hidden states disagree with transformers' fp32 ones (max abs "
                               f"difference, min cosine): {wrong}")
        runners = {name: (lambda model=model: time_once(lambda: last_hidden_state(model, *inputs)))
                   for name, model in models.items()}
        return time_interleaved(runners, args.warmup, args.repeats, args.block), agreements


def decode_latency(folder: str, args) -> tuple[dict[int, list[float]], float]:
    """roformer_hf's seconds per one-token step (batch 1) on a cache filled with each prompt of `args.prefixes`, and
    the largest difference of the first step's logits from transformers' (checked at most `args.tolerance`).

    Each prompt is run once; every warm-up round and repeat then appends one token to its cache, so the cache of a
    prompt of P tokens holds P+1 to P+warmup+repeats tokens while it is timed (a prompt run again for every step
    would cost more than all the steps at P=512)."""
    steps = args.warmup + args.repeats
    config = transformers_config(size_of(args), max(args.prefixes) + steps + 1)
    config.is_decoder = True
    models = load_pair("RoFormerForCausalLM", config, folder)
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(5, args.vocab, (1, max(args.prefixes) + steps + 1), generator=generator)
    caches, diff = {}, 0.0

    def step(model, cache) -> torch.Tensor:
        position = cache.get_seq_length()
        return model(ids[:, position:position + 1], past_key_values=cache, use_cache=True).logits

    with torch.inference_mode():
        for prefix in args.prefixes:
            logits = {}
            for name, model in models.items():
                caches[name, prefix] = model(ids[:, :prefix], use_cache=True).past_key_values
                logits[name] = step(model, caches[name, prefix])
            diff = max(diff, (logits["roformer_hf"] - logits["transformers"]).abs().max().item())
        if diff > args.tolerance:
            raise RuntimeError(f"roformer_hf's decoding step differs from transformers' by {diff} > {args.tolerance}")
        ours = models["roformer_hf"]
        runners = {prefix: (lambda cache=caches["roformer_hf", prefix]: time_once(lambda: step(ours, cache)))
                   for prefix in args.prefixes}
        return time_interleaved(runners, args.warmup, args.repeats), diff


def p90(samples: list[float]) -> float:
    """The 90th percentile, nearest rank."""
    return sorted(samples)[math.ceil(0.9 * len(samples)) - 1]


def milliseconds(samples: list[float]) -> str:
    return f"{1e3 * median(samples):.2f} ({1e3 * p90(samples):.2f})"


def report(args, size, threads: int, openvino_line: str | None, rows: dict, floors: dict, decode) -> None:
    print("\n## Latency on CPU (ms per call: median (p90) of the interleaved repeats)\n")
    print(*machine_lines(), sep="\n")
    print(f"- model: {size.layers} layers, hidden {size.hidden}, {size.heads} heads, intermediate {size.intermediate}, "
          f"vocab {size.vocab}; dropout 0 (eval); {threads} threads; repeats {args.repeats}, warm-up rounds "
          f"{args.warmup}; " + ("each call interleaved" if args.block == 1 else
                                f"each model {args.block} calls in a row per repeat, the first left out"))
    print("- precisions: fp32; bf16 (each PyTorch model cast with `.to(torch.bfloat16)`, OpenVINO's bf16 inference "
          "precision); int8 (roformer_hf's `quantize_int8`; OpenVINO: nncf's `quantize` of its graph, calibrated on "
          "the short sentences, the other ops in fp32; transformers has none)")
    if openvino_line:
        print(openvino_line)
    names = [*MODELS, COMPILED] if args.compile else list(MODELS)
    against = [name for name in names if name != "OpenVINO"]
    if args.compile:
        frozen = ", frozen weights, C++ wrapper" if args.compile_backend == "inductor" else ""
        print(f"- {COMPILED}: `compiled_for_latency` (torch.compile with {args.compile_backend}, dynamic shapes{frozen}, "
              "the padded layout; bf16: the model cast; int8: `static_int8`, torchao's static PT2E quantization for "
              "inductor's x86 kernels, calibrated on OpenVINO's sentences), on the one sentence only (batches run "
              "faster in eager mode, which skips padding); compiled on its first call, before timing")
    if rows:
        print("\n| precision | workload | tokens (real / padded) | " + " | ".join(names) + " | "
              + " | ".join(f"{name} / OpenVINO" for name in against)
              + " | agreement with transformers' fp32 (max abs diff, min cosine): "
              + "; ".join(name for name in names if name != "transformers") + " |")
        print("|---|---|---|" + "---|" * (len(names) + len(against) + 1))
    for (precision, workload), (label, inputs, times, agreements) in rows.items():
        attention_mask = inputs[1]
        ratios = []
        for name in against:
            if name not in times or "OpenVINO" not in times:
                ratios.append("–")
                continue
            ratio = median(times[name]) / median(times["OpenVINO"])
            met = workload != "padded" and name != "transformers"
            ratios.append(f"{ratio:.2f}x" + (f" ({verdict(ratio <= SHORT_TARGET)})" if met else ""))
        print(f"| {precision} | {label} | {int(attention_mask.sum())} / {attention_mask.numel()} | "
              + " | ".join(milliseconds(times[name]) if name in times else "–" for name in names) + " | "
              + " | ".join(ratios) + " | "
              + "; ".join(f"{agreements[name][0]:.1e}, {agreements[name][1]:.4f}" if name in agreements else "–"
                          for name in names if name != "transformers") + " |")
    if rows:
        print(f"\nTarget: one sentence and 32 short sentences at or below OpenVINO's latency at the same precision "
              f"(roformer_hf / OpenVINO ≤ {SHORT_TARGET:.2f}x).")
    if floors:
        print(f"\nroformer_hf's one sentence against the machine's floor: the bytes of weights a forward reads (the "
              f"encoder's parameters and buffers) over the measured read bandwidth of a buffer that size, read again "
              f"right after (best of 20 sums); target within {FLOOR_TARGET:.1f}x. Beside it the arithmetic floor: the "
              f"forward's FLOPs (projections, feed-forward and attention on the real tokens) over the GEMM rate of a "
              f"large product at the precision (`gemm_rate`); the larger of the two bounds the forward\n")
        print("| precision | weights read (MB) | read bandwidth (GB/s) | floor (ms) | one sentence (ms) | over the floor "
              "| GFLOP | GEMM rate (GFLOP/s) | arithmetic floor (ms) | over the arithmetic floor |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for precision, (size_bytes, bandwidth, seconds, flops, rate) in floors.items():
            floor, arithmetic = size_bytes / bandwidth, flops / rate
            # Significant digits, not decimals: a small model's weights, read under load, can take a bandwidth below 0.1.
            print(f"| {precision} | {size_bytes / 1e6:.4g} | {bandwidth / 1e9:.3g} | {1e3 * floor:.3f} | "
                  f"{1e3 * seconds:.2f} | {seconds / floor:.2f}x ({verdict(seconds / floor <= FLOOR_TARGET)}) | "
                  f"{flops / 1e9:.3g} | {rate / 1e9:.3g} | {1e3 * arithmetic:.3g} | {seconds / arithmetic:.2f}x |")
    if decode is not None:
        times, diff = decode
        print(f"\nroformer_hf's RoFormerForCausalLM, one decoding step (batch 1, one token) after a prompt of P "
              f"tokens, ms per step: median (p90); each step adds a token, so the cache holds P+1 to "
              f"P+{args.warmup + args.repeats} tokens; the first step's logits within {diff:.1e} of transformers'\n")
        print("| P | roformer_hf |\n|---|---|")
        for prefix, samples in times.items():
            print(f"| {prefix} | {milliseconds(samples)} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--length", type=int, default=16, help="tokens of the one sentence, [CLS] and [SEP] included")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[16, 128, 512],
                        help="prompt lengths before the decoding step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block", type=int, default=1,
                        help="calls of one model in a row per repeat (the first of each left out): 1 interleaves every "
                             "call; more times each model as a server runs it, back to back")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=native_precisions(),
                        help="default: those this CPU computes natively (%(default)s)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="fp32: max abs difference allowed")
    parser.add_argument("--min-cosine", type=float, default=0.99,
                        help="bf16 and int8: the smallest cosine similarity allowed between a token's vector and "
                             "transformers' fp32 one")
    parser.add_argument("--compile", action="store_true",
                        help=f"also time `{COMPILED}`: the model compiled for latency (`compiled_for_latency`)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for --compile (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv, prefixes=[16, 32], warmup=1)
    threads = args.threads or available_cores()
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    size = size_of(args)
    encoder_workloads = [name for name in WORKLOADS[:3] if name in args.workloads]
    labels = {"sentence": f"1 sentence of {args.length} tokens", "short": "32 short sentences (8-32 tokens, sorted)",
              "padded": f"{len(args.lengths)} x {max(args.lengths)}..{min(args.lengths)} padded"}
    rows, floors, openvino_line, decode = {}, {}, None, None
    with tempfile.TemporaryDirectory(prefix="roformer_bench_") as folder:
        if encoder_workloads:
            progress("building the models, converting transformers' RoFormerModel to OpenVINO")
            fp32 = load_pair("RoFormerModel", transformers_config(size, max(args.length, *args.lengths)), folder)
            inputs = {workload: encoder_inputs(workload, args) for workload in encoder_workloads}
            graph = None
            if openvino_available("fp32") is None:
                import openvino

                start = time.perf_counter()
                graph = OpenVinoModel.convert(fp32["transformers"], encoder_inputs("sentence", args))
                openvino_line = (f"- openvino {openvino.__version__}: transformers' RoFormerModel through "
                                 f"openvino.convert_model ({time.perf_counter() - start:.1f} s; dynamic batch and "
                                 f"length), compiled for the CPU plugin with "
                                 f"{{'PERFORMANCE_HINT': 'LATENCY', 'INFERENCE_NUM_THREADS': {threads}}} and the "
                                 f"precision's INFERENCE_PRECISION_HINT {OPENVINO_HINTS}")
            # int8's calibration, for OpenVINO's nncf and for the compiled path's static quantization alike
            calibration = batches(sentences(*SETS["short"], 64, args.vocab, args.seed + 1), 8)
            for precision in args.precisions:
                progress(f"{precision}: preparing the models")
                models = at_precision(fp32, precision)
                missing = openvino_available(precision)
                if missing is None:
                    models["OpenVINO"] = OpenVinoModel(graph, threads, precision, calibration)
                elif precision == "int8" or graph is None:
                    progress(f"{precision}: no OpenVINO ({missing})")
                if args.compile and precision == "int8" and importlib.util.find_spec("torchao") is None:
                    progress("int8: no compiled path (torchao, the `quantization` extra, is not installed)")
                elif args.compile:
                    models[COMPILED] = compiled_for_latency(folder, args.compile_backend, precision, calibration)
                for workload in encoder_workloads:
                    progress(f"{precision}: checking and timing {labels[workload]}")
                    timed = {name: model for name, model in models.items()
                             if name != COMPILED or workload == "sentence"}  # the compiled path's use
                    rows[precision, workload] = (labels[workload], inputs[workload], *encoder_latency(
                        timed, inputs[workload], precision, fp32["transformers"], args))
                if "sentence" in encoder_workloads:
                    size_bytes = weight_bytes(models["roformer_hf"])
                    flops = forward_flops(size, (args.length,))
                    floors[precision] = (size_bytes, read_bandwidth(size_bytes),
                                         median(rows[precision, "sentence"][2]["roformer_hf"]),
                                         flops["linear"] + flops["attention"],  # RoFormerModel: no head
                                         gemm_rate(precision, size.hidden, size.intermediate))
                del models
        if "decode" in args.workloads:
            progress(f"timing roformer_hf's decoding step after {args.prefixes} tokens")
            decode = decode_latency(os.path.join(folder, "causal_lm"), args)
    report(args, size, threads, openvino_line, rows, floors, decode)


if __name__ == "__main__":
    main()
