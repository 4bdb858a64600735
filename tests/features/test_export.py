"""Graphs for deployment: torch.export (the route to ONNX and ExecuTorch), torch.jit.trace and the TorchScript ONNX
exporter. Each keeps the padded layout, so one graph serves every attention mask of its shape, and returns exactly
what eager returns, zeros at the padding included."""

import pytest
import torch
from helpers import padded_batch, tiny_config

from roformer_hf import RoFormerForMaskedLM, RoFormerForSequenceClassification, RoFormerForTokenClassification

HEADS = [RoFormerForMaskedLM, RoFormerForSequenceClassification, RoFormerForTokenClassification]


def other_masks(mask):
    return [mask, torch.ones_like(mask), padded_batch([2, 9, 1], left=True)[1]]


@pytest.mark.parametrize("cls", HEADS)
def test_exported_model_matches_eager_for_any_mask(cls):
    torch.manual_seed(0)
    model = cls(tiny_config(num_labels=3)).eval()
    ids, mask = padded_batch([9, 4, 7])
    exported = torch.export.export(model, (ids,), {"attention_mask": mask}).module()
    for other in other_masks(mask):
        with torch.no_grad():
            expected, actual = model(ids, attention_mask=other).logits, exported(ids, attention_mask=other).logits
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", HEADS)
def test_traced_model_matches_eager_for_any_mask(cls):
    torch.manual_seed(0)
    model = cls(tiny_config(num_labels=3, return_dict=False)).eval()  # tuples: what tracing records
    ids, mask = padded_batch([9, 4, 7])
    with torch.no_grad():
        traced = torch.jit.trace(model, (ids, mask))
        for other in other_masks(mask):
            torch.testing.assert_close(traced(ids, other)[0], model(ids, attention_mask=other)[0], atol=1e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("cls", [RoFormerForMaskedLM, RoFormerForSequenceClassification])
def test_onnx_export_runs_in_onnxruntime_for_any_mask(cls, tmp_path):
    """The TorchScript-based exporter (dynamo=False), checked in onnxruntime on differently padded batches."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    torch.manual_seed(0)
    model = cls(tiny_config(num_labels=3)).eval()
    ids, mask = padded_batch([9, 4, 7])
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                      output_names=["logits"], dynamo=False)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for other in other_masks(mask):
        (logits,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": other.numpy()})
        with torch.no_grad():
            expected = model(ids, attention_mask=other).logits
        torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-5, rtol=1e-5)
