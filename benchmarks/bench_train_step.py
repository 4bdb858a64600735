"""A masked-LM training step at the demo's shape: roformer_hf against transformers' RoFormer, the same weights, in
one run, interleaved.

    python benchmarks/bench_train_step.py             # the demo's shape (a few minutes on 2 cores)
    python benchmarks/bench_train_step.py --quick     # tiny smoke configuration (seconds)
    python benchmarks/bench_train_step.py --batch 16 --dropout 0.1 --mlm_probability 0.15  # the demo's older recipe
    python benchmarks/bench_train_step.py --compile   # also a torch.compile'd roformer_hf step, and its compile time

The demo (`examples/demo.py`) pretrains hidden 256, 3 layers, 4 heads, intermediate 1024, vocabulary 8000, on 8
blocks of 256 tokens, 30% of them masked, without dropout, with Trainer's AdamW (lr 1e-3, weight decay 0.01). At that width the GEMMs
are small, so what surrounds them (optimizer, elementwise kernels, the loss, the collator) counts. A step here is
what Trainer runs: the collator's batch, forward with labels, backward, gradients clipped to norm 1, AdamW step,
gradients zeroed.

What it does:
1. Builds transformers' `RoFormerForMaskedLM`, saves it, loads the folder in both libraries (roformer_hf with its
   sparse prediction, the MLM head and the last layer's queries only on masked tokens, as the demo trains), and checks
   that both give the same loss and gradients with dropout off.
2. Times the step of each, interleaved (rotating which goes first), with the CPU's fp32 GEMM rate sampled between
   them at the model's largest product (the FFN expansion): the step's analytic FLOPs (3x the forward's, real
   tokens; see `workload.forward_flops`) per second as a share of that rate.
3. Times roformer_hf's step with each AdamW implementation torch has (`for`-loop, `foreach`, `fused`: Trainer's
   default), without attention dropout (hidden dropout kept: SDPA's fused kernel instead of
   `BlockedDropoutAttention`), and the phases of one step (collator, forward, backward, clipping, optimizer).
4. With `--compile`, times a `torch.compile`d copy of roformer_hf's model (the same weights; `--compile-backend`,
   default inductor) in the same rotation, and reports what its first calls cost (compiling, and recompiling for the
   masked-token count that changes from batch to batch) against the eager step: the number of steps it needs to pay
   that back.
5. Profiles one roformer_hf step and one transformers step and groups self CPU time by part (GEMMs, attention,
   elementwise, optimizer, ...).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from statistics import median

import torch
from common import machine_lines, progress, spread, time_interleaved
from profile_cpu import CATEGORIES
from torch.profiler import ProfilerActivity, profile
from workload import REPO_ROOT, Size, forward_flops, sparse_head_forward_flops

sys.path.insert(0, str(REPO_ROOT / "examples"))

SIDES = ("roformer_hf", "transformers")
DEMO = {"layers": 3, "hidden": 256, "heads": 4, "intermediate": 1024, "vocab": 8000, "batch": 8, "length": 256}
QUICK = {"layers": 2, "hidden": 64, "heads": 4, "intermediate": 256, "vocab": 1000, "batch": 4, "length": 64,
         "repeats": 3, "warmup": 1}
# Operator-name fragments of the step's parts beyond the model's (profile_cpu.CATEGORIES); the first match wins.
STEP_CATEGORIES = (
    ("gradient clipping", ("_foreach_norm", "linalg_vector_norm", "clamp")),
    ("optimizer (AdamW)", ("adamw", "_foreach_", "addcdiv", "addcmul", "lerp", "sqrt")),
    ("dropout", ("dropout", "bernoulli", "blocked")),
) + CATEGORIES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in DEMO.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout (demo: 0)")
    parser.add_argument("--mlm_probability", type=float, default=0.3, help="share of tokens masked (demo: 0.3)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also time a torch.compile'd roformer_hf step")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for --compile (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)


class Example:
    """The data side of a step: `batch` random blocks of `length` token ids, masked by the demo's collator."""

    def __init__(self, args: argparse.Namespace, tokenizer_vocab: int):
        from lib.collator import ResumableMLMCollator

        from roformer_hf import RoFormerHFTokenizer

        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(tokenizer_vocab - 5)])}
        self.collator = ResumableMLMCollator(RoFormerHFTokenizer(vocab=vocab), mlm_probability=args.mlm_probability,
                                             seed=args.seed)
        generator = torch.Generator().manual_seed(args.seed)
        self.examples = [{"input_ids": row.tolist()} for row in
                         torch.randint(5, tokenizer_vocab, (args.batch, args.length), generator=generator)]

    def __call__(self) -> dict[str, torch.Tensor]:
        return self.collator(self.examples)


def build_models(args: argparse.Namespace, folder: str, dropout: float) -> dict:
    from transformers import RoFormerConfig, RoFormerForMaskedLM

    import roformer_hf

    torch.manual_seed(args.seed)
    RoFormerForMaskedLM(RoFormerConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=args.intermediate, max_position_embeddings=args.length,
    )).save_pretrained(folder)
    dropouts = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    return {
        "roformer_hf": roformer_hf.RoFormerForMaskedLM.from_pretrained(folder, sparse_prediction=True,
                                                                       **dropouts).train(),
        "transformers": RoFormerForMaskedLM.from_pretrained(folder, attn_implementation="eager", **dropouts).train(),
    }


def check_parity(args: argparse.Namespace, example: Example) -> dict[str, float]:
    """Loss and largest gradient difference of the two models on one batch, dropout off."""
    with tempfile.TemporaryDirectory(prefix="roformer_step_") as folder:
        models = build_models(args, folder, dropout=0.0)
        batch = example()
        losses, grads = {}, {}
        for side, model in models.items():
            loss = model(**batch).loss
            loss.backward()
            losses[side] = loss.item()
            grads[side] = dict(model.named_parameters())
        theirs = grads["transformers"]
        largest = max((p.grad - theirs[name].grad).abs().max().item()
                      for name, p in grads["roformer_hf"].items() if p.grad is not None and name in theirs)
    return {"loss": abs(losses["roformer_hf"] - losses["transformers"]), "grad": largest}


class Step:
    """Trainer's step on one model: batch from the collator, forward, backward, clip to norm 1, AdamW (fused, as
    Trainer's default `adamw_torch_fused`), zero_grad.
    Keeps the seconds of each phase of its last call."""

    def __init__(self, model, example: Example, lr: float, implementation: str = "fused"):
        self.model, self.example = model, example
        flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
        # Trainer's AdamW with weight decay 0.01 on the weights, none on biases and LayerNorm (as Trainer groups them)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                            {"params": rest, "weight_decay": 0.0}], lr=lr,
                                           **flags[implementation])
        self.phases: dict[str, float] = {}

    def __call__(self) -> float:
        marks = [time.perf_counter()]
        batch = self.example()
        marks.append(time.perf_counter())
        loss = self.model(**batch).loss
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        marks.append(time.perf_counter())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        names = ("collator", "forward", "backward", "clipping", "optimizer")
        self.phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(names)}
        return marks[-1] - marks[0]


def gemm_sampler(m: int, k: int, n: int):
    """Seconds per fp32 (m x k) @ (k x n) product through the faster of PyTorch's two GEMMs here, averaged over enough
    products (~0.05 s) to time reliably: `torch.mm` (MKL, what `nn.Linear` and autograd run) or oneDNN's (what
    roformer_hf's training takes where its CPU's rule says so, `fused.DenseRule.onednn_training_macs`; on an AMD Zen 5
    twice MKL's rate)."""
    from roformer_hf import fused

    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    products = [lambda: torch.mm(a, b, out=out)]
    if fused._KERNEL is not None:
        weight = b.t().contiguous()
        products.append(lambda: fused._KERNEL(a, weight, None, "none", [], ""))
    inner = 1

    def timed(product) -> float:
        start = time.perf_counter()
        for _ in range(inner):
            product()
        return (time.perf_counter() - start) / inner

    def sample() -> float:
        return min(timed(product) for product in products)

    while sample() * inner < 0.05:
        inner *= 2
    return sample


def profile_categories(step: Step) -> tuple[float, dict[str, float]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    averages = prof.key_averages()
    total = sum(event.self_cpu_time_total for event in averages)
    shares: dict[str, float] = {}
    for event in averages:
        name = event.key.lower()
        category = next((label for label, fragments in STEP_CATEGORIES if any(f.lower() in name for f in fragments)),
                        "other")
        shares[category] = shares.get(category, 0.0) + event.self_cpu_time_total / total
    return total / 1e6, shares


COMPILED = "roformer_hf, torch.compile"
COMPILE_CALLS = 3  # the first call compiles; a batch with another masked-token count recompiles once, dynamic


def compiled_step(args: argparse.Namespace, folder: str, example: Example, steps: dict) -> float:
    """Adds a step on a torch.compile'd copy of roformer_hf's model to `steps`; returns its first calls' seconds."""
    import roformer_hf

    progress(f"compiling roformer_hf's step (torch.compile, {args.compile_backend})")
    dropouts = {"hidden_dropout_prob": args.dropout, "attention_probs_dropout_prob": args.dropout}
    model = roformer_hf.RoFormerForMaskedLM.from_pretrained(folder, sparse_prediction=True, **dropouts).train()
    steps[COMPILED] = Step(torch.compile(model, backend=args.compile_backend), example, args.lr)
    return sum(steps[COMPILED]() for _ in range(COMPILE_CALLS))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    size = Size(args.layers, args.hidden, args.heads, args.intermediate, args.vocab)
    example = Example(args, args.vocab)
    tokens = args.batch * args.length
    labelled = int((example()["labels"] != -100).sum())
    flops = forward_flops(size, (args.length,) * args.batch)
    step_flops = {"roformer_hf": 3 * sparse_head_forward_flops(flops, tokens, labelled, size),
                  "transformers": 3 * sum(flops.values())}
    print(f"# Training step at hidden {args.hidden}, {args.layers} layers, {args.heads} heads, intermediate "
          f"{args.intermediate}, vocabulary {args.vocab}; {args.batch} x {args.length} tokens ({labelled} masked); "
          f"fp32; dropout {args.dropout:g}; {torch.get_num_threads()} threads\n", flush=True)

    progress("checking loss and gradients (dropout off)")
    parity = check_parity(args, example)
    print(f"  loss diff {parity['loss']:.2e}, largest gradient diff {parity['grad']:.2e}", flush=True)
    if parity["loss"] > 1e-4 or parity["grad"] > 1e-3:
        raise SystemExit("the two models disagree: nothing to compare")

    with tempfile.TemporaryDirectory(prefix="roformer_step_") as folder:
        models = build_models(args, folder, args.dropout)
        steps = {side: Step(model, example, args.lr) for side, model in models.items()}
        steps.update({f"roformer_hf, AdamW {kind}": Step(models["roformer_hf"], example, args.lr, kind)
                      for kind in ("for-loop", "foreach")})
        if args.dropout:  # attention dropout runs BlockedDropoutAttention; without it, SDPA's fused kernel
            import roformer_hf

            no_attention_dropout = roformer_hf.RoFormerForMaskedLM.from_pretrained(
                folder, sparse_prediction=True, hidden_dropout_prob=args.dropout,
                attention_probs_dropout_prob=0.0).train()
            steps["roformer_hf, attention dropout 0"] = Step(no_attention_dropout, example, args.lr)
        compile_seconds = compiled_step(args, folder, example, steps) if args.compile else None
        gemm = gemm_sampler(tokens, args.hidden, args.intermediate)
        progress("timing the steps and the GEMM rate, interleaved")
        phases = {name: [] for name in steps}

        def runner(name):
            def run():
                seconds = steps[name]()
                phases[name].append(steps[name].phases)
                return seconds
            return run

        times = time_interleaved({**{name: runner(name) for name in steps}, "gemm": gemm}, args.warmup, args.repeats)
        gemm_rate = 2 * tokens * args.hidden * args.intermediate / median(times.pop("gemm")) / 1e9

        print(f"\nfp32 GEMM rate, ({tokens} x {args.hidden}) @ ({args.hidden} x {args.intermediate}), the faster of "
              f"MKL's and oneDNN's, sampled between the steps: {gemm_rate:.0f} GFLOP/s\n")
        print(f"| step (median of {args.repeats}, min-max) | seconds | vs transformers | GFLOP/s | "
              "share of GEMM rate |")
        print("|---|---|---|---|---|")
        reference = median(times["transformers"])
        for name, samples in times.items():
            side = "transformers" if name == "transformers" else "roformer_hf"  # its variants too
            rate = step_flops[side] / median(samples) / 1e9
            print(f"| {name} | {spread(samples)} | {reference / median(samples):.2f}x | {rate:.0f} | "
                  f"{rate / gemm_rate:.0%} |")
        if compile_seconds is not None:
            saved = median(times["roformer_hf"]) - median(times[COMPILED])
            payback = f"{compile_seconds / saved:.0f} steps" if saved > 0 else "never (it is not faster)"
            print(f"\n{COMPILED}: its first {COMPILE_CALLS} calls took {compile_seconds:.1f} s (compiling), "
                  f"{saved * 1e3:+.1f} ms a step afterwards against eager; it pays that back after {payback}.")
        print(f"\n(roformer_hf's step counts {step_flops['roformer_hf'] / 1e9:.1f} GFLOP, transformers' "
              f"{step_flops['transformers'] / 1e9:.1f}: its MLM decoder and last layer run on every token.)\n")
        print("Phases of the step (median seconds over the timed repeats):\n")
        names = list(phases[next(iter(phases))][0])
        print("| step | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for name, samples in phases.items():
            samples = samples[args.warmup:]
            print(f"| {name} | " + " | ".join(f"{median(s[phase] for s in samples):.3f}" for phase in names) + " |")

        if not args.skip_profile:
            progress("profiling one step of each")
            print()
            for name in ("roformer_hf", "transformers"):
                total, shares = profile_categories(steps[name])
                print(f"{name}: {total:.3f} s of self CPU time in one profiled step, by part:")
                for category, share in sorted(shares.items(), key=lambda item: -item[1]):
                    print(f"  {share:6.1%}  {category}")
                print()
    print("Machine:\n\n" + "\n".join(machine_lines()))


if __name__ == "__main__":
    main()
