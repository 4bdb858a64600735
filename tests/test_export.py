"""torch.export (the route to ONNX and ExecuTorch): one graph that serves every attention mask of its shape."""

import pytest
import torch
from helpers import padded_batch, tiny_config

from roformer_hf import RoFormerForMaskedLM, RoFormerForSequenceClassification


@pytest.mark.parametrize("cls", [RoFormerForMaskedLM, RoFormerForSequenceClassification])
def test_exported_model_matches_eager_for_any_mask(cls):
    torch.manual_seed(0)
    model = cls(tiny_config(num_labels=3)).eval()
    ids, mask = padded_batch([9, 4, 7])
    exported = torch.export.export(model, (ids,), {"attention_mask": mask}).module()
    other_masks = [mask, torch.ones_like(mask), padded_batch([2, 9, 1], left=True)[1]]
    for other in other_masks:
        with torch.no_grad():
            expected, actual = model(ids, attention_mask=other).logits, exported(ids, attention_mask=other).logits
        if cls is RoFormerForMaskedLM:  # token outputs: compare at the real tokens
            expected, actual = expected[other.bool()], actual[other.bool()]
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
