"""`make test` on fresh clones, with pytest's time, the CPU-seconds the machine was busy and the slowest tests: the
check that the test suite keeps its goal (pytest under 8 minutes on a 2-core CPU) on the machine at hand.

    python benchmarks/experiments/suite_runs.py                # one run of HEAD, inductor's cache as the machine has it
    python benchmarks/experiments/suite_runs.py --empty-cache  # as on a machine where torch.compile never ran
    python benchmarks/experiments/suite_runs.py --empty-cache --target test-quick  # the tests not marked slow
    python benchmarks/experiments/suite_runs.py --runs 2 --commit main --logs runs/suite_runs

Each run clones the repository into a new folder, builds its `.venv` with `make install` (timed apart), runs `make
test` (or `--target`), and reads pytest's summary line, the machine line the suite prints and its slowest tests. The
busy CPU-seconds (machine-wide, from /proc/stat, Linux only) compare machines better than the wall time where both are
busy throughout: the suite keeps every core working. Run it on a quiet machine: other jobs count in both.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import add_clone_arguments, each_fresh_clone, fresh_clone, machine_lines, short_head  # noqa: E402

GOAL_S = 480.0  # pytest's own time, on a 2-core CPU
SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<seconds>[\d.]+)s\b.*=+$", re.MULTILINE)
SLOW = re.compile(r"^[\d.]+s (?:call|setup|teardown) +\S+$", re.MULTILINE)


def parse_pytest(output: str) -> dict:
    """pytest's counts (passed, failed, skipped, errors), its seconds, the machine line of tests/conftest.py and the
    slowest tests from `--durations`; raises where the output has no summary line."""
    summary = None
    for summary in SUMMARY.finditer(output):
        pass  # the last one: pytest's own, after any the tests printed
    if summary is None:
        raise ValueError("pytest's output has no summary line ('N passed ... in S s'): did it run to the end?")
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    for number, kind in re.findall(r"(\d+) (\w+)", summary["counts"]):
        kind = "errors" if kind == "error" else kind
        if kind in counts:
            counts[kind] = int(number)
    machine = re.search(r"^machine: (.*)$", output, re.MULTILINE)
    return {**counts, "seconds": float(summary["seconds"]), "machine": machine.group(1) if machine else "?",
            "slowest": SLOW.findall(output)}


def busy_cpu_seconds(stat: str = "/proc/stat") -> float | None:
    """The seconds all CPUs have spent busy (user, nice, system, irq, softirq, steal) since boot, or None where the
    system has no /proc/stat."""
    try:
        fields = Path(stat).read_text(encoding="ascii").splitlines()[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def new_machine_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with a new, empty temporary folder (``TMPDIR``) and no ``TORCHINDUCTOR_CACHE_DIR``: inductor's cache,
    its checks of the CPU's vector ISAs and its precompiled headers all start empty, as on a machine where
    torch.compile never ran. The headers live in the temporary folder whatever ``TORCHINDUCTOR_CACHE_DIR`` says
    (torch 2.13: `torch._inductor.codecache._HEADER_DIR`, from `default_cache_dir()`), so that variable alone left
    them built."""
    env = {name: value for name, value in env.items() if name != "TORCHINDUCTOR_CACHE_DIR"}
    return {**env, "TMPDIR": tempfile.mkdtemp(prefix="suite_tmp_")}


def one_run(source: str, commit: str, folder: Path, empty_cache: bool, log: Path | None, target: str = "test") -> dict:
    install = fresh_clone(source, commit, folder)
    env = new_machine_env(dict(os.environ)) if empty_cache else dict(os.environ)
    busy, start = busy_cpu_seconds(), time.perf_counter()
    test = subprocess.run(["make", target], cwd=folder, capture_output=True, text=True, env=env)
    wall, busy_after = time.perf_counter() - start, busy_cpu_seconds()
    if empty_cache:
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    if log is not None:
        log.write_text(test.stdout + test.stderr)
    result = parse_pytest(test.stdout)
    return {**result, "commit": short_head(folder), "install": install, "wall": wall, "exit": test.returncode,
            "cpu": None if busy is None or busy_after is None else busy_after - busy}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_clone_arguments(parser, runs=1, what="output of `make test` (or `--target`)")
    parser.add_argument("--empty-cache", action="store_true",
                        help="run with an empty temporary folder of its own (inductor's cache and precompiled "
                             "headers in it), as on a new machine")
    parser.add_argument("--target", choices=["test", "test-quick"], default="test",
                        help="the Makefile's target: the whole suite, or the tests not marked slow (default: "
                             "%(default)s)")
    args = parser.parse_args(argv)
    print(f"| run | commit | venv build (s) | `make {args.target}` (s) | pytest (s) | busy CPU-s | passed | skipped "
          "| failed | errors | pytest within the goal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    for run, result in each_fresh_clone(args, "suite_run", lambda folder, log: one_run(
            args.source, args.commit, folder, args.empty_cache, log, args.target)):
        results.append(result)
        cpu = "n/a" if result["cpu"] is None else f"{result['cpu']:.0f}"
        within = result["exit"] == 0 and result["seconds"] <= GOAL_S
        print(f"| {run} | {result['commit']} | {result['install']:.0f} | {result['wall']:.0f} | "
              f"{result['seconds']:.1f} | {cpu} | {result['passed']} | {result['skipped']} | {result['failed']} | "
              f"{result['errors']} | {'yes' if within else 'no'} |", flush=True)
    print(f"\nThe goal: `make {args.target}` passes and pytest takes at most {GOAL_S / 60:g} min on a 2-core CPU.")
    print("\nThe last run's slowest tests:\n\n" + "\n".join(f"    {line}" for line in results[-1]["slowest"]))
    print(f"\nMachine (tests/conftest.py): {results[-1]['machine']}\n\n" + "\n".join(machine_lines()))
    if not all(result["exit"] == 0 and result["seconds"] <= GOAL_S for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
