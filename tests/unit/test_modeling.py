"""RoFormer models against transformers' RoFormer on the same weights, and their invariances."""

import pytest
import torch
import transformers
from helpers import TINY, padded_batch, reference_and_ours, tiny_config

import roformer_hf
from roformer_hf import (
    RoFormerForMaskedLM,
    RoFormerForMultipleChoice,
    RoFormerForQuestionAnswering,
    RoFormerForSequenceClassification,
    RoFormerForTokenClassification,
    RoFormerModel,
)
from roformer_hf.rotary import interleaved_to_half_permutation

LENGTHS = [20, 13, 7, 1]
TINY_VOCAB = TINY["vocab_size"]


def max_diff_on_real_tokens(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b).abs()[mask.bool()].max().item()


@pytest.mark.parametrize("head", ["RoFormerModel", "RoFormerForMaskedLM", "RoFormerForTokenClassification"])
@pytest.mark.parametrize("variant", [{}, {"embedding_size": 24}, {"rotary_value": True}])
def test_token_outputs_match_transformers(tmp_path, head, variant):
    reference, ours = reference_and_ours(head, tmp_path, **variant)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        expected, actual = reference(ids, attention_mask=mask)[0], ours(ids, attention_mask=mask)[0]
    assert actual.shape == expected.shape
    assert max_diff_on_real_tokens(actual, expected, mask) < 1e-5


@pytest.mark.parametrize("variant", [{}, {"embedding_size": 24}, {"rotary_value": True}])
def test_sequence_classification_matches_transformers(tmp_path, variant):
    reference, ours = reference_and_ours("RoFormerForSequenceClassification", tmp_path, num_labels=3, **variant)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits,
                                   reference(ids, attention_mask=mask).logits, atol=1e-5, rtol=0)


def test_question_answering_matches_transformers_on_real_tokens(tmp_path):
    reference, ours = reference_and_ours("RoFormerForQuestionAnswering", tmp_path)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        expected, actual = reference(ids, attention_mask=mask), ours(ids, attention_mask=mask)
    for field in ("start_logits", "end_logits"):
        assert max_diff_on_real_tokens(actual[field], expected[field], mask) < 1e-5
    assert (actual.start_logits[mask == 0] < -1e30).all()  # padding can never be a span boundary


def test_inputs_longer_than_max_position_embeddings(tmp_path):
    """The checkpoint has a 64-row table; compare 150 tokens with transformers' model given a 256-row table."""
    reference, ours = reference_and_ours("RoFormerForMaskedLM", tmp_path)
    with pytest.raises(IndexError):  # transformers' RoFormer cannot run past its table
        reference(torch.ones(1, 150, dtype=torch.long))
    longer = transformers.RoFormerForMaskedLM(transformers.RoFormerConfig.from_pretrained(
        tmp_path, max_position_embeddings=256)).eval()
    missing, unexpected = longer.load_state_dict(
        {k: v for k, v in reference.state_dict().items() if "embed_positions" not in k}, strict=False)
    assert missing == ["roformer.encoder.embed_positions.weight"] and not unexpected
    ids, mask = padded_batch([150, 90])
    with torch.no_grad():
        expected, actual = longer(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert max_diff_on_real_tokens(actual, expected, mask) < 1e-5


def test_importing_roformer_hf_leaves_transformers_roformer_alone():
    config = transformers.RoFormerConfig(**{k: v for k, v in tiny_config().to_dict().items()
                                            if k in transformers.RoFormerConfig().to_dict()})
    assert type(transformers.AutoModel.from_config(config)) is transformers.RoFormerModel
    assert type(transformers.AutoModelForMaskedLM.from_config(tiny_config())) is RoFormerForMaskedLM


@pytest.mark.parametrize("auto, expected", [
    (transformers.AutoModel, RoFormerModel),
    (transformers.AutoModelForMaskedLM, RoFormerForMaskedLM),
    (transformers.AutoModelForSequenceClassification, RoFormerForSequenceClassification),
    (transformers.AutoModelForTokenClassification, RoFormerForTokenClassification),
    (transformers.AutoModelForQuestionAnswering, RoFormerForQuestionAnswering),
    (transformers.AutoModelForMultipleChoice, RoFormerForMultipleChoice),
])
def test_auto_classes_build_and_load_our_models(tmp_path, auto, expected):
    model = auto.from_config(tiny_config())
    assert type(model) is expected
    model.save_pretrained(tmp_path)
    assert type(auto.from_pretrained(tmp_path)) is expected


def _model(cls=RoFormerForMaskedLM, **overrides):
    torch.manual_seed(0)
    return cls(tiny_config(**overrides)).eval()


def _sharpen(model):
    """Random init leaves attention nearly uniform, hiding position effects; scale q and k to make it peaky."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".attention.self.query." in name or ".attention.self.key." in name:
                param.mul_(8.0)
    return model


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_eager_and_sdpa_agree(norm_position):
    model = _model(norm_position=norm_position)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        sdpa = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask).logits
    assert max_diff_on_real_tokens(sdpa, eager, mask) < 1e-5


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_padded_and_unpadded_paths_agree(implementation):
    model = _model(attn_implementation=implementation)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        unpadded = model(ids, attention_mask=mask).logits
        model.config.unpad_inputs = False
        padded = model(ids, attention_mask=mask).logits
    assert max_diff_on_real_tokens(unpadded, padded, mask) < 1e-5


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("unpad", [True, False])
def test_sequence_alone_equals_sequence_in_padded_batch(left, unpad):
    model = _sharpen(_model(RoFormerModel, unpad_inputs=unpad))
    ids, mask = padded_batch(LENGTHS, left=left)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).last_hidden_state
        for row in range(len(LENGTHS)):
            keep = mask[row].bool()
            # Left padding shifts token positions; give the lone sequence the same position ids.
            positions = (torch.arange(ids.shape[1])[keep] if left else None)
            alone = model(ids[row, keep][None], position_ids=positions).last_hidden_state[0]
            torch.testing.assert_close(batched[row, keep], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("cls", [RoFormerForSequenceClassification, RoFormerForMultipleChoice])
def test_sentence_heads_score_a_sequence_in_a_padded_batch_as_alone(cls, left, unpad):
    """Classification reads each sequence's first real token, multiple choice its last: with left padding too,
    where position 0 is padding (reading it would give every padded row the same logits)."""
    model = _sharpen(_model(cls, num_labels=3, unpad_inputs=unpad))
    ids, mask = padded_batch(LENGTHS, left=left)
    choices = (lambda t: t[None]) if cls is RoFormerForMultipleChoice else (lambda t: t)  # (1, 4 choices, L)
    with torch.no_grad():
        batched = model(choices(ids), attention_mask=choices(mask)).logits.reshape(len(LENGTHS), -1)
        for row in range(len(LENGTHS)):
            keep = mask[row].bool()
            positions = torch.arange(ids.shape[1])[keep][None]
            alone = model(choices(ids[row, keep][None]), position_ids=choices(positions)).logits.reshape(1, -1)
            torch.testing.assert_close(batched[row], alone[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batched[1], batched[2])  # padded rows differ, as their texts do


def test_multiple_choice_matches_transformers(tmp_path):
    """transformers' RoFormer scores each choice from its last position; so does ours on unpadded choices."""
    reference, ours = reference_and_ours("RoFormerForMultipleChoice", tmp_path)
    ids = torch.randint(1, TINY_VOCAB, (2, 3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


def test_shifting_all_positions_leaves_outputs_unchanged():
    model = _sharpen(_model(RoFormerModel))
    ids, mask = padded_batch(LENGTHS)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        base = model(ids, attention_mask=mask, position_ids=positions).last_hidden_state
        shifted = model(ids, attention_mask=mask, position_ids=positions + 1000).last_hidden_state
        default = model(ids, attention_mask=mask).last_hidden_state
        reversed_order = model(ids, attention_mask=mask, position_ids=positions.flip(-1)).last_hidden_state
    assert max_diff_on_real_tokens(shifted, base, mask) < 1e-5
    assert max_diff_on_real_tokens(default, base, mask) == 0.0
    assert max_diff_on_real_tokens(reversed_order, base, mask) > 1e-3  # positions really matter


def test_half_layout_equals_interleaved_after_permuting_qk_rows():
    interleaved = _sharpen(_model(RoFormerModel))
    half = _model(RoFormerModel, rotary_layout="half")
    state = interleaved.state_dict()
    heads, d = interleaved.config.num_attention_heads, interleaved.config.head_dim
    perm = torch.cat([h * d + interleaved_to_half_permutation(d) for h in range(heads)])
    for name in list(state):
        if name.endswith(("attention.self.query.weight", "attention.self.query.bias",
                          "attention.self.key.weight", "attention.self.key.bias")):
            state[name] = state[name][perm]
    half.load_state_dict(state)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        a = interleaved(ids, attention_mask=mask).last_hidden_state
        b = half(ids, attention_mask=mask).last_hidden_state
        unpermuted = _model(RoFormerModel, rotary_layout="half")
        unpermuted.load_state_dict(interleaved.state_dict())
        c = unpermuted(ids, attention_mask=mask).last_hidden_state
    assert max_diff_on_real_tokens(a, b, mask) < 1e-5
    assert max_diff_on_real_tokens(a, c, mask) > 1e-3


def test_save_load_is_bit_exact(tmp_path):
    model = _model(norm_position="pre", rope_theta=1e6, embedding_size=24)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    loaded = RoFormerForMaskedLM.from_pretrained(tmp_path).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, loaded(ids, attention_mask=mask).logits)


def test_mlm_decoder_is_tied_to_word_embeddings(tmp_path):
    model = _model()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    loaded = RoFormerForMaskedLM.from_pretrained(tmp_path)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def _grads(model, ids, mask, labels):
    model.zero_grad()
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _model()
    model.train()  # dropout is 0 in the tiny config, so train mode is deterministic
    ids, mask = padded_batch(LENGTHS)
    labels = ids.masked_fill(mask == 0, -100)
    plain = _grads(model, ids, mask, labels)
    model.activation_checkpointing_enable()
    assert model.roformer.encoder.layer[0].gradient_checkpointing
    checkpointed = _grads(model, ids, mask, labels)
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("unpad", [True, False])
def test_chunked_feed_forward_matches_transformers_and_unchunked(tmp_path, unpad):
    """chunk_size_feed_forward=5: 41 packed tokens (or 4 x 20 padded) go through the feed-forward 5 at a time,
    the last chunk short, with the outputs of transformers' (chunked) RoFormer and of our unchunked model."""
    reference, ours = reference_and_ours("RoFormerForMaskedLM", tmp_path, chunk_size_feed_forward=5)
    ours.config.unpad_inputs = unpad
    ids, mask = padded_batch(LENGTHS)
    calls = []
    ours.roformer.encoder.layer[0].intermediate.dense.register_forward_hook(
        lambda module, args, output: calls.append(args[0].shape[-2]))
    with torch.no_grad():
        expected, chunked = reference(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    tokens = sum(LENGTHS) if unpad else mask.shape[1]
    assert calls == [5] * (tokens // 5) + ([tokens % 5] if tokens % 5 else [])
    assert max_diff_on_real_tokens(chunked, expected, mask) < 1e-5

    labels = ids.masked_fill(mask == 0, -100)
    chunked_grads = _grads(ours, ids, mask, labels)
    for layer in ours.roformer.encoder.layer:
        layer.chunk_size_feed_forward = 0
    plain_grads = _grads(ours, ids, mask, labels)
    assert calls[-1] == tokens  # the unchunked pass took all tokens at once
    for name in plain_grads:
        torch.testing.assert_close(chunked_grads[name], plain_grads[name], atol=1e-6, rtol=1e-5)


def _labels(cls, config, ids, mask):
    if cls is RoFormerForMaskedLM:
        return {"labels": ids.masked_fill(mask == 0, -100)}
    if cls is RoFormerForSequenceClassification:
        return {"labels": torch.tensor([0, 2, 1, 1])}
    if cls is RoFormerForTokenClassification:
        return {"labels": (ids % config.num_labels).masked_fill(mask == 0, -100)}
    if cls is RoFormerForQuestionAnswering:
        return {"start_positions": torch.tensor([1, 2, 0, 0]), "end_positions": torch.tensor([5, 4, 3, 0])}
    raise AssertionError(cls)


@pytest.mark.parametrize("cls", [RoFormerForMaskedLM, RoFormerForSequenceClassification,
                                 RoFormerForTokenClassification, RoFormerForQuestionAnswering])
def test_every_head_trains(cls):
    model = _model(cls, num_labels=3)
    model.train()
    ids, mask = padded_batch(LENGTHS)
    out = model(ids, attention_mask=mask, **_labels(cls, model.config, ids, mask))
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    embedding_grad = model.roformer.embeddings.word_embeddings.weight.grad
    assert embedding_grad is not None and embedding_grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_multiple_choice_shapes_and_loss():
    model = _model(RoFormerForMultipleChoice)
    ids, mask = padded_batch([9, 6, 4, 8, 3, 9])
    ids, mask = ids.view(2, 3, -1), mask.view(2, 3, -1)
    out = model(ids, attention_mask=mask, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3)
    out.loss.backward()
    # Each choice is scored on its own: the score of one choice equals that choice run alone.
    with torch.no_grad():
        alone = model(ids[1:2, 1:2, :3], attention_mask=mask[1:2, 1:2, :3]).logits  # that choice has 3 tokens
    torch.testing.assert_close(alone[0, 0], out.logits[1, 1].detach(), atol=1e-5, rtol=1e-5)


def test_sequence_classification_problem_types():
    ids, mask = padded_batch(LENGTHS)
    regression = _model(RoFormerForSequenceClassification, num_labels=1)
    target = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = regression(ids, attention_mask=mask, labels=target)
    assert regression.config.problem_type == "regression"
    torch.testing.assert_close(out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), target))

    single = _model(RoFormerForSequenceClassification, num_labels=3)
    target = torch.tensor([0, 2, 1, 1])
    out = single(ids, attention_mask=mask, labels=target)
    assert single.config.problem_type == "single_label_classification"
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, target))

    multi = _model(RoFormerForSequenceClassification, num_labels=3)
    target = torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]])
    out = multi(ids, attention_mask=mask, labels=target)
    assert multi.config.problem_type == "multi_label_classification"
    torch.testing.assert_close(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, target))


def test_mlm_loss_ignores_minus_100_and_matches_cross_entropy():
    model = _model()
    ids, mask = padded_batch(LENGTHS)
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 5], labels[2, 0] = 11, 42, 7
    out = model(ids, attention_mask=mask, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits.view(-1, model.config.vocab_size), labels.view(-1))
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("left", [False, True])
def test_mlm_evaluation_loss_and_logits_match_transformers(tmp_path, left):
    """Evaluation with labels (Trainer's loop): padded logits and the loss equal transformers' on the same weights.
    With Trainer's `num_items_in_batch` the loss is the summed cross-entropy over that count (transformers'
    RoFormer ignores it and takes the mean)."""
    reference, ours = reference_and_ours("RoFormerForMaskedLM", tmp_path)
    ids, mask = padded_batch(LENGTHS, left=left)
    labels = ids.masked_fill((mask == 0) | (torch.arange(ids.shape[1]) % 3 != 0), -100)
    with torch.no_grad():
        expected, actual = reference(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask,
                                                                                    labels=labels)
        summed = ours(ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(50)).loss
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, expected.loss * (labels != -100).sum() / 50, atol=1e-5, rtol=1e-5)
    assert max_diff_on_real_tokens(actual.logits, expected.logits, mask) < 1e-5
    assert (actual.logits[mask == 0] == 0).all()


def test_sparse_prediction_gives_the_same_loss_and_gradients():
    ids, mask = padded_batch(LENGTHS)
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 5], labels[2, 0], labels[0, 19] = 11, 42, 7, 3
    dense, sparse = _model(), _model(sparse_prediction=True)
    dense.train(), sparse.train()
    out_dense = dense(ids, attention_mask=mask, labels=labels)
    out_sparse = sparse(ids, attention_mask=mask, labels=labels)
    assert out_sparse.logits.shape == (4, dense.config.vocab_size)
    torch.testing.assert_close(out_sparse.loss, out_dense.loss)
    torch.testing.assert_close(out_sparse.logits, out_dense.logits[labels != -100])
    out_dense.loss.backward(), out_sparse.loss.backward()
    for (name, a), (_, b) in zip(dense.named_parameters(), sparse.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
    sparse.eval()
    with torch.no_grad():
        assert sparse(ids, attention_mask=mask, labels=labels).logits.shape == (*ids.shape, dense.config.vocab_size)


def _last_layer_rows(model) -> list[int]:
    """Records how many tokens the last layer's feed-forward receives at each call (several with
    `chunk_size_feed_forward`)."""
    rows = []
    model.roformer.encoder.layer[-1].intermediate.dense.register_forward_hook(
        lambda module, args, output: rows.append(args[0].flatten(0, -2).shape[0]))
    return rows


def _sparse_batch(layout: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Ids, labels (~30% of the real tokens) and the other inputs of a batch in the `layout` named."""
    ids, mask = padded_batch([13, 6, 10, 1], seed=int(torch.randint(100, (1,), generator=generator)),
                             left=layout == "left padded")
    inputs = {"attention_mask": mask} if layout.endswith("padded") else {}
    if layout == "dense":
        ids = ids[:, :6]
    if layout == "packed":  # positions that restart: each row holds several sequences
        inputs = {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4]] * len(ids))}
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones_like(ids, dtype=torch.bool)
    labelled = (torch.rand(ids.shape, generator=generator) < 0.3) & real
    return ids, ids.masked_fill(~labelled, -100), inputs


@pytest.mark.parametrize("seed", range(6))
def test_sparse_last_layer_computes_the_labelled_tokens_only_and_agrees_with_the_full_one(seed):
    """In training with sparse prediction the last layer's queries are the labelled tokens only (keys and values are
    every token): loss, sparse logits and every gradient equal those of the model without sparse prediction (the
    full last layer, the head on every token), across random configurations and layouts; the last layer's
    feed-forward sees the labelled tokens only."""
    generator = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    overrides = {"norm_position": pick("post", "pre"), "num_key_value_heads": pick(4, 2, 1),
                 "rotary_value": pick(False, True), "rotary_layout": pick("interleaved", "half"),
                 "chunk_size_feed_forward": pick(0, 3), "num_hidden_layers": pick(1, 2, 3)}
    layout = pick("dense", "right padded", "left padded", "packed")
    ids, labels, inputs = _sparse_batch(layout, generator)
    dense, sparse = _model(**overrides).train(), _model(sparse_prediction=True, **overrides).train()
    rows = _last_layer_rows(sparse)
    out_dense = dense(ids, labels=labels, **inputs)
    out_sparse = sparse(ids, labels=labels, **inputs)
    labelled = labels != -100
    assert sum(rows) == int(labelled.sum()), (overrides, layout)
    torch.testing.assert_close(out_sparse.loss, out_dense.loss, msg=f"{overrides} {layout}")
    torch.testing.assert_close(out_sparse.logits, out_dense.logits[labelled], atol=1e-5, rtol=1e-5)
    out_dense.loss.backward(), out_sparse.loss.backward()
    for (name, a), (_, b) in zip(dense.named_parameters(), sparse.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=f"{name} {overrides} {layout}")


@pytest.mark.parametrize("case", ["hidden states", "eager", "padded layout", "pooler", "flash stand-in",
                                  "attention dropout", "no label"])
def test_sparse_last_layer_falls_back_or_takes_the_other_kernels(case, stand_in_flash, monkeypatch):
    """Where the last layer's other tokens are read (hidden states, a pooler) or the kernel has no varlen form (eager,
    a padded layout), the last layer computes every token; the flash-attn path and attention dropout's blocked
    kernel take the labelled queries alone. Every case gives the loss of the model without sparse prediction."""
    from helpers import STAND_IN

    ids, mask = padded_batch([13, 6, 10, 1])
    labels = ids.masked_fill((mask == 0) | (torch.arange(13) % 3 != 1), -100)
    overrides = {"unpad_inputs": False} if case == "padded layout" else {}
    if case == "attention dropout":  # keeps every weight, in blocks of one query (more than 2 queries: blocked)
        overrides["attention_probs_dropout_prob"] = 1e-9
        monkeypatch.setattr(roformer_hf.attention, "DROPOUT_BLOCK_ROWS", 1)
    dense, sparse = _model(**overrides).train(), _model(sparse_prediction=True, **overrides).train()
    for model in (dense, sparse):
        if case == "eager":
            model.set_attn_implementation("eager")
        if case == "pooler":
            model.roformer.pooler = roformer_hf.modeling.RoFormerPooler(model.config)
    if case == "flash stand-in":
        sparse.set_attn_implementation(STAND_IN)
    if case == "no label":
        labels = torch.full_like(ids, -100)
    rows = _last_layer_rows(sparse)
    kwargs = {"output_hidden_states": True} if case == "hidden states" else {}
    expected = dense(ids, attention_mask=mask, labels=labels, **kwargs).loss
    actual = sparse(ids, attention_mask=mask, labels=labels, **kwargs).loss
    torch.testing.assert_close(actual, expected, equal_nan=True)
    full = case in ("hidden states", "eager", "padded layout", "pooler")
    real = mask.numel() if case in ("padded layout", "hidden states") else int(mask.sum())  # padding kept or not
    assert sum(rows) == (real if full else int((labels != -100).sum()))
    assert (stand_in_flash == ["varlen"] * 2) == (case == "flash stand-in")


def test_hidden_states_attentions_and_tuples():
    model = _model(attn_implementation="sdpa")
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
        as_tuple = model(ids, attention_mask=mask, return_dict=False)
    layers, batch, length = model.config.num_hidden_layers, len(LENGTHS), ids.shape[1]
    assert len(out.hidden_states) == layers + 1
    assert all(h.shape == (batch, length, model.config.hidden_size) for h in out.hidden_states)
    assert len(out.attentions) == layers
    weights = out.attentions[0]
    assert weights.shape == (batch, model.config.num_attention_heads, length, length)
    torch.testing.assert_close(weights.sum(-1)[:, :, 0], torch.ones(batch, model.config.num_attention_heads))
    assert (weights[1, :, :, LENGTHS[1]:] == 0).all()  # nobody attends to padding
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 1  # logits only: no loss, no extras asked for
    assert max_diff_on_real_tokens(as_tuple[0], out.logits, mask) < 1e-5  # sdpa vs the eager weights path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("unpad", [True, False])
def test_fully_padded_row_stays_finite(dtype, implementation, unpad):
    model = _model(attn_implementation=implementation, unpad_inputs=unpad).to(dtype)
    ids, mask = padded_batch([6, 4, 1])
    mask[2] = 0
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("unpad", [True, False])
def test_batch_without_any_real_token(unpad):
    """An all-zero attention mask (e.g. a filtered-out batch): every head answers with the usual shapes, no crash."""
    ids, mask = padded_batch([3, 2])
    mask[:] = 0
    with torch.no_grad():
        logits = _model(unpad_inputs=unpad)(ids, attention_mask=mask).logits
        classes = _model(RoFormerForSequenceClassification, unpad_inputs=unpad)(ids, attention_mask=mask).logits
    assert logits.shape == (2, ids.shape[1], 97) and torch.isfinite(logits).all()
    assert classes.shape == (2, 2) and torch.isfinite(classes).all()


@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_mean_classifier_pooling_classifies_the_mean_of_the_real_tokens(unpad, left):
    """classifier_pooling="mean": the head reads the attention-masked mean of the encoder's states, as ModernBERT's
    option of the same name computes it, and a row's logits do not depend on its padding."""
    model = _model(RoFormerForSequenceClassification, classifier_pooling="mean", unpad_inputs=unpad, num_labels=3)
    ids, mask = padded_batch(LENGTHS, left=left)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        states = model.roformer(ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).float()
        expected = model.classifier((states * weights).sum(1) / weights.sum(1))
        alone = torch.cat([model(ids[row:row + 1, mask[row].bool()]).logits for row in range(len(LENGTHS))])
        first_token = _model(RoFormerForSequenceClassification, unpad_inputs=unpad, num_labels=3)(
            ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(logits, first_token, atol=1e-3)  # same weights, [CLS] pooling: other logits


def test_model_runs_far_past_max_position_embeddings():
    model = _model(RoFormerModel, max_position_embeddings=16)
    with torch.no_grad():
        out = model(torch.randint(1, 97, (1, 300))).last_hidden_state
    assert out.shape == (1, 300, 32) and torch.isfinite(out).all()


def test_inputs_embeds_equal_input_ids():
    model = _model(RoFormerModel)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        from_ids = model(ids, attention_mask=mask).last_hidden_state
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask).last_hidden_state
    assert torch.equal(from_ids, from_embeds)


def test_token_type_ids_change_the_output():
    model = _model(RoFormerModel)
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        a = model(ids, attention_mask=mask).last_hidden_state
        b = model(ids, attention_mask=mask, token_type_ids=torch.ones_like(ids)).last_hidden_state
    assert max_diff_on_real_tokens(a, b, mask) > 1e-3


def test_public_api():
    for name in ["RoFormerConfig", "RoFormerPreTrainedModel", "RoFormerModel", "RoFormerForMaskedLM",
                 "RoFormerForSequenceClassification", "RoFormerForTokenClassification",
                 "RoFormerForQuestionAnswering", "RoFormerForMultipleChoice"]:
        assert name in roformer_hf.__all__ and hasattr(roformer_hf, name)


def test_our_checkpoints_load_in_transformers_roformer(tmp_path):
    ours = _sharpen(_model())
    ours.save_pretrained(tmp_path)
    theirs, info = transformers.RoFormerForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) <= {"roformer.encoder.embed_positions.weight"}  # a computed table
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        expected, actual = theirs.eval()(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert max_diff_on_real_tokens(actual, expected, mask) < 1e-5


@pytest.mark.parametrize("head", ["RoFormerModel", "RoFormerForMaskedLM", "RoFormerForTokenClassification"])
def test_returned_states_are_the_ones_the_outputs_came_from(head):
    """Attribution and saliency methods differentiate the outputs with respect to the returned hidden states and
    attentions: on a padded batch too, they must be the tensors the model computed with."""
    torch.manual_seed(0)
    model = getattr(roformer_hf, head)(tiny_config(num_labels=3)).eval()
    ids, mask = padded_batch([6, 3])
    out = model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    target = out[0][mask.bool()].sum()  # real tokens only
    grads = torch.autograd.grad(target, [*out.hidden_states, *out.attentions], allow_unused=True)
    assert all(grad is not None for grad in grads)
    for state, grad in zip(out.hidden_states, grads):
        assert state.shape == (2, 6, 32) and grad[mask.bool()].abs().sum() > 0


def test_training_steps_are_deterministic_on_cpu():
    """Same seed, same data: bit-identical losses and weights after a few optimiser steps (dropout on)."""
    ids, mask = padded_batch([9, 6, 3])
    labels = ids.masked_fill(mask == 0, -100)

    def run() -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(123)
        model = RoFormerForMaskedLM(tiny_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, model.roformer.encoder.layer[1].output.dense.weight.detach().clone()

    (losses_a, weight_a), (losses_b, weight_b) = run(), run()
    assert losses_a == losses_b and torch.equal(weight_a, weight_b)
    assert losses_a[0] != losses_a[-1]  # it really trained
