"""Does the demo's fine-tuning take off every time? Its word-order fine-tuning, alone, from one pretrained folder,
under perturbations that change nothing but float rounding, with the validation accuracy curve of each run.

    python benchmarks/experiments/finetune_stability.py --pretrained runs/demo/mlm            # five perturbed runs
    python benchmarks/experiments/finetune_stability.py --pretrained runs/demo/mlm --cls_learning_rate 2e-4 --cls_epochs 2
    python benchmarks/experiments/finetune_stability.py --pretrain --mlm_steps 250            # pretrain a folder first

Two runs of `make demo` with the same seed can end far apart (test accuracy 0.96 in one, 0.64 in another) because
thread timing changes the order of float sums. Each run here is `run_classification.main` with the demo's own
arguments (`demo.fine_tuning_arguments`; demo flags such as --cls_learning_rate pass through), in its own process,
perturbed in one way:

- `threads=N`: torch's thread count (1 and 2 sum in different orders);
- `noise=E`: every pretrained weight multiplied by (1 + E * N(0, 1)), E = 1e-6 by default, drawn with its own seed.

Prints each run's validation accuracy at every evaluation, the kept (best) one and its test accuracy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, workload.py
from workload import REPO_ROOT  # noqa: E402

EXAMPLES = REPO_ROOT / "examples"
PERTURBATIONS = ("threads=2", "threads=1", "noise=1e-6:1", "noise=1e-6:2", "noise=1e-6:3")

ONE_RUN = """
import json, sys
sys.path.insert(0, {examples!r})
import torch
import demo, run_classification
pretrained, output_dir, perturbation, demo_argv = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
kind, _, value = perturbation.partition("=")
torch.set_num_threads(int(value) if kind == "threads" else 2)
if kind == "noise":
    scale, _, seed = value.partition(":")
    load = run_classification.load_pretrained_with_fresh_head

    def load_perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        generator = torch.Generator().manual_seed(int(seed or 0))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if not name.startswith("classifier"):  # the fresh head keeps its seeded initialisation
                    parameter.mul_(1 + float(scale) * torch.randn(parameter.shape, generator=generator))
        return model

    run_classification.load_pretrained_with_fresh_head = load_perturbed
args = demo.build_parser().parse_args(demo_argv)
result = run_classification.main(demo.fine_tuning_arguments(output_dir, pretrained, args) + ["--disable_tqdm", "true"])
state = result["trainer"].state
print("RESULT " + json.dumps({{
    "validation": [[entry["step"], entry["eval_accuracy"]] for entry in state.log_history if "eval_accuracy" in entry],
    "kept_step": state.best_global_step, "test": result["metrics"]["test_accuracy"]}}))
"""


def run(pretrained: str, output_dir: Path, perturbation: str, demo_argv: list[str]) -> dict:
    code = ONE_RUN.format(examples=str(EXAMPLES))
    done = subprocess.run([sys.executable, "-c", code, pretrained, str(output_dir), perturbation,
                           json.dumps(demo_argv)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{perturbation}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrained", help="a pretrained MLM folder (the demo writes OUTPUT_DIR/mlm)")
    parser.add_argument("--pretrain", action="store_true", help="pretrain one first, as the demo does")
    parser.add_argument("--output_dir", default="runs/finetune_stability")
    parser.add_argument("--perturbations", default=",".join(PERTURBATIONS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    args, demo_argv = parser.parse_known_args(argv)
    sys.path.insert(0, str(EXAMPLES))
    import demo

    demo.build_parser().parse_args(demo_argv)  # refuses flags the demo does not know
    output_dir = Path(args.output_dir)
    pretrained = args.pretrained
    if args.pretrain:
        import run_mlm

        pretrained = str(output_dir / "mlm")
        run_mlm.main(demo.pretraining_arguments(Path(pretrained), demo.build_parser().parse_args(demo_argv)))
    if not pretrained:
        raise SystemExit("give --pretrained FOLDER or --pretrain")

    perturbations = args.perturbations.split(",")
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda p: run(pretrained, output_dir / p.replace("=", "_").replace(":", "_"), p,
                                              demo_argv), perturbations))
    print(f"\nFine-tuning of {pretrained} with the demo's arguments {' '.join(demo_argv) or '(defaults)'}:\n")
    print("| perturbation | validation accuracy at each evaluation (step: accuracy) | kept step | test accuracy |")
    print("|---|---|---|---|")
    for perturbation, result in zip(perturbations, results):
        curve = ", ".join(f"{step}: {accuracy:.3f}" for step, accuracy in result["validation"])
        print(f"| {perturbation} | {curve} | {result['kept_step']} | {result['test']:.3f} |")
    tests = [result["test"] for result in results]
    print(f"\ntest accuracy: lowest {min(tests):.3f}, highest {max(tests):.3f} over {len(tests)} runs")


if __name__ == "__main__":
    main()
