"""Shared set-up: the modules of tests/support/ importable from every folder of tests (`from helpers import ...`),
the examples' modules importable (`import run_mlm`, `from lib import shakespeare`, ...), as they are for the scripts
themselves, a local Hugging Face Hub server for push/load tests without a network, and a stand-in for the flash-attn
kernel.

`make test` runs the tests on pytest-xdist workers (`-n auto`: one more than the cores, as a test waiting on Ray's
replicas leaves its core idle): each test module stays on one worker (its module fixtures are built once), the long
tests go first (those that start a Ray, each on a Ray of its own, and those that compile with inductor), each worker
takes one unit of work at a time, and each worker's torch takes its share of the cores."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import pytest  # noqa: E402
from helpers import EXAMPLES, STAND_IN, stand_in_calls, varlen_stand_in  # noqa: E402
from hub_server import HubServer  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

from roformer_hf import kernels  # noqa: E402

sys.path.insert(0, str(EXAMPLES))


@pytest.fixture
def local_hub(tmp_path_factory):
    """A running `HubServer` (stopped at teardown), for tests that inspect what was pushed."""
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture
def hub_server(local_hub):
    """The endpoint URL of a running local Hub, to pass as `HF_ENDPOINT` to client processes."""
    return local_hub.url


@pytest.fixture
def stand_in_flash(monkeypatch):
    """The flash-attn code path with `helpers.varlen_stand_in` as its kernel; returns the list of its calls."""
    AttentionInterface.register(STAND_IN, varlen_stand_in)
    monkeypatch.setattr(kernels, "is_flash_attention_requested",  # where the forward chooses its kernel, once
                        lambda requested_attention_implementation: requested_attention_implementation == STAND_IN)
    stand_in_calls.clear()
    return stand_in_calls


def starts_ray(nodeid: str) -> bool:
    """Tests that start a local Ray (and Ray Serve on it): a module `test_serving*.py`, or a test `test_serving*`."""
    module, _, name = nodeid.partition("::")
    return Path(module).name.startswith("test_serving") or name.startswith("test_serving")


# Modules of long tests that share no module fixture, each test a unit of work of its own: each test of
# test_serving_faults.py starts a Ray with the settings it tests; each of test_compile.py compiles for a minute or more
# (as one unit, the four ran on one worker for two minutes after the others had finished).
ALONE = {"test_serving_faults.py", "test_compile.py"}


def rank(nodeid: str) -> int:
    """When a test starts under pytest-xdist: the tests that start a Ray first, then the compile tests, each taking a
    worker that a Ray test left, then the others (the short ones left for the end keep every worker busy to the
    last)."""
    if starts_ray(nodeid):
        return 0
    return 1 if Path(nodeid.partition("::")[0]).name in ALONE else 2


def work_unit(nodeid: str) -> str:
    """What one worker runs together: a test module (its module fixtures are built once), or a test alone where it
    is long and shares no module fixture (in `ALONE`, or a Ray test in a module of other tests), so that two long
    tests of one module can run on two workers at once."""
    module, _, name = nodeid.partition("::")
    alone = Path(module).name in ALONE or (name.startswith("test_serving") and not starts_ray(module))
    return nodeid if alone else module


def machine() -> str:
    """The machine the suite runs on, to read its timings by: the CPU, its cores, the widest vector ISA it has and
    the one torch's kernels use (`ATEN_CPU_CAPABILITY` can hold them lower), and whether inductor's cache already
    held compiled code (the compile tests cost about two minutes more when it is empty)."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    info = Path("/proc/cpuinfo").read_text(encoding="utf-8") if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), ()))
    isa = [flag for flag in ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if flag in flags]
    cache = Path(cache_dir())
    warm = cache.is_dir() and any(cache.iterdir())
    return (f"{name}, {len(os.sched_getaffinity(0))} cores, {' '.join(isa) or 'no AVX2'}; torch kernels "
            f"{torch.backends.cpu.get_cpu_capability()}; inductor cache {'warm' if warm else 'empty'} at the start")


MACHINE = machine() if "PYTEST_XDIST_WORKER" not in os.environ else None  # read before any test compiles


def pytest_report_header(config):
    return f"machine: {MACHINE}"


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"machine: {MACHINE}")


# Ray 2.60 turns token authentication on for a local Ray, writing ~/.ray/auth_token at its first start: a worker that
# had imported Ray before another wrote the file once failed to start its own ("Failed to start GCS ... InvalidAuthToken
# ... RAY_AUTH_MODE is currently 'disabled'"). The tests' Rays listen on 127.0.0.1 only, and run without tokens.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Compiled encoders the tests make are kept in a folder of the run's own, not in the user's cache (the Rays the tests
# start inherit it).
os.environ["ROFORMER_HF_CACHE"] = tempfile.mkdtemp(prefix="roformer_hf_cache_")
atexit.register(shutil.rmtree, os.environ["ROFORMER_HF_CACHE"], ignore_errors=True)

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:  # one of several workers: its share of the cores, for torch and the subprocesses it starts
    import torch

    _threads = max(1, len(os.sched_getaffinity(0)) // WORKERS)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the tests in the order of `rank`."""
    if WORKERS > 1:
        items.sort(key=lambda item: rank(item.nodeid))  # stable: the tests of one rank keep their order


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hooks: used only where it is installed
def pytest_xdist_auto_num_workers(config):
    return len(os.sched_getaffinity(0)) + 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's `loadscope`, by `work_unit` and in collection order, a worker taking its next unit only when it
    has one test left to run (`loadscope` sends more at three, so that one worker took three long tests in a row
    while the others ran short ones). A worker runs a test once it holds the next one (pytest tears down by the next
    item), so each worker holds its running test and one more. (Its `loadgroup` with `xdist_group` marks would not
    do: pytest-xdist 3.8 tags `item._nodeid`, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _reschedule(self, node) -> None:
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) >= 2:
                return
            super()._reschedule(node)

    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)
