"""Several Python scripts run one after the other in one process, each as `python SCRIPT ARGS...` would run it: its
own `sys.argv`, its folder first on `sys.path`, its output (Python's and C code's) in files of its own, and its exit
code; so that torch and transformers are imported once for all of them, not once a script.

Between scripts, what a script may set for the whole process is put back: torch's threads, dynamo's compiled code and
settings, inductor's settings, the environment, the working folder. A script that raises, exits with an error or runs
past its time limit fails alone; the next one still runs.

`run_scripts(runs, folder, cwd)` from a test (it starts the process and waits); `python script_runs.py SPEC` in the
process itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ScriptRun:
    """What one script printed and how it exited, as `subprocess.run(..., capture_output=True, text=True)` gives."""
    returncode: int
    stdout: str
    stderr: str


def run_scripts(runs: dict[str, tuple[Path, list[str], float]], folder: Path, cwd: Path) -> dict[str, ScriptRun]:
    """Runs each `name: (script, args, seconds allowed)` of `runs` in one new Python process started in `cwd`, in
    order; its output goes to files in `folder`. Returns each name's `ScriptRun`."""
    spec = [{"name": name, "script": str(script), "args": list(args), "seconds": seconds,
             "out": str(folder / f"{name}.out"), "err": str(folder / f"{name}.err"),
             "code": str(folder / f"{name}.code")} for name, (script, args, seconds) in runs.items()]
    (folder / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    process = subprocess.run([sys.executable, __file__, str(folder / "spec.json")], cwd=cwd, capture_output=True,
                             text=True, timeout=sum(run["seconds"] for run in spec) + 120)
    results = {}
    for run in spec:
        code = Path(run["code"])
        if not code.exists():  # the process itself ended before this script did
            results[run["name"]] = ScriptRun(-1, "", f"the scripts' process exited with {process.returncode} before "
                                                     f"{run['script']} ended:\n{process.stderr[-3000:]}")
            continue
        results[run["name"]] = ScriptRun(int(code.read_text(encoding="utf-8")),
                                         Path(run["out"]).read_text(encoding="utf-8"),
                                         Path(run["err"]).read_text(encoding="utf-8"))
    return results


class TimeLimit(Exception):
    pass


def _run_one(script: str, args: list[str], seconds: float, out: str, err: str) -> int:
    import runpy
    import signal
    import traceback

    import torch
    import torch._dynamo
    import torch._inductor.config

    saved = (sys.argv, list(sys.path), dict(os.environ), os.getcwd(), torch.get_num_threads(),
             torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy())
    sys.argv, sys.path[:0] = [script, *args], [str(Path(script).parent)]
    sys.stdout.flush()
    sys.stderr.flush()
    streams = [os.dup(1), os.dup(2)]
    with open(out, "w", encoding="utf-8") as out_file, open(err, "w", encoding="utf-8") as err_file:
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)

        def stop(signum, frame):
            raise TimeLimit(f"{script} ran past its {seconds:g} s")

        signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, (int, type(None))):
                print(exit_.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 (a time limit too): the script failed, the next one runs
            traceback.print_exc()
            code = 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(streams[0], 1)
            os.dup2(streams[1], 2)
    for stream in streams:
        os.close(stream)
    sys.argv, sys.path[:] = saved[0], saved[1]
    os.environ.clear()
    os.environ.update(saved[2])
    os.chdir(saved[3])
    torch.set_num_threads(saved[4])
    torch._dynamo.reset()
    torch._dynamo.config.load_config(saved[5])
    torch._inductor.config.load_config(saved[6])
    return code


def main(spec_path: str) -> None:
    for run in json.loads(Path(spec_path).read_text(encoding="utf-8")):
        code = _run_one(run["script"], run["args"], run["seconds"], run["out"], run["err"])
        Path(run["code"]).write_text(str(code), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
