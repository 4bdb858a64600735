"""Packed rows (several sequences back to back, no padding: transformers' DataCollatorWithFlattening): every
sequence gives what it gives alone, on every attention path available on CPU; bad boundaries fail clearly."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import STAND_IN, tiny_config

import roformer_hf
from roformer_hf import RoFormerForMaskedLM, RoFormerForTokenClassification, RoFormerModel

LENGTHS = (5, 3, 9, 1, 4)


def packed_row(lengths=LENGTHS, seed=0):
    """Random sequences, each alone `(1, n)`, and packed into one row with restarting positions and offsets."""
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(1, 97, (1, n), generator=gen) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return sequences, torch.cat(sequences, dim=1), positions, offsets


def per_token_outputs(model, field):
    """A function giving `field` of `model` for `input_ids` and inputs, as `(tokens, ...)`."""
    def run(input_ids, **inputs):
        with torch.no_grad():
            return getattr(model(input_ids, **inputs), field)[0]
    return run


HEADS = [(RoFormerForMaskedLM, "logits"), (RoFormerForTokenClassification, "logits"),
         (roformer_hf.RoFormerForQuestionAnswering, "start_logits"),
         (roformer_hf.RoFormerForQuestionAnswering, "end_logits"),
         (RoFormerModel, "last_hidden_state")]


@pytest.mark.parametrize("hidden", [32, 64], ids=["heads of 8", "heads of 16"])  # 16: few_rows.attention's, on CPU
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("head, field", HEADS, ids=lambda x: getattr(x, "__name__", x))
def test_each_packed_sequence_equals_the_sequence_alone(head, field, boundaries, unpad, attn, hidden):
    torch.manual_seed(0)
    model = head(tiny_config(num_labels=3, unpad_inputs=unpad, attn_implementation=attn, hidden_size=hidden,
                             initializer_range=0.2)).eval()  # wide weights: crossing a boundary shows
    run = per_token_outputs(model, field)
    sequences, ids, positions, offsets = packed_row()
    kwargs = {"position_ids": positions}
    if boundaries == "cu_seq_lens":
        kwargs.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=9, max_length_k=9)
    packed = run(ids, **kwargs)
    alone = torch.cat([run(sequence) for sequence in sequences])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    unpacked = run(ids)  # the same row read as one sequence attends across the boundaries
    assert (unpacked - alone).abs().max() > 1e-3


def test_boundaries_alone_are_enough_and_positions_are_the_given_ones():
    """cu_seq_lens without position_ids: positions run on through the row, which changes no score inside a sequence
    (rotary attention depends on relative positions only)."""
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config()).eval()
    sequences, ids, _, offsets = packed_row()
    with torch.no_grad():
        packed = model(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets).logits[0]
        alone = torch.cat([model(sequence).logits[0] for sequence in sequences])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_positions_that_never_restart_are_one_sequence():
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config()).eval()
    ids = torch.randint(1, 97, (2, 12))
    with torch.no_grad():
        shifted = model(ids, position_ids=torch.arange(12)[None] + 1000).last_hidden_state
        plain = model(ids).last_hidden_state
    torch.testing.assert_close(shifted, plain, atol=1e-5, rtol=0)


def test_positions_that_skip_without_a_mask_mark_boundaries_and_the_mask_reads_them_as_positions():
    """What the `position_ids` docs warn about: without an attention mask, positions that do not step by 1 (doubled,
    say) start a new sequence at every token, so each token attends alone; with the mask they are positions only
    (and rotary attention sees their differences: shifting them all changes nothing)."""
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config()).eval()
    ids = torch.randint(1, 97, (2, 12))
    doubled = 2 * torch.arange(12).expand(2, 12)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        unmasked = model(ids, position_ids=doubled).last_hidden_state
        alone = model(ids.reshape(-1, 1)).last_hidden_state.reshape(2, 12, -1)  # every token a sequence of one
        masked = model(ids, attention_mask=ones, position_ids=doubled).last_hidden_state
        shifted = model(ids, attention_mask=ones, position_ids=doubled + 7).last_hidden_state
    torch.testing.assert_close(unmasked, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(masked, shifted, atol=1e-5, rtol=0)
    assert (masked - alone).abs().max() > 1e-2  # (small initial weights: attention mixes gently)


def test_sparse_prediction_and_loss_on_packed_rows():
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config(sparse_prediction=True))
    sequences, ids, positions, _ = packed_row()
    labels = ids.masked_fill(torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.5, -100)
    model.train()  # sparse prediction runs in training only; dropout is 0 in tiny_config
    packed = model(ids, position_ids=positions, labels=labels)
    model.eval()
    with torch.no_grad():
        alone = torch.cat([model(sequence).logits[0] for sequence in sequences])
    labelled = labels[0] != -100
    torch.testing.assert_close(packed.logits.detach(), alone[labelled], atol=1e-5, rtol=0)
    expected = torch.nn.functional.cross_entropy(alone[labelled], labels[0][labelled])
    torch.testing.assert_close(packed.loss.detach(), expected, atol=1e-5, rtol=0)


def test_hidden_states_and_attentions_of_packed_rows():
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config()).eval()
    sequences, ids, positions, _ = packed_row()
    out = model(ids, position_ids=positions, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    start = 0
    for sequence in sequences:
        alone = model(sequence, output_hidden_states=True, output_attentions=True)
        end = start + sequence.shape[1]
        for packed_state, state in zip(out.hidden_states, alone.hidden_states):
            torch.testing.assert_close(packed_state[0, start:end], state[0], atol=1e-5, rtol=0)
        for packed_weights, weights in zip(out.attentions, alone.attentions):
            torch.testing.assert_close(packed_weights[0, :, start:end, start:end], weights[0], atol=1e-5, rtol=0)
            outside = torch.cat([packed_weights[0, :, start:end, :start], packed_weights[0, :, start:end, end:]], -1)
            assert (outside == 0).all()  # block-diagonal
        start = end
    out.hidden_states[1].sum().backward()  # the states returned are the ones the model used
    assert model.embeddings.word_embeddings.weight.grad is not None


@pytest.mark.parametrize("with_offsets", [True, False])
@pytest.mark.parametrize("head, field", HEADS, ids=lambda x: getattr(x, "__name__", x))
def test_flash_varlen_kernel_reads_packed_rows(stand_in_flash, head, field, with_offsets):
    torch.manual_seed(0)
    model = head(tiny_config(num_labels=3)).eval()
    run = per_token_outputs(model, field)
    sequences, ids, positions, offsets = packed_row()
    alone = torch.cat([run(sequence) for sequence in sequences])
    model.set_attn_implementation(STAND_IN)
    stand_in_flash.clear()
    kwargs = {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets} if with_offsets else {}
    packed = run(ids, position_ids=positions, **kwargs)
    assert stand_in_flash == ["varlen"] * 2
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_several_packed_rows():
    """Two rows, each packed: boundaries at every row start, from position ids and from offsets alike."""
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config()).eval()
    first, ids_a, pos_a, _ = packed_row((4, 6), seed=1)
    second, ids_b, pos_b, _ = packed_row((7, 3), seed=2)
    ids, positions = torch.cat([ids_a, ids_b]), torch.cat([pos_a, pos_b])
    offsets = torch.tensor([0, 4, 10, 17, 20], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([model(s).logits[0] for s in first + second])
        for kwargs in ({"position_ids": positions}, {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets}):
            torch.testing.assert_close(model(ids, **kwargs).logits.flatten(0, 1), alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("offsets, message", [
    ([0, 5, 8, 20], "from 0 to the number of tokens, 22"),
    ([0, 5, 5, 22], "strictly increasing"),
    ([1, 5, 22], "from 0 to the number of tokens"),
])
def test_bad_offsets_are_refused(offsets, message):
    model = RoFormerModel(tiny_config()).eval()
    _, ids, _, _ = packed_row()
    offsets = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        model(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)


def test_offsets_that_cross_rows_or_disagree_or_meet_a_mask_are_refused():
    model = RoFormerModel(tiny_config()).eval()
    ids = torch.randint(1, 97, (2, 6))
    with pytest.raises(ValueError, match="crosses from one row to the next"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 4, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_k .* differ"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 6, 12]), cu_seq_lens_k=torch.tensor([0, 3, 12]))
    with pytest.raises(ValueError, match="attention_mask or cu_seq_lens"):
        model(ids, attention_mask=torch.ones_like(ids), cu_seq_lens_q=torch.tensor([0, 6, 12]))


@pytest.mark.parametrize("head", [roformer_hf.RoFormerForSequenceClassification, roformer_hf.RoFormerForMultipleChoice])
def test_sequence_level_heads_refuse_packed_rows(head):
    model = head(tiny_config(num_labels=2)).eval()
    _, ids, positions, offsets = packed_row()
    if head is roformer_hf.RoFormerForMultipleChoice:
        ids, positions = ids[None], positions[None]
    with pytest.raises(ValueError, match="one output per row.*DataCollatorWithPadding"):
        model(ids, position_ids=positions)


def test_qa_loss_refuses_packed_rows():
    model = roformer_hf.RoFormerForQuestionAnswering(tiny_config()).eval()
    _, ids, positions, _ = packed_row()
    with pytest.raises(ValueError, match="start_positions/end_positions"):
        model(ids, position_ids=positions, start_positions=torch.tensor([1]), end_positions=torch.tensor([2]))


def test_trainer_with_flattening_collator_gives_the_padded_losses(tmp_path):
    """Token classification trained by Trainer with DataCollatorWithFlattening (one packed row per batch) and with
    padding: the same logged losses, step by step."""
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in (7, 3, 11, 5, 9, 4, 8, 6):
        labels = torch.randint(0, 3, (n,), generator=gen).tolist()
        labels[0] = -100  # the flattening collator's separator: no label on each example's first token
        examples.append({"input_ids": torch.randint(1, 97, (n,), generator=gen).tolist(), "labels": labels})

    def losses(collator) -> list[float]:
        torch.manual_seed(0)
        model = RoFormerForTokenClassification(tiny_config(num_labels=3))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
            logging_steps=1, report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=examples, data_collator=collator)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    class PadTokens:
        def __call__(self, features):
            length = max(len(f["input_ids"]) for f in features)
            pad = [length - len(f["input_ids"]) for f in features]
            return {
                "input_ids": torch.tensor([f["input_ids"] + [0] * p for f, p in zip(features, pad)]),
                "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * p for f, p in zip(features, pad)]),
                "labels": torch.tensor([f["labels"] + [-100] * p for f, p in zip(features, pad)]),
            }

    packed = losses(transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    padded = losses(PadTokens())
    assert len(packed) == 4
    assert packed == pytest.approx(padded, abs=1e-5)
