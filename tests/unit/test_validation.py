"""Bad input fails early with a ValueError naming the argument, what it got and what was expected."""

import pytest
import torch
from helpers import tiny_config

from roformer_hf import (
    RoFormerForMaskedLM,
    RoFormerForMultipleChoice,
    RoFormerForQuestionAnswering,
    RoFormerForSequenceClassification,
    RoFormerForTokenClassification,
    RoFormerModel,
)

IDS = torch.tensor([[2, 5, 7, 3], [2, 9, 3, 0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return RoFormerModel(tiny_config()).eval()


@pytest.mark.parametrize("kwargs, pattern", [
    ({"input_ids": torch.tensor([[2, 97]])}, r"input_ids contains 97; expected values in \[0, 97\)"),
    ({"input_ids": torch.tensor([[-1, 3]])}, r"input_ids contains -1"),
    ({"input_ids": IDS.float()}, r"input_ids has dtype torch.float32; expected an integer"),
    ({"input_ids": torch.tensor([2, 5, 7])}, r"input_ids has shape \(3,\); expected \(batch_size, seq_len\)"),
    ({"input_ids": IDS, "attention_mask": MASK[:, :3]}, r"attention_mask has shape \(2, 3\); expected \(2, 4\)"),
    ({"input_ids": IDS, "token_type_ids": torch.zeros(2, 5, dtype=torch.long)}, r"token_type_ids has shape"),
    ({"input_ids": IDS, "token_type_ids": torch.full((2, 4), 2)},
     r"token_type_ids contains 2; expected values in \[0, 2\)"),
    ({"input_ids": IDS, "position_ids": torch.arange(5)}, r"position_ids has shape \(5,\)"),
    ({"input_ids": IDS, "position_ids": torch.tensor([0, 1, -2, 3])}, r"position_ids contains -2"),
    ({"input_ids": IDS, "inputs_embeds": torch.zeros(2, 4, 32)},
     r"exactly one of input_ids or inputs_embeds \(got both\)"),
    ({}, r"\(got neither\)"),
    ({"inputs_embeds": torch.zeros(2, 4, 31)},
     r"inputs_embeds has shape \(2, 4, 31\); expected \(batch_size, seq_len, 32\)"),
])
def test_encoder_inputs(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        model(**kwargs)


def test_valid_position_id_shapes_are_accepted(model):
    with torch.no_grad():
        a = model(IDS, attention_mask=MASK).last_hidden_state
        b = model(IDS, attention_mask=MASK, position_ids=torch.arange(4)).last_hidden_state
        c = model(IDS, attention_mask=MASK, position_ids=torch.arange(4)[None]).last_hidden_state
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("cls, labels, pattern", [
    (RoFormerForMaskedLM, torch.tensor([[-100, 4, 97, -100], [-100] * 4]),
     r"labels contains 97; expected values in \[0, 97\) or -100"),
    (RoFormerForMaskedLM, torch.tensor([[-100, 4, -5, -100], [-100] * 4]), r"labels contains -5"),
    (RoFormerForSequenceClassification, torch.tensor([0, 3]), r"labels contains 3; expected values in \[0, 3\)"),
    (RoFormerForTokenClassification, torch.tensor([[0, 1, 2, 3], [0, 0, 0, -100]]), r"labels contains 3"),
])
def test_labels_out_of_range(cls, labels, pattern):
    model = cls(tiny_config(num_labels=3))
    with pytest.raises(ValueError, match=pattern):
        model(IDS, attention_mask=MASK, labels=labels)


def test_multiple_choice_labels_and_shape():
    model = RoFormerForMultipleChoice(tiny_config())
    with pytest.raises(ValueError, match="num_choices"):
        model(IDS)
    with pytest.raises(ValueError, match=r"labels contains 2; expected values in \[0, 2\)"):
        model(IDS[None], attention_mask=MASK[None], labels=torch.tensor([2]))


@pytest.mark.parametrize("cls", [RoFormerForMaskedLM, RoFormerForTokenClassification])
@pytest.mark.parametrize("labels, pattern", [
    (torch.zeros(2, 5, dtype=torch.long), r"labels has shape \(2, 5\); expected \(2, 4\)"),
    (torch.zeros(8, dtype=torch.long), r"labels has shape \(8,\); expected \(2, 4\)"),
    (torch.zeros(2, 4), r"labels has dtype torch.float32; expected an integer"),
])
def test_token_labels_must_have_the_inputs_shape(cls, labels, pattern):
    """Packing would otherwise read wrong-shaped labels at the input's token positions and return a loss."""
    with pytest.raises(ValueError, match=pattern):
        cls(tiny_config(num_labels=3))(IDS, attention_mask=MASK, labels=labels)


@pytest.mark.parametrize("config, labels, pattern", [
    ({"num_labels": 3}, torch.zeros(2, 3, dtype=torch.long), r"labels has shape \(2, 3\); expected \(2,\)"),
    ({"num_labels": 3}, torch.zeros(2, 2), r"labels has shape \(2, 2\); expected \(2, 3\)"),  # multi-label
    ({"num_labels": 1}, torch.zeros(2, 2), r"labels has shape \(2, 2\); expected \(2,\): a target per"),
    ({"num_labels": 2, "problem_type": "regression"}, torch.zeros(4, 1),
     r"labels has shape \(4, 1\); expected \(2, 2\)"),
    ({"num_labels": 3, "problem_type": "single_label_classification"}, torch.tensor([0.0, 1.0]), "dtype"),
])
def test_sequence_labels_must_fit_the_problem_type(config, labels, pattern):
    with pytest.raises(ValueError, match=pattern):
        RoFormerForSequenceClassification(tiny_config(**config))(IDS, attention_mask=MASK, labels=labels)


def test_sequence_and_choice_labels_that_transformers_accepts():
    """Integer regression targets (any value) and -100 for an ignored example, with the losses of their formulas."""
    torch.manual_seed(0)
    regression = RoFormerForSequenceClassification(tiny_config(num_labels=1)).eval()
    targets = torch.tensor([0, 5])
    out = regression(IDS, attention_mask=MASK, labels=targets)
    torch.testing.assert_close(out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), targets.float()))

    classifier = RoFormerForSequenceClassification(tiny_config(num_labels=3)).eval()
    out = classifier(IDS, attention_mask=MASK, labels=torch.tensor([2, -100]))
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits[:1], torch.tensor([2])))

    choices = RoFormerForMultipleChoice(tiny_config()).eval()
    out = choices(IDS[None].expand(2, 2, 4), attention_mask=MASK[None].expand(2, 2, 4), labels=torch.tensor([-100, 1]))
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits[1:], torch.tensor([1])))


def test_question_answering_positions():
    torch.manual_seed(0)
    model = RoFormerForQuestionAnswering(tiny_config()).eval()
    inside = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"end_positions\[1\] = 3 points at padding"):
        model(IDS, attention_mask=MASK, start_positions=inside, end_positions=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match=r"start_positions\[0\] = -1; expected positions >= 0"):
        model(IDS, attention_mask=MASK, start_positions=torch.tensor([-1, 0]), end_positions=inside)
    with pytest.raises(ValueError, match=r"start_positions has shape \(3,\); expected \(2,\)"):
        model(IDS, attention_mask=MASK, start_positions=torch.tensor([0, 1, 2]), end_positions=inside)
    # As in transformers, a position past the sequence drops that example from the loss.
    out = model(IDS, attention_mask=MASK, start_positions=torch.tensor([1, 4]), end_positions=torch.tensor([2, 4]))
    expected = (torch.nn.functional.cross_entropy(out.start_logits[:1], torch.tensor([1]))
                + torch.nn.functional.cross_entropy(out.end_logits[:1], torch.tensor([2]))) / 2
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("ids", [IDS[:, :0], IDS[:0]])
def test_empty_inputs_are_refused(model, ids):
    with pytest.raises(ValueError, match="expected at least one sequence of at least one token"):
        model(ids)


@pytest.mark.parametrize("cls, targets", [
    (RoFormerForMaskedLM, {"labels": torch.tensor([[-100, 4, 9, -100], [5, -100, -100, -100]])}),
    (RoFormerForTokenClassification, {"labels": torch.tensor([[0, 1, 2, 1], [2, 0, 1, -100]])}),
    (RoFormerForSequenceClassification, {"labels": torch.tensor([2, 0])}),
    (RoFormerForQuestionAnswering, {"start_positions": torch.tensor([1, 0]), "end_positions": torch.tensor([2, 2])}),
])
def test_int32_targets_give_the_int64_loss(cls, targets):
    """Labels from numpy or Arrow often arrive as int32; cross-entropy itself only takes int64."""
    torch.manual_seed(0)
    model = cls(tiny_config(num_labels=3)).eval()
    expected = model(IDS, attention_mask=MASK, **targets).loss
    actual = model(IDS, attention_mask=MASK, **{k: v.int() for k, v in targets.items()}).loss
    torch.testing.assert_close(actual, expected)


def test_integer_multi_hot_labels_give_the_float_loss():
    torch.manual_seed(0)
    model = RoFormerForSequenceClassification(tiny_config(num_labels=3,
                                                          problem_type="multi_label_classification")).eval()
    multi_hot = torch.tensor([[0, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(model(IDS, attention_mask=MASK, labels=multi_hot).loss,
                               model(IDS, attention_mask=MASK, labels=multi_hot.float()).loss)


def test_decoder_only_switches_are_refused_on_an_encoder():
    for switch in ("add_cross_attention", "prefix_lm"):
        with pytest.raises(ValueError, match=f"{switch}=True: expected False unless is_decoder=True"):
            tiny_config(**{switch: True})
        tiny_config(is_decoder=True, **{switch: True})  # a decoder takes it


@pytest.mark.parametrize("name, value, expected", [
    ("encoder_hidden_states", torch.zeros(1, 2, 32), "need cross-attention layers"),
    ("encoder_attention_mask", torch.ones(1, 2), "need cross-attention layers"),
    ("past_key_values", (), "need a decoder"),
    ("use_cache", True, "need a decoder")])
def test_decoder_inputs_are_refused_by_an_encoder(name, value, expected):
    model = RoFormerForMaskedLM(tiny_config())
    with pytest.raises(ValueError, match=expected):
        model(torch.tensor([[2, 3]]), **{name: value})
    model(torch.tensor([[2, 3]]), use_cache=False)  # asking for no cache is fine
