"""The CPU benchmark's own logic (not its timings): which bf16 matrix units a CPU's flags announce, and the ONNX
Runtime section skipped cleanly where onnxruntime is not installed."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import BENCHMARKS, PYTHON, block_imports
from script_runs import ScriptRun, run_scripts

sys.path.insert(0, str(BENCHMARKS))
from common import bf16_matrix_units, machine_lines  # noqa: E402

# The benchmark scripts the tests below run: script, arguments, seconds allowed, and the packages it needs with where
# they come from. One Python process runs those of the tests selected, one after the other (`script_runs`), so that
# torch and transformers are imported once, not once a script.
SCRIPTS = {
    "test_attention_benchmark_reports_both_kernels_in_both_dtypes": ("bench_attention.py", ["--quick"], 300, {}),
    "test_dense_kernel_benchmark_times_every_kernel_and_judges_the_rule": (
        "bench_dense.py", ["--quick", "--rows", "1", "16", "300", "--repeats", "3", "--chain-rows", "16", "300"], 300,
        {}),
    "test_generation_benchmark_reports_throughput_and_step_cost": ("bench_generate.py", ["--quick"], 300, {}),
    "test_mixed_inputs_benchmark_times_each_input_alone_and_in_turn": (
        "bench_mixed.py", ["--quick", "--repeats", "2", "--warmup", "1"], 300, {}),
    "test_gpu_paths_benchmark_runs_every_section_on_cpu": (
        "bench_gpu_paths.py", ["--device", "cpu", "--dtype", "fp32", "--quick", "--repeats", "1", "--warmup", "0"],
        300, {}),
    "test_quantization_benchmark_times_every_path_and_judges_the_targets": (
        "bench_quant.py", ["--quick", "--skip-compile", "--no-torchao", "--repeats", "1", "--warmup", "0"], 600,
        {"onnxruntime": "ONNX Runtime is the `onnx` extra (pip install -e '.[onnx]')"}),
    # the compiled step through `aot_eager`, for the reason the bench_cpu test gives
    "test_train_step_benchmark_compares_equal_models": (
        "bench_train_step.py", ["--quick", "--repeats", "1", "--warmup", "0", "--dropout", "0.1", "--compile",
                                "--compile-backend", "aot_eager"], 600, {}),
    "test_dropout_benchmark_runs_each_setting_through_its_kernel": ("bench_dropout.py", ["--quick"], 300, {}),
    "test_dropout_benchmark_times_the_attention_kernels_alone": (
        "bench_dropout.py", ["--quick", "--attention-only", "--batch", "2"], 300, {}),
    "test_embedding_benchmark_times_every_model_on_every_set": (
        "bench_embeddings.py", ["--quick", "--count", "8", "--single", "2", "--repeats", "1", "--warmup", "0"], 600,
        {}),
    "test_embedding_benchmark_in_bf16_checks_every_model_against_fp32": (
        "bench_embeddings.py", ["--quick", "--dtype", "bf16", "--count", "8", "--single", "2", "--repeats", "1",
                                "--warmup", "0"], 600, {}),
    "test_latency_benchmark_times_every_model_and_the_decoding_step": (
        "bench_latency.py", ["--quick", "--repeats", "2", "--warmup", "0", "--prefixes", "8", "24", "--compile",
                             "--compile-backend", "aot_eager"], 600,
        {"openvino": "OpenVINO is the `bench` extra (pip install -e '.[bench]')"}),
}


@pytest.fixture(scope="module")
def script_results(request, tmp_path_factory) -> dict[str, ScriptRun]:
    """What each script of `SCRIPTS` printed, for the tests of this session that run one and have what it needs."""
    selected = {item.originalname for item in request.session.items}
    runs = {name: (BENCHMARKS / script, args, seconds) for name, (script, args, seconds, needs) in SCRIPTS.items()
            if name in selected and all(importlib.util.find_spec(package) for package in needs)}
    return run_scripts(runs, tmp_path_factory.mktemp("benchmarks"), cwd=BENCHMARKS)


@pytest.fixture
def script_result(request, script_results) -> ScriptRun:
    """What the script of this test (`SCRIPTS`) printed, and its exit code; the test skipped without a package it
    needs."""
    for package, reason in SCRIPTS[request.node.originalname][3].items():
        pytest.importorskip(package, reason=reason)
    return script_results[request.node.originalname]


def test_scripts_in_one_process_run_as_each_would_alone(tmp_path):
    """`run_scripts`: each script gets its own arguments, its folder on the path and its own output (C code's too);
    one that fails or runs past its time fails alone; what a script set for the process is put back for the next."""
    import torch

    (tmp_path / "helper_module.py").write_text("NAME = 'helper'\n")
    (tmp_path / "first.py").write_text(
        "import os, sys, torch, helper_module\n"
        "torch.set_num_threads(1)\nos.environ['SCRIPT_RUNS_MARK'] = '1'\nos.chdir('/')\n"
        "print(helper_module.NAME, sys.argv[1:])\nos.write(1, b'from C\\n')\nprint('warned', file=sys.stderr)\n")
    (tmp_path / "failing.py").write_text("raise SystemExit('no model folder given')\n")
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(30)\n")
    (tmp_path / "last.py").write_text(
        "import os, torch\nprint(torch.get_num_threads(), os.environ.get('SCRIPT_RUNS_MARK'), os.getcwd())\n")
    runs = {name: (tmp_path / f"{name}.py", ["--quick", name], 0.5 if name == "slow" else 60)
            for name in ("first", "failing", "slow", "last")}
    results = run_scripts(runs, tmp_path, cwd=tmp_path)
    assert results["first"] == ScriptRun(0, "helper ['--quick', 'first']\nfrom C\n", "warned\n")
    assert results["failing"].returncode == 1 and "no model folder given" in results["failing"].stderr
    assert results["slow"].returncode == 1 and "ran past its 0.5 s" in results["slow"].stderr
    assert results["last"] == ScriptRun(0, f"{torch.get_num_threads()} None {tmp_path}\n", ""), results["last"]


# Abridged /proc/cpuinfo flags lines of the CPUs these machines have had.
XEON_SAPPHIRE_RAPIDS = "fpu vme sse2 avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 arch_lbr"
EPYC_GENOA = "fpu vme sse2 avx2 avx512f avx512_vnni avx512_bf16 clzero xsaveerptr"
EPYC_ROME = "fpu vme sse2 avx2 fma bmi2 clzero xsaveerptr"


@pytest.mark.parametrize("flags, expected", [
    (XEON_SAPPHIRE_RAPIDS, "amx"),
    (EPYC_GENOA, "avx512_bf16"),
    (EPYC_ROME, "none"),
    ("", "none"),
    ("amx_tile amx_int8", "none"),  # AMX without its bf16 part
    ({"avx512_bf16", "amx_bf16"}, "amx"),  # a set of flags works too
])
def test_bf16_matrix_units_from_cpu_flags(flags, expected):
    assert bf16_matrix_units(flags) == expected


def test_flags_are_whole_words():
    assert bf16_matrix_units("xamx_bf16 avx512_bf16x") == "none"


def test_machine_line_names_the_bf16_units():
    assert "bf16 matrix units: " in machine_lines()[0]


def test_machine_line_says_when_kernels_are_held_below_the_isa(monkeypatch):
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    assert "held below" not in machine_lines()[0]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert machine_lines()[0].endswith("kernels held below the CPU's ISA: ONEDNN_MAX_CPU_ISA=AVX2 (fbgemm is not)")


def test_onnx_section_knows_what_is_missing():
    script = block_imports("onnxruntime") + (
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\nimport onnx_runtime\nprint(onnx_runtime.missing())")
    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["onnxruntime"]


def test_attention_benchmark_reports_both_kernels_in_both_dtypes(script_result):
    """`bench_attention.py --quick` times SDPA, the explicit form and, where it is built, `few_rows.attention` in fp32
    and bf16, and the rotations with SDPA against `few_rows.attention` rotating itself; in fp32 all agree with the
    float64 computation to fp32 rounding, in bf16 all are off by bf16 rounding (so the error column is measured)."""
    from roformer_hf import few_rows

    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): float(line.split("|")[6])
            for line in result.stdout.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))}
    kernels = ["SDPA", "explicit (eager)", "rotations + SDPA"]
    if few_rows.attention_available():
        kernels += ["few_rows.attention", "few_rows.attention, rotation included"]
    assert set(rows) == {(dtype, kernel) for dtype in ("fp32", "bf16") for kernel in kernels}
    assert all(rows["fp32", kernel] < 1e-5 for kernel in kernels)
    assert all(1e-4 < rows["bf16", kernel] < 5e-2 for kernel in kernels)


def test_mixed_inputs_benchmark_times_each_input_alone_and_in_turn(script_result):
    """`bench_mixed.py --quick`: one model runs a sentence and a batch of 32 short sentences each alone and in turn,
    at every precision this CPU computes natively in floating point, with the same outputs either way."""
    import torch

    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith(("| fp32 |", "| bf16 |"))]
    precisions = ["fp32", *(["bf16"] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])]
    assert [row[:2] for row in rows] == [[precision, name] for precision in precisions for name in
                                         ("1 sentence of 16 tokens", "32 short sentences (8-32 tokens)")]
    for row in rows:
        alone, in_turn, ratio = float(row[2].split()[0]), float(row[3].split()[0]), float(row[4].rstrip("x"))
        assert alone > 0 and in_turn > 0 and ratio == pytest.approx(in_turn / alone, rel=0.1)
        assert row[5] == "yes"


def test_dense_kernel_benchmark_times_every_kernel_and_judges_the_rule(script_result):
    """`bench_dense.py --quick`: MKL, oneDNN, oneDNN on the packed weight and, where they are built, `few_rows`' fp32
    and bf16 GEMMs, on each dense layer of an encoder layer
    at each row count, the packed weight giving the bits of the unpacked one wherever the rule packs, and the rule's
    choice against the fastest of the three; then the dense calls in a row through each path (OpenVINO's where it is
    installed, with the kernels it chose)."""
    from roformer_hf import few_rows, fused

    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if re.match(r"\| (fp32|bf16) \| \d+ \| [A-Za-z]", line)]  # a layer's name: not the chain's rows
    dtypes = ["fp32", "bf16"] if fused._BF16_GEMMS else ["fp32"]
    layers = ["q/k/v", "attention output", "FFN up", "FFN down"]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (dtype, count, layer) for dtype in dtypes for count in ("1", "16", "300") for layer in layers]
    for dtype, count, _, mkl, onednn, packed, few, same_bits, chosen, ratio in rows:
        times = {"MKL": float(mkl), "oneDNN": float(onednn), "oneDNN packed": float(packed)}
        few_rows_here = few_rows.available() if dtype == "fp32" else few_rows.bf16_available()
        if few_rows_here:
            times["few rows"] = float(few)
        else:
            assert few == "–" and chosen != "few rows"
        assert all(time > 0 for time in times.values())
        assert float(ratio.removesuffix("x")) == pytest.approx(times[chosen] / min(times.values()), rel=0.05, abs=0.01)
        assert same_bits == "yes" or (dtype == "fp32" and count == "1")  # one fp32 row: sums in another order
        mkl = fused.RULE.one_row if count == "1" else fused.RULE.beyond
        assert chosen != "MKL" or (dtype == "fp32" and mkl == "module"
                                   and (count == "1" or int(count) > fused.RULE.packed_max_rows
                                        or "few rows" in times and int(count) > fused.RULE.few_rows_max_rows))
        limit = fused.RULE.few_rows_max_rows if dtype == "fp32" else fused.RULE.bf16_few_rows_max_rows
        assert (chosen == "few rows") == ("few rows" in times and int(count) <= limit)
    assert re.search(r"The rule's choice at most [0-9.]+x the fastest", result.stdout)
    # the dense calls in a row: each path at each precision and row count, and roformer_hf's time over OpenVINO's
    has_openvino = importlib.util.find_spec("openvino") is not None
    chain = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
             if re.match(r"\| (fp32|bf16|int8) \| (16|300) \| [0-9.]+ \|", line)]
    precisions = ["fp32", *(["bf16"] if fused._BF16_GEMMS else []), "int8"]
    assert [(row[0], row[1]) for row in chain] == [(precision, rows) for precision in precisions
                                                   for rows in ("16", "300")]
    # the tables of each path's calls in a row, one after the other: fp32 under each rule, bf16 and int8 by kernel
    tables = {title: [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
                      if re.match(r"\| (16|300) \| ([0-9.]+ \(|–)", line)]
              for title, text in re.findall(r"\nThe (fp32|bf16|int8) calls in a row (.*?)(?=\nThe |\Z)", result.stdout,
                                            re.DOTALL)}
    assert list(tables) == ["fp32", *(["bf16"] if fused._BF16_GEMMS and few_rows.bf16_available() else []), "int8"]
    assert all([row[0] for row in table] == ["16", "300"] for table in tables.values())
    for row in tables["fp32"]:
        # each rule, those with few rows without them, and where the kernel is built this CPU's with it at every count
        assert len(row) - 1 == (len(fused.RULES) + sum(1 for rule in fused.RULES if rule.few_rows_max_rows)
                                + few_rows.available())
        assert_times_over_the_fastest(row[1:])
    for row in tables.get("bf16", []):  # oneDNN on the packed weight, `few_rows`' bf16 kernel
        assert len(row) - 1 == 2
        assert_times_over_the_fastest(row[1:])
    for row in tables["int8"]:
        assert len(row) - 1 == 3 and (row[3] == "–") == (not few_rows.int8_available())
        assert_times_over_the_fastest([cell for cell in row[1:] if cell != "–"])
    for precision, _, ours, plain, openvino, ratio, kernels in chain:
        assert float(ours) > 0 and (float(plain) > 0 if precision == "fp32" else plain == "–")
        if has_openvino and (precision != "int8" or importlib.util.find_spec("nncf")):
            assert float(ratio.removesuffix("x")) == pytest.approx(float(ours) / float(openvino), rel=0.05, abs=0.01)
            assert re.fullmatch(r"\w+ x\d+(, \w+ x\d+)*", kernels)
        else:
            assert openvino == ratio == "–" and "not installed" in kernels

def assert_times_over_the_fastest(cells: list[str]) -> None:
    """Cells "time (ratio x)": every time positive, each ratio its time over the smallest, the smallest's 1.00."""
    times = [float(cell.split()[0]) for cell in cells]
    assert all(time > 0 for time in times)
    ratios = [float(cell.split()[1].strip("()x")) for cell in cells]
    # each ratio printed to 0.01 from times printed to 0.001 ms: both roundings bound the difference
    for ratio, time in zip(ratios, times):
        tolerance = 0.0051 + time / min(times) * (0.0005 / time + 0.0005 / min(times))
        assert ratio == pytest.approx(time / min(times), abs=tolerance)
    assert min(ratios) == 1.0


def test_cpu_benchmark_times_each_dtype_only_with_kernels_that_compute_it():
    """`bench_cpu.gemm_kernels`: MKL's GEMM for every dtype, oneDNN's where it computes the dtype on this CPU (bf16
    only with AVX-512 bf16 or AMX: elsewhere oneDNN cannot create the product, and `--dtype bf16` stopped there); each
    kernel named runs a product of its dtype."""
    import torch
    from bench_cpu import GEMM_KERNELS, Gemm, gemm_kernels

    from roformer_hf import fused

    for dtype in (torch.float32, torch.bfloat16):
        kernels = gemm_kernels(dtype)
        assert kernels[0] == "torch.mm" and set(kernels) <= set(GEMM_KERNELS)
        assert ("oneDNN" in kernels) == (fused._KERNEL is not None and dtype in fused._KERNEL_DTYPES)
        for kernel in kernels:
            gemm = Gemm(8, 16, 32, dtype=dtype, kernel=kernel)
            assert gemm.sample() > 0 and gemm.a.dtype == dtype


def test_quick_benchmark_times_the_compiled_model_and_skips_a_missing_onnxruntime():
    """The quick benchmark with `--compile` where onnxruntime cannot be imported: it times the compiled model and
    reports its compilation, and its report says why the ONNX Runtime section is missing. The backend is AOTAutograd
    without code generation (`aot_eager`): inductor's code is what tests/features/test_compile.py checks, and it would
    cost this smoke test a minute of C++ compilation on a fresh machine."""
    script = block_imports("onnxruntime") + (
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "sys.argv = ['bench_cpu.py', '--quick', '--compile', '--compile-backend', 'aot_eager', '--skip-train', "
        "'--skip-memory', '--repeats', '1', '--warmup', '0']\n"
        "import bench_cpu\nbench_cpu.main()\n")
    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "roformer_hf through torch.compile (aot_eager), first call with compilation: inference " in result.stdout
    assert "inference forward, fp32" in result.stdout
    assert "### ONNX Runtime" in result.stdout
    assert "Skipped: not installed: onnxruntime" in result.stdout
    assert "speed-up bound" in result.stdout  # what transformers' time in this run allowed at 100% of the GEMM rate


def test_generation_benchmark_reports_throughput_and_step_cost(script_result):
    """`bench_generate.py --quick`: both models generate on the same weights; the report has their tokens per second,
    the ratio, and the step cost at each prefix length; with oneDNN's int8 kernel, roformer_hf in int8 too, with how
    many of its tokens are fp32's."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| transformers |", "| roformer_hf |"))]
    assert len(rows) == 2 and all(float(row.split("|")[3]) > 0 for row in rows)
    assert "roformer_hf / transformers tokens per second:" in result.stdout
    assert [line.split("|")[1].strip() for line in result.stdout.splitlines()
            if line.startswith(("| 8 |", "| 32 |"))] == ["8", "32"]
    from roformer_hf.quantization import int8_kernel_available

    if int8_kernel_available():
        assert any(line.startswith("| roformer_hf int8 |") for line in result.stdout.splitlines())
        agreement = re.search(r"int8 / fp32 tokens per second: \*\*[0-9.]+x\*\*; its new tokens equal fp32's at "
                              r"([0-9.]+)% of positions", result.stdout)
        assert agreement and 0 <= float(agreement.group(1)) <= 100


def test_quantization_benchmark_times_every_path_and_judges_the_targets(script_result):
    """`bench_quant.py --quick`: roformer_hf's int8 paths and ONNX Runtime's fp32 and int8 graphs of transformers'
    RoFormer, timed in one run, each with its accuracy against transformers' fp32 logits and its set-up cost."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("| ")}
    paths = ("roformer_hf fp32 eager", "roformer_hf int8 (quantize_int8)", "roformer_hf + torch.ao quantize_dynamic",
             "ONNX Runtime fp32 (transformers' graph)", "ONNX Runtime int8 quantize_dynamic (transformers' graph)")
    for path in paths:
        agreement, cosine = float(rows[path][3]), float(rows[path][4])
        assert 0.8 < agreement <= 1 and 0.99 < cosine <= 1.0000001, (path, rows[path])
    assert float(rows["roformer_hf fp32 eager"][3]) == 1.0  # the same model as the reference, to fp32 rounding
    assert "export" in rows["ONNX Runtime int8 quantize_dynamic (transformers' graph)"][5]
    assert rows["roformer_hf int8 (quantize_int8)"][5].startswith("quantize ")
    assert any(key.startswith("int8 forward ≥ 2x faster than ONNX Runtime's int8") for key in rows)
    assert "int8 matrix units: " in result.stdout


def test_train_step_benchmark_compares_equal_models(script_result):
    """`bench_train_step.py --quick`: both libraries' steps on the same weights (loss and gradients checked equal
    first), every variant timed (with dropout, so the variant without attention dropout runs too), and the step's
    parts profiled; the compiled step through `aot_eager`."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    loss_diff, grad_diff = map(float, re.search(r"loss diff (\S+), largest gradient diff (\S+)", out).groups())
    assert loss_diff < 1e-4 and grad_diff < 1e-3
    for step in ("roformer_hf", "transformers", "roformer_hf, AdamW for-loop", "roformer_hf, AdamW foreach",
                 "roformer_hf, attention dropout 0", "roformer_hf, torch.compile"):
        assert re.search(rf"^\| {re.escape(step)} \| \d", out, re.MULTILINE), step
    assert re.search(r"torch.compile: its first 3 calls took [\d.]+ s .* pays that back after (\d+ steps|never)", out)
    assert "GEMM (linear layers, decoder)" in out and "optimizer (AdamW)" in out


def test_dropout_benchmark_runs_each_setting_through_its_kernel(script_result):
    """`bench_dropout.py --quick` (512 tokens, up to two blocks): each setting's step went through the attention
    kernel it names, read off the loss's autograd graph: roformer_hf's dropout through `DropoutAttention`, the
    reference through SDPA's math kernel, no attention dropout through SDPA's fused kernel."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = {cells[1]: cells[2] for line in result.stdout.splitlines() if line.startswith("| ")
               for cells in [[cell.strip() for cell in line.split("|")]]}
    assert kernels["dropout 0"] == kernels["hidden dropout 0.1, attention dropout 0"] == "SDPA fused kernel"
    assert kernels["dropout 0.1"] == "DropoutAttention"
    assert kernels["dropout 0.1, SDPA's math kernel"] == "SDPA math kernel"


def test_dropout_benchmark_times_the_attention_kernels_alone(script_result):
    """`--attention-only`: the fused kernel without dropout, then roformer_hf's kernel for the length and SDPA's math
    kernel with dropout, each against the first."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(2, 4, 512, 16) (batch, heads, tokens, head dim)" in result.stdout
    rows = re.findall(r"^\| (.+?) \| [\d.]+ ms \([\d.]+-[\d.]+\) \| ([\d.]+)x \|$", result.stdout, re.MULTILINE)
    assert [name for name, _ in rows] == ["SDPA fused kernel, dropout 0", "DropoutAttention, every weight at once, "
                                          "dropout 0.1", "SDPA math kernel, dropout 0.1"]
    assert float(rows[0][1]) == 1.0


def test_demo_runs_reads_the_demos_result_lines(monkeypatch):
    """`experiments/demo_runs.py` reads each run's figures from the demo's own result lines (the time line as
    `demo.time_split` writes it), and names a line a run's output lacks."""
    monkeypatch.syspath_prepend(str(BENCHMARKS / "experiments"))
    from demo import time_split
    from demo_runs import parse_demo

    output = ("MLM validation perplexity 212 with 30% of the tokens masked (...); 400 pretraining steps\n"
              "passage as written, or the words within each line shuffled? (test plays: a, b): macro-F1 0.975; 305 "
              "fine-tuning steps\n"
              "test accuracy: model 0.97 | bag-of-words baseline 0.51 | majority baseline 0.49\n"
              "time: " + time_split(240.0, 126.0, 72.0, 36.0) + "\n")
    assert parse_demo(output) == {"perplexity": "212", "macro_f1": "0.975", "accuracy": "0.97", "bag_of_words": "0.51",
                                  "parts": "2.1 / 1.2 / 0.6 / 0.1", "minutes": "4.0"}
    with pytest.raises(ValueError, match="test accuracy: model"):
        parse_demo(output.replace("test accuracy", "accuracy"))


def test_suite_runs_reads_pytests_summary_and_the_busy_cpu(tmp_path, monkeypatch):
    """`experiments/suite_runs.py` reads pytest's last summary line (a failed run's too), the machine line and the
    slowest tests, names a missing summary, counts busy CPU time from /proc/stat's first line, and gives
    `--empty-cache` runs a temporary folder of their own; it and `demo_runs.py` run each clone in a new folder, removed
    after."""
    monkeypatch.syspath_prepend(str(BENCHMARKS / "experiments"))
    from suite_runs import busy_cpu_seconds, new_machine_env, parse_pytest

    output = ("machine: AMD EPYC, 2 cores, avx2; torch kernels AVX2; inductor cache empty at the start\n"
              "===== 3 passed in 0.10s =====\n"  # printed by a test of its own
              "============================= slowest 10 durations =============================\n"
              "28.52s call     tests/features/test_serving_faults.py::test_a_killed_replica_loses_no_request[proxy]\n"
              "26.81s setup    tests/features/test_serving_cluster.py::test_one_replica_per_node_both_answering\n"
              "===== 1 failed, 1138 passed, 91 skipped, 99 warnings, 3 errors in 313.50s (0:05:13) =====\n")
    parsed = parse_pytest(output)
    assert (parsed["passed"], parsed["failed"], parsed["skipped"], parsed["errors"], parsed["seconds"]) == \
        (1138, 1, 91, 3, 313.5)
    assert parsed["machine"].startswith("AMD EPYC, 2 cores") and len(parsed["slowest"]) == 2
    assert parsed["slowest"][1].endswith("test_one_replica_per_node_both_answering")
    with pytest.raises(ValueError, match="no summary line"):
        parse_pytest(output.replace(" in ", " after "))
    stat = tmp_path / "stat"
    stat.write_text("cpu  1000 20 300 9000 50 7 3 10 0 0\ncpu0 500 10 150 4500 25 3 2 5 0 0\n", encoding="ascii")
    ticks = os.sysconf("SC_CLK_TCK")
    assert busy_cpu_seconds(str(stat)) == pytest.approx((1000 + 20 + 300 + 7 + 3 + 10) / ticks)
    assert busy_cpu_seconds(str(tmp_path / "absent")) is None

    # --empty-cache: inductor's cache folder and the one its precompiled headers go to are in a new temporary folder
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the new folder inside this test's
    env = new_machine_env({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "warm"), "PATH": "/bin"})
    assert set(env) == {"PATH", "TMPDIR"} and not any(Path(env["TMPDIR"]).iterdir())
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", env["TMPDIR"])  # what `tempfile.gettempdir()` gives under that TMPDIR
    assert Path(cache_dir()).parent == Path(default_cache_dir()).parent == Path(env["TMPDIR"])

    from common import add_clone_arguments, each_fresh_clone  # each run in a folder of its own, removed after

    parser = argparse.ArgumentParser()
    add_clone_arguments(parser, runs=1, what="output")
    args = parser.parse_args(["--runs", "2", "--logs", str(tmp_path / "logs")])
    folders = []
    for number, (folder, log) in each_fresh_clone(args, "x_run", lambda folder, log: (folder, log)):
        assert folder.parent.is_dir() and not folder.exists() and log == tmp_path / "logs" / f"x_run{number}.log"
        folders.append(folder.parent)
    assert len(set(folders)) == 2 and not any(folder.exists() for folder in folders)
    assert (tmp_path / "logs").is_dir() and args.source == str(BENCHMARKS.parent) and args.commit == "HEAD"


def test_embedding_benchmark_times_every_model_on_every_set(script_result):
    """`bench_embeddings.py --quick`: transformers' RoFormer, roformer_hf (fp32 and int8) and ModernBERT timed on
    short, ~128-token and mixed sentences at batch 32 and 1; roformer_hf's embeddings checked against transformers';
    the short batches' bound from the dense calls alone beside the ratio measured."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if re.match(r"\| (short|~128|mixed) \|", line)]
    assert [(row[0].strip(), row[1].strip()) for row in rows] == [
        (name, batch) for name in ("short", "~128", "mixed") for batch in ("32", "1")]
    for row in rows:
        assert all(float(cell) > 0 for cell in row[3:7])  # sentences per second of the four models
    cosines = re.findall(r"roformer_hf fp32 vs transformers ([0-9.]+); int8 vs transformers fp32 ([0-9.]+)",
                         result.stdout)
    assert len(cosines) == 3 and all(float(fp32) >= 0.99999 and float(int8) > 0.99 for fp32, int8 in cosines)
    bound, measured = map(float, re.search(r"roformer_hf / transformers is at most ([0-9.]+)x .*measured ([0-9.]+)x",
                                           result.stdout).groups())
    assert bound > 0 and measured > 0  # one repeat on a busy CPU: the forward may not outlast the dense calls alone
    # the operator table: PyTorch's operators by time (roformer_hf's own kernels, ctypes calls, are not among them;
    # where they take every dense layer and the attention, the layer norms and the embedding remain)
    assert "Self CPU time total" in result.stdout and re.search(r"^\s*aten::\w+", result.stdout, re.MULTILINE)


def test_embedding_benchmark_in_bf16_checks_every_model_against_fp32(script_result):
    """`bench_embeddings.py --dtype bf16`: every model cast to bf16 and timed on every set, no int8 column; the bf16
    embeddings of roformer_hf and of transformers' RoFormer each checked against transformers' fp32 ones; the short
    batches judged against the bf16 goal (1.5x, on CPUs with AMX)."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    assert "## Sentence embeddings on CPU, bf16" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("| set | batch |"))
    assert "int8" not in header and "transformers RoFormer | roformer_hf | ModernBERT (sdpa)" in header
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if re.match(r"\| (short|~128|mixed) \|", line)]
    assert len(rows) == 6 and all(float(cell) > 0 for row in rows for cell in row[3:6])
    cosines = re.findall(r"roformer_hf bf16 ([0-9.]+), transformers' RoFormer bf16 ([0-9.]+)", result.stdout)
    assert len(cosines) == 3 and all(0.999 <= float(value) <= 1.0 for pair in cosines for value in pair)
    assert re.search(r"is at most [0-9.]+x \(the goal, 1\.5x on CPUs with AMX", result.stdout)
    assert "(bf16, 3 forwards)" in result.stdout


def test_latency_benchmark_times_every_model_and_the_decoding_step(script_result):
    """`bench_latency.py --quick --compile`: roformer_hf, transformers' RoFormer and OpenVINO (transformers' model
    converted) on one sentence, 32 short sentences and the padded batch at each precision the CPU runs natively,
    and roformer_hf compiled for latency on the sentence at each precision (int8: torchao's static quantization;
    with `aot_eager`: inductor's cold compile would double the test's time; the recipes of docs/export.md and
    docs/quantization.md, run by the docs test, compile with inductor), their last hidden states checked against
    transformers' fp32 ones first; the one sentence against the weights' read time; then roformer_hf's
    decoding step at each prompt length."""
    result = script_result
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines
            if re.match(r"\| (fp32|bf16|int8) \| (1 sentence|32 short|6 x 64\.\.16)", line)]
    precisions = list(dict.fromkeys(row[0] for row in rows))
    assert precisions[0] == "fp32" and precisions[-1] == "int8" and set(precisions) <= {"fp32", "bf16", "int8"}
    assert [row[1].split()[0] for row in rows] == ["1", "32", "6"] * len(precisions)
    for row in rows:
        compiled = row[6] != "–"  # roformer_hf compiled: the sentence only, at every precision
        assert compiled == row[1].startswith("1 sentence")
        # ms per call: roformer_hf, transformers (none in int8), OpenVINO (none in int8 without nncf)
        ours, reference, openvino = (cell.split()[0] for cell in row[3:6])
        assert float(ours) > 0 and (reference == "–") == (row[0] == "int8")
        if openvino != "–":
            assert float(row[7].split("x")[0]) == pytest.approx(float(ours) / float(openvino), rel=0.05, abs=0.01)  # of rounded ms
        agreements = [cell.split(",") for cell in row[10].split(";") if cell.strip() != "–"]
        assert len(agreements) == (openvino != "–") + 1 + compiled
        for difference, cosine in agreements:
            assert float(difference) <= 1e-4 if row[0] == "fp32" else float(cosine) >= 0.99
    floors = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines
              if re.match(r"\| (fp32|bf16|int8) \| [0-9.]+ \| [0-9.]+ \|", line)]
    assert [row[0] for row in floors] == precisions
    for _, megabytes, bandwidth, floor, ours, ratio, gflop, rate, arithmetic, over in floors:
        assert float(megabytes) > 0 and float(ours) > 0 and float(ratio.split("x")[0]) > 0
        if float(floor) >= 0.1:  # the quick model's weights (0.1 MB) take microseconds: rounded away
            assert float(floor) == pytest.approx(float(megabytes) / float(bandwidth), rel=0.05)
            assert float(ratio.split("x")[0]) == pytest.approx(float(ours) / float(floor), rel=0.05)
        # the quick model (2 layers, hidden 64, intermediate 256) on 16 tokens, 2 FLOPs a multiply-add: per layer
        # 16 * (4 * 64^2 + 2 * 64 * 256) in its dense layers, 2 * 16^2 * 64 in attention (scores, weighted values)
        layer = 16 * (4 * 64 ** 2 + 2 * 64 * 256) + 2 * 16 ** 2 * 64
        assert float(gflop) == pytest.approx(2 * 2 * layer / 1e9, rel=0.01)
        assert float(arithmetic) == pytest.approx(1e3 * float(gflop) / float(rate), rel=0.05)
        assert float(over.split("x")[0]) == pytest.approx(float(ours) / float(arithmetic), rel=0.05)
    assert any(re.match(r"- openvino \d", line) for line in lines)
    assert [line.split("|")[1].strip() for line in lines if re.match(r"\| (8|24) \| \d", line)] == ["8", "24"]


def test_serving_benchmark_gives_ray_each_ingress_environment(monkeypatch):
    """`bench_serving.ray_environment`, what Ray's processes get for each `--ingress` (the one run per ingress, only
    direct ingress's, is in the slow test below): this checkout on their path and `--ray-env`'s settings; HAProxy with
    free ports for its pages, the replicas' own HTTP ports, or the command's own environment; a PYTHONPATH already set
    stays after the checkout's (packages installed there, as on a machine where the wheels were unpacked into a
    folder)."""
    pytest.importorskip("ray.serve", reason="the serving benchmark needs Ray Serve: pip install roformer_hf[serve]")
    import bench_serving

    from roformer_hf.cli import choose_ingress
    from roformer_hf.serving import direct_ingress_env, haproxy_binary
    from roformer_hf.serving.ingress import HAPROXY_PORTS, command_env

    args = argparse.Namespace(ray_env=["RAY_SERVE_SOME_SETTING=a=b"], replicas=2)
    site = "/opt/unpacked-site-packages"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site, str(BENCHMARKS), ""]))
    inherited = [site]  # the checkout's folders once, first; empty entries dropped
    draining = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
    for ingress in bench_serving.INGRESS:
        if ingress == "haproxy" and haproxy_binary() is None:
            with pytest.raises(ValueError, match="HAProxy does not run here"):
                bench_serving.ray_environment(args, ingress, 20000)
            continue
        env = bench_serving.ray_environment(args, ingress, 20000)
        assert all(isinstance(name, str) and isinstance(value, str) for name, value in env.items()), env
        assert env["RAY_SERVE_SOME_SETTING"] == "a=b"
        assert env["PYTHONPATH"].split(os.pathsep) == [str(BENCHMARKS.parent), str(BENCHMARKS), *inherited]
        assert (env.get(draining) == "0") == (ingress != "proxy"), (ingress, env)
        own = {name: value for name, value in env.items()
               if name not in ("RAY_SERVE_SOME_SETTING", "PYTHONPATH", draining)}
        if ingress == "haproxy":
            assert own.pop("RAY_SERVE_ENABLE_HA_PROXY") == "1"
            assert set(own) == {name for name in HAPROXY_PORTS if name not in os.environ}, own
            assert all(1024 <= int(port) < 65536 for port in own.values()) and len(set(own.values())) == len(own)
        elif ingress == "direct":
            assert own == direct_ingress_env(20000, 2)
        elif ingress == "default":
            expected = command_env(choose_ingress("auto", None)[0])
            ports = [name for name in HAPROXY_PORTS if name in expected]  # free ports: found anew at each call
            assert {n: v for n, v in own.items() if n not in ports} == {
                n: v for n, v in expected.items() if n not in ports}
            assert set(ports) == {name for name in HAPROXY_PORTS if name in own}
        else:
            assert own == {}, own


@pytest.mark.slow
def test_serving_benchmark_checks_answers_and_reports_every_measure():
    """`bench_serving.py --quick`: Ray Serve's answers under concurrency equal `encode` and `generate` alone, and the
    report has the engine floor, the throughputs and the latencies, each against its reference, and where the
    replica's time went by its answers' timing headers."""
    pytest.importorskip("ray.serve", reason="the serving benchmark needs Ray Serve: pip install roformer_hf[serve]")
    pytest.importorskip("sentence_transformers", reason="the serving benchmark compares with sentence-transformers")
    # 90-108 s within a full run on a 2-core Xeon, 202 s there when it ran twice as slowly (2026-11-28).
    result = subprocess.run([PYTHON, str(BENCHMARKS / "bench_serving.py"), "--quick", "--max-seconds", "360",
                             "--ingress", "direct", "--replicas", "1",  # the proxy's: tests/features/test_serving.py
                             # as `helpers.ray_environment` sets them
                             "--ray-env", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=30",
                             "--ray-env", "RAY_worker_niceness=0"],
                            capture_output=True, text=True, timeout=540, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"lowest cosine [0-9.]+, largest difference \S+ \(yes at", result.stdout), result.stdout
    assert "identical to `generate` alone: 4/4 (yes)" in result.stdout
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| measure")}
    assert len(rows) == 10, rows  # the FastAPI floor, then nine rows with direct ingress
    assert all("direct ingress" in measure for measure in list(rows)[1:]), rows
    for measure, cells in rows.items():
        assert float(cells[0].split(" / ")[0]) > 0 and cells[4].endswith("%"), (measure, cells)
        if cells[3] != "-":
            assert float(cells[3].rstrip("x")) > 0
        # the replica's own times, from the headers of the folder's answers; none from the engine's no-op
        times = re.fullmatch(r"tokenization ([0-9.]+) / queue ([0-9.]+) / inference ([0-9.]+) / total ([0-9.]+) ms, "
                             r"batch ([0-9.]+)", cells[5])
        assert (times is None) == measure.startswith("engine floor"), (measure, cells)
        if times:
            tokenization, queue, inference, total, batch = map(float, times.groups())
            assert max(tokenization, queue, inference) <= total, (measure, cells)
            # a request's inputs run in one batch: requests of 32 (and one of 16, the last of --quick's 48) batch many
            assert batch >= (16 if "requests of 32 short" in measure else 1), (measure, cells)
    bound = re.search(r"latency from one client, direct ingress: p50 ([0-9.]+) ms against the bound ([0-9.]+) "
                      r"\(the no-op from one client\) \+ 5 \+ ([0-9.]+) \(offline encode, batch 1\) = ([0-9.]+) ms",
                      result.stdout)
    assert bound, result.stdout
    assert float(bound.group(4)) == pytest.approx(float(bound.group(2)) + 5 + float(bound.group(3)), abs=0.15)


@pytest.mark.slow
def test_predict_benchmark_times_eager_and_compiled_classifiers_that_agree():
    """`bench_predict.py --quick`: a served cross-encoder's one sentence and one pair, eager and compiled, in fp32 and
    int8, the fp32 scores within the script's bound of the eager ones (it stops otherwise), and a start after the
    first loading the package."""
    pytest.importorskip("ray.serve", reason="the benchmark serves with roformer_hf.serving: pip install "
                                            "roformer_hf[serve]")
    pytest.importorskip("torchao", reason="its int8 classifier is quantized statically with torchao")
    result = subprocess.run([PYTHON, str(BENCHMARKS / "bench_predict.py"), "--quick", "--sentences", "4"],
                            capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("| fp32") or line.startswith("| int8")]
    assert [row[:2] for row in rows] == [[precision, request] for precision in ("fp32", "int8")
                                         for request in ("/predict of one sentence", "/rerank of one pair")]
    for row in rows:
        eager, compiled = (float(cell.split()[0]) for cell in row[2:4])
        # the ratio of the unrounded medians, the cells rounded to 0.01 ms
        assert eager > 0 and compiled > 0 and float(row[4].rstrip("x")) == pytest.approx(compiled / eager, abs=0.03)
        assert float(row[5]) <= (1e-4 if row[0] == "fp32" else 0.5)
    assert re.search(r"- fp32: start with compile [0-9.]+ s into an empty cache, [0-9.]+ s from it", result.stdout)


@pytest.mark.slow
def test_compiled_benchmark_times_the_served_package_against_eager_at_each_length():
    """`bench_compiled.py --quick`: the package a server with `--compile` builds, timed against the eager model at each
    length (their outputs within the script's bound, or it stops), and the run of lengths where it paid beside the
    lengths this CPU kind's rule sends to it."""
    from roformer_hf import fused

    result = subprocess.run([PYTHON, str(BENCHMARKS / "bench_compiled.py"), "--quick", "--one-lengths", "8", "40",
                             "--repeats", "2"], capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if re.match(r"\| \d", line)]
    assert [row[0] for row in rows] == ["8", "40"]
    ratios = {}
    for row in rows:
        eager, compiled = float(row[1]), float(row[2])
        assert eager > 0 and compiled > 0 and float(row[3].rstrip("x")) == pytest.approx(compiled / eager, abs=0.03)
        assert float(row[4]) <= 1e-4
        assert row[5] == ("compiled" if int(row[0]) <= fused.RULE.compiled_max_tokens else "eager")
        ratios[int(row[0])] = float(row[3].rstrip("x"))
    found = re.search(r"compiled faster from the shortest up to: (\w+) tokens; the (.+) rule sends", result.stdout)
    assert found and found.group(2) == fused.RULE.cpu, result.stdout
    # the run of lengths where compiled took less time (the cells rounded to 0.01: a ratio of 1.00x goes either way)
    paid, unpaid = {"none": ((), (8,)), "8": ((8,), (40,)), "40": ((8, 40), ())}[found.group(1)]
    assert all(ratios[length] <= 1 for length in paid) and all(ratios[length] >= 1 for length in unpaid), ratios


def test_gpu_paths_benchmark_runs_every_section_on_cpu(script_result):
    """`bench_gpu_paths.py --device cpu --dtype fp32 --quick` (its smoke run; the figures are for a GPU): every section
    prints its table; in fp32 the packed row's loss is transformers' padded one, and greedy generation gives
    transformers' tokens."""
    result = script_result
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAIL" not in result.stdout
    for title in ("Packed rows against padded batches", "One long sequence", "Generation:",
                  "The encoder forward of an embeddings request", "training step, operators by device time"):
        assert title in result.stdout, title
    packing = [line.split("|")[1:-1] for line in result.stdout.splitlines()
               if line.startswith(("| mixed lengths", "| short lines"))]
    assert len(packing) == 2 and all(float(row[-1]) <= 1e-4 for row in packing)
    assert "100.0% of the generated tokens are transformers'" in result.stdout
