"""`make demo` on fresh clones, one after the other, with each run's time and accuracy in one table: the check that
the demo keeps its promise (at most 10 minutes on a quiet 2-core CPU, test accuracy at least 0.9, the bag-of-words
baseline at chance) on the machine at hand.

    python benchmarks/experiments/demo_runs.py     # five runs of this repository's HEAD (about 5-10 minutes each)
    python benchmarks/experiments/demo_runs.py --runs 1 --commit main --logs runs/demo_runs

Each run clones the repository into a new folder, builds its `.venv` with `make install` (timed apart, as the goal
leaves it out), runs `make demo`, and reads the demo's own result lines. Run it on a quiet machine: other jobs
change the time, and thread timing alone can change the training's float sums.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_clone_arguments, each_fresh_clone, fresh_clone, machine_lines, short_head  # noqa: E402

MINUTES_GOAL, ACCURACY_GOAL, CHANCE_BAND = 10.0, 0.9, 0.6
RESULT_LINES = {
    "perplexity": r"MLM validation perplexity (\d+)",
    "macro_f1": r"macro-F1 ([\d.]+)",
    "accuracy": r"test accuracy: model ([\d.]+)",
    "bag_of_words": r"bag-of-words baseline ([\d.]+)",
    "parts": r"^time: (.*) \| total",
    "minutes": r"^time: .* total ([\d.]+) min",
}


def parse_demo(output: str) -> dict[str, str]:
    """The demo's result lines, by name (`RESULT_LINES`); raises naming a line the output lacks."""
    found = {}
    for name, pattern in RESULT_LINES.items():
        match = re.search(pattern, output, re.MULTILINE)
        if match is None:
            raise ValueError(f"the demo's output has no line matching {pattern!r}: did it finish?")
        found[name] = match.group(1)
    found["parts"] = " / ".join(re.findall(r"([\d.]+) min", found["parts"]))
    return found


def one_run(source: str, commit: str, folder: Path, log: Path | None) -> dict[str, str]:
    install = fresh_clone(source, commit, folder)
    start = time.perf_counter()
    demo = subprocess.run(["make", "demo"], cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if log is not None:
        log.write_text(demo.stdout + demo.stderr)
    if demo.returncode:
        raise SystemExit(f"`make demo` failed in {folder} (exit {demo.returncode}):\n{demo.stderr[-2000:]}")
    return {**parse_demo(demo.stdout), "commit": short_head(folder), "install": f"{install:.0f}",
            "wall": f"{wall / 60:.1f}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_clone_arguments(parser, runs=5, what="demo output")
    args = parser.parse_args(argv)
    print("| run | commit | venv build (s) | `make demo` (min) | the demo's time (min) | pretraining / fine-tuning / "
          "evaluation / rest (min) | MLM perplexity | test accuracy | macro-F1 | bag of words |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    for run, result in each_fresh_clone(args, "demo_run", lambda folder, log: one_run(args.source, args.commit,
                                                                                       folder, log)):
        results.append(result)
        print(f"| {run} | {result['commit']} | {result['install']} | {result['wall']} | {result['minutes']} | "
              f"{result['parts']} | {result['perplexity']} | {result['accuracy']} | {result['macro_f1']} | "
              f"{result['bag_of_words']} |", flush=True)
    within = [float(r["minutes"]) <= MINUTES_GOAL and float(r["accuracy"]) >= ACCURACY_GOAL
              and float(r["bag_of_words"]) <= CHANCE_BAND for r in results]
    print(f"\n{sum(within)} of {len(results)} runs within the goal (at most {MINUTES_GOAL:g} min, test accuracy at "
          f"least {ACCURACY_GOAL}, bag of words at most {CHANCE_BAND})\n")
    print("Machine:\n\n" + "\n".join(machine_lines()))
    if not all(within):
        sys.exit(1)


if __name__ == "__main__":
    main()
