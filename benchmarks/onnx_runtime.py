"""ONNX Runtime as a contender in `bench_cpu.py`: what a user would pick for CPU inference instead of PyTorch.

Both models are exported from fp32 PyTorch with `torch.onnx.export(..., dynamo=True)` (torch.export, then
onnxscript) for the benchmark's padded batch (static shapes), and run by onnxruntime's CPU provider with every graph
optimization on (`ORT_ENABLE_ALL`: constant folding, fused attention/GELU/LayerNorm where its patterns match) and as
many intra-op threads as torch uses. roformer_hf's graph keeps the padded layout (`padding.graph_must_fit_any_mask`),
so it computes the padding, as transformers' does.

Needs the `onnx` extra (onnx, onnxruntime, onnxscript); without it `missing()` says what is absent and the
benchmark skips the section.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import time

import torch

REQUIRED = ("onnx", "onnxruntime", "onnxscript")


def missing() -> str | None:
    """The packages of the section that do not import here, comma-separated; ``None`` when all do."""
    absent = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    return ", ".join(absent) or None


def export(model: torch.nn.Module, batch, path: str) -> float:
    """Writes `model` (fp32, eval) as an ONNX graph for `batch`'s shapes: inputs ``input_ids`` and
    ``attention_mask``, output ``logits``. Returns the seconds the export took. The exporter's progress lines are
    swallowed (they go to stdout)."""
    input_ids, attention_mask, _ = batch
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        torch.onnx.export(model, (input_ids,), path, kwargs={"attention_mask": attention_mask},
                          input_names=["input_ids", "attention_mask"], output_names=["logits"], dynamo=True)
    return time.perf_counter() - start


class OrtModel:
    """An exported graph in an onnxruntime session: all graph optimizations, `threads` intra-op threads."""

    def __init__(self, path: str, threads: int):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        start = time.perf_counter()
        self.session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.load_seconds = time.perf_counter() - start
        self.version = onnxruntime.__version__

    def logits(self, batch) -> torch.Tensor:
        input_ids, attention_mask, _ = batch
        feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
        return torch.from_numpy(self.session.run(["logits"], feeds)[0])

    def timed(self, batch) -> float:
        start = time.perf_counter()
        self.logits(batch)
        return time.perf_counter() - start
