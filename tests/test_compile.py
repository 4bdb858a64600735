"""torch.compile: compiled training with batch shapes that change from step to step gives the eager losses; with
`unpad_inputs=False` the whole model compiles as one graph (fullgraph=True)."""

from __future__ import annotations

import pytest
import torch
from helpers import padded_batch, tiny_config

from roformer_hf import RoFormerForMaskedLM

BATCHES = [[9, 4, 7], [5, 3], [12, 11, 2, 6], [7, 7, 1]]


def losses(model, step) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    values = []
    for seed, lengths in enumerate(BATCHES):
        loss = step(lengths, seed)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        values.append(loss.item())
    return values


def padded_step(model):
    def step(lengths, seed):
        ids, mask = padded_batch(lengths, seed=seed)
        return model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    return step


def packed_step(model):
    def step(lengths, seed):
        ids, mask = padded_batch(lengths, seed=seed)
        row = ids[mask.bool()][None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        return model(row, position_ids=positions, labels=row).loss
    return step


@pytest.mark.parametrize("make_step, overrides, fullgraph", [
    (padded_step, {"sparse_prediction": True}, False),
    (packed_step, {}, False),
    (padded_step, {"unpad_inputs": False}, True),  # one graph: nothing depends on the mask's values
], ids=["padded", "packed", "padded-layout-fullgraph"])
def test_compiled_training_with_varying_shapes_gives_the_eager_losses(make_step, overrides, fullgraph):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = RoFormerForMaskedLM(tiny_config(**overrides)).train()
    compiled = RoFormerForMaskedLM(tiny_config(**overrides)).train()
    compiled.load_state_dict(eager.state_dict())
    expected = losses(eager, make_step(eager))
    actual = losses(compiled, make_step(torch.compile(compiled, fullgraph=fullgraph)))
    assert actual == pytest.approx(expected, abs=1e-5)
