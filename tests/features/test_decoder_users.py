"""The decoder as a user meets it: a causal LM built from an encoder's config or folder, `shift_labels`, the BERT2BERT
warm start, generation from embeddings, the text-generation pipeline; and the prefix-LM's left padding and caches of
another model, held against references written from the equations."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import TINY, padded_batch, tiny_config
from safetensors.torch import load_file, save_file

from roformer_hf import RoFormerForCausalLM, RoFormerModel
from roformer_hf.plan import ForwardPlan


def changed_after(ids: torch.Tensor, position: int, vocab_size: int = TINY["vocab_size"]) -> torch.Tensor:
    """`ids` with every token from `position` on replaced by another one."""
    changed = ids.clone()
    changed[:, position:] = (changed[:, position:] + 1) % (vocab_size - 1) + 1
    return changed


def assert_causal(model: RoFormerForCausalLM, ids: torch.Tensor) -> None:
    """Changing the last tokens leaves the logits before them unchanged, and changes the logits at them."""
    with torch.no_grad():
        logits = model(ids).logits
        changed = model(changed_after(ids, 3)).logits
    torch.testing.assert_close(changed[:, :3], logits[:, :3], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:, 3:], logits[:, 3:], atol=1e-4)


# --- a causal LM is a decoder, whatever config it is given ----------------------------------------------------------


def test_a_causal_lm_on_an_encoder_config_is_a_decoder_on_its_own_copy(caplog):
    config = tiny_config()  # is_decoder=False, as transformers' tests build every class from one config
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="roformer_hf.modeling"):
        model = RoFormerForCausalLM(config).eval()
    assert "is_decoder=False" in caplog.text  # said, not silent
    assert model.config.is_decoder and not config.is_decoder  # the caller's config is left alone
    assert model.config.to_dict() == {**config.to_dict(), "is_decoder": True}
    assert_causal(model, torch.randint(1, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0)))
    ids = torch.tensor([[2, 15, 27, 9]])
    assert model(ids, use_cache=True).past_key_values.get_seq_length() == 4  # a decoder's cache
    assert model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 7)


def test_auto_model_for_causal_lm_reads_an_encoders_folder_as_a_decoder(tmp_path):
    torch.manual_seed(0)
    encoder = RoFormerModel(tiny_config()).eval()
    encoder.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model) is RoFormerForCausalLM and model.config.is_decoder
    for name, weight in encoder.state_dict().items():  # the encoder's weights, every one of them
        torch.testing.assert_close(model.roformer.state_dict()[name], weight, rtol=0, atol=0)
    assert_causal(model, torch.randint(1, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1)))
    # What a decoder built with is_decoder=True computes on the same weights (test_decoder.py holds that one against
    # transformers' RoFormerForCausalLM).
    decoder = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    decoder.load_state_dict(model.state_dict())
    ids, mask = padded_batch([6, 4])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, decoder(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)


# --- shift_labels: the targets as given -----------------------------------------------------------------------------


@pytest.mark.parametrize("left", [False, True])
def test_shift_labels_are_the_targets_as_given(left):
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([6, 4, 5], left=left)
    gen = torch.Generator().manual_seed(2)
    shift_labels = torch.randint(0, TINY["vocab_size"], ids.shape, generator=gen).masked_fill(mask == 0, -100)
    shift_labels[0, 2] = -100
    labels = torch.randint(0, TINY["vocab_size"], ids.shape, generator=gen)  # not read when shift_labels are given
    out = model(ids, attention_mask=mask, labels=labels, shift_labels=shift_labels)
    logits = model(ids, attention_mask=mask).logits
    expected = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    # Without labels too; and labels shifted by hand give what labels give.
    torch.testing.assert_close(model(ids, attention_mask=mask, shift_labels=shift_labels).loss, expected)
    causal_labels = ids.masked_fill(mask == 0, -100)
    shifted = F.pad(causal_labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(model(ids, attention_mask=mask, shift_labels=shifted).loss,
                               model(ids, attention_mask=mask, labels=causal_labels).loss)
    with pytest.raises(ValueError, match=r"shift_labels has shape \(3, 5\); expected \(3, 6\)"):
        model(ids, attention_mask=mask, shift_labels=shift_labels[:, :5])


# --- BERT2BERT: an encoder's checkpoint warm-starts the decoder of an EncoderDecoderModel ----------------------------


def test_bert2bert_warm_start_initialises_only_the_cross_attention(tmp_path, caplog):
    torch.manual_seed(0)
    encoder = RoFormerModel(tiny_config()).eval()
    encoder.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="roformer_hf.loading"):
        model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path, tmp_path)
    assert "crossattention" in caplog.text and "initialised" in caplog.text
    decoder = model.decoder
    assert type(decoder) is RoFormerForCausalLM and decoder.config.is_decoder and decoder.config.add_cross_attention
    decoder_weights = decoder.roformer.state_dict()
    for name, weight in encoder.state_dict().items():  # every encoder weight carried over, in both halves
        torch.testing.assert_close(decoder_weights[name], weight, rtol=0, atol=0)
        torch.testing.assert_close(model.encoder.state_dict()[name], weight, rtol=0, atol=0)
    cross = [name for name in decoder_weights if ".crossattention." in name]
    assert len(cross) == 2 * 10  # 2 layers: query, key, value, output dense (weight, bias) and LayerNorm
    model.config.decoder_start_token_id, model.config.pad_token_id = 2, 0
    sources = torch.tensor([[2, 15, 27, 9, 3]])
    loss = model(input_ids=sources, labels=torch.tensor([[44, 51, 3]])).loss
    loss.backward()
    assert torch.isfinite(loss) and decoder.roformer.encoder.layer[0].crossattention.self.query.weight.grad.abs().sum()


def _drop_weights(folder, dropped: str) -> None:
    weights = load_file(folder / "model.safetensors")
    save_file({name: w for name, w in weights.items() if dropped not in name}, folder / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("dropped", ["layer.1.attention.self.key.weight", "embeddings.word_embeddings",
                                     "layer.0.intermediate.dense"])
def test_bert2bert_still_refuses_a_checkpoint_lacking_encoder_weights(tmp_path, dropped):
    torch.manual_seed(0)
    RoFormerModel(tiny_config()).save_pretrained(tmp_path)
    _drop_weights(tmp_path, dropped)
    with pytest.raises(ValueError, match=r"lacks \d+ encoder weight.*decoder_allow_missing_encoder_weights=True"):
        transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(
            tmp_path, tmp_path, encoder_allow_missing_encoder_weights=True)
    # The spelling the error names works there.
    model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(
        tmp_path, tmp_path, encoder_allow_missing_encoder_weights=True, decoder_allow_missing_encoder_weights=True)
    assert type(model.decoder) is RoFormerForCausalLM


def test_a_decoder_checkpoint_with_part_of_its_cross_attention_is_refused(tmp_path):
    torch.manual_seed(0)
    RoFormerForCausalLM(tiny_config(is_decoder=True, add_cross_attention=True)).save_pretrained(tmp_path)
    _drop_weights(tmp_path, "layer.1.crossattention.self.value")
    with pytest.raises(ValueError, match=r"lacks 2 encoder weight.*crossattention\.self\.value"):
        RoFormerForCausalLM.from_pretrained(tmp_path)


# --- generate(inputs_embeds=...) --------------------------------------------------------------------------------------


def test_generate_from_embeddings_gives_the_tokens_generated_from_ids(tmp_path):
    torch.manual_seed(0)
    reference = transformers.RoFormerForCausalLM(transformers.RoFormerConfig(**TINY, is_decoder=True)).eval()
    reference.save_pretrained(tmp_path)
    model = RoFormerForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[2, 15, 27, 9, 33, 41]])
    options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    from_ids = model.generate(ids, **options)[:, ids.shape[1]:]
    from_embeddings = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **options)
    torch.testing.assert_close(from_embeddings, from_ids, rtol=0, atol=0)
    # transformers' RoFormerForCausalLM on the same weights generates the same tokens from its embeddings.
    torch.testing.assert_close(reference.generate(inputs_embeds=reference.get_input_embeddings()(ids), **options),
                               from_ids, rtol=0, atol=0)


def test_generate_from_embeddings_of_a_left_padded_batch():
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([6, 3, 5], left=True)
    options = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    from_ids = model.generate(ids, attention_mask=mask, **options)[:, ids.shape[1]:]
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model.generate(inputs_embeds=embeds, attention_mask=mask, **options), from_ids,
                               rtol=0, atol=0)


# --- an independent reference: the decoder written from its equations ------------------------------------------------
# Plain float64 attention over the weights as transformers' RoFormer names them, each row's positions counted over its
# real tokens (what every row alone would see), rotary from the closed form; no code shared with the model.


def reference_logits(model: RoFormerForCausalLM, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor,
                     encoder_states: torch.Tensor | None = None,
                     encoder_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`(B, L, V)` float64 logits of a post-norm RoFormer decoder (`config.prefix_lm`: segment 0 of `types` read
    bidirectionally; `config.add_cross_attention`: cross-attention on `encoder_states`); padding rows are garbage."""
    config = model.config
    w = {name: t.detach().double() for name, t in model.state_dict().items()}
    act = transformers.activations.ACT2FN[config.hidden_act]
    nh, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    eps = config.layer_norm_eps
    batch, length = ids.shape
    real = mask.bool()

    def dense(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def layer_norm(x, name):
        return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)

    def heads(x):  # (B, L, H) -> (B, nh, L, d)
        return x.view(batch, x.shape[1], nh, d).transpose(1, 2)

    # Positions over the real tokens; the frequencies of the rope type at the batch's longest sequence.
    positions = (mask.cumsum(-1) - 1).clamp(min=0).double()  # (B, L)
    base = config.rope_parameters["rope_theta"]
    if config.rope_parameters["rope_type"] == "dynamic":  # NTK scaling beyond max_position_embeddings
        factor, trained = config.rope_parameters["factor"], config.max_position_embeddings
        longest = max(int(mask.sum(-1).max()), trained)
        base = base * (factor * longest / trained - (factor - 1)) ** (d / (d - 2))
    angles = positions[..., None] * base ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)  # (B, L, d/2)
    cos, sin = (f(angles).repeat_interleave(2, -1)[:, None] for f in (torch.cos, torch.sin))  # (B, 1, L, d)

    def rotate(x):  # pairs (2i, 2i+1) turn by their angle
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return x * cos + turned * sin

    def attend(q, k, v, allowed):  # allowed: (B, 1, Lq, Lk)
        scores = (q @ k.transpose(-1, -2)) / d**0.5
        probabilities = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return (probabilities @ v).transpose(1, 2).reshape(batch, q.shape[2], nh * d)

    query_index, key_index = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = key_index <= query_index  # (L, L)
    if config.prefix_lm:
        prefix = real & (types == 0)
        visible = visible | (prefix[:, :, None] & prefix[:, None, :])
    allowed = (visible & real[:, None, :]) | (query_index == key_index)  # a padding query sees itself
    allowed = allowed.expand(batch, length, length)[:, None]

    embeddings = "roformer.embeddings"
    x = w[f"{embeddings}.word_embeddings.weight"][ids] + w[f"{embeddings}.token_type_embeddings.weight"][types]
    x = layer_norm(x, "roformer.embeddings.LayerNorm")
    for index in range(config.num_hidden_layers):
        prefix_name = f"roformer.encoder.layer.{index}"
        q, k, v = (heads(dense(x, f"{prefix_name}.attention.self.{p}")) for p in ("query", "key", "value"))
        q, k = rotate(q), rotate(k)
        if config.rotary_value:
            v = rotate(v)
        context = attend(q, k, v, allowed)
        x = layer_norm(x + dense(context, f"{prefix_name}.attention.output.dense"),
                       f"{prefix_name}.attention.output.LayerNorm")
        if encoder_states is not None:  # nothing rotates in cross-attention
            source = encoder_states.double()
            q = heads(dense(x, f"{prefix_name}.crossattention.self.query"))
            k, v = (dense(source, f"{prefix_name}.crossattention.self.{p}").view(batch, -1, nh, d).transpose(1, 2)
                    for p in ("key", "value"))
            context = attend(q, k, v, encoder_mask.bool()[:, None, None, :])
            x = layer_norm(x + dense(context, f"{prefix_name}.crossattention.output.dense"),
                           f"{prefix_name}.crossattention.output.LayerNorm")
        hidden = act(dense(x, f"{prefix_name}.intermediate.dense"))
        x = layer_norm(x + dense(hidden, f"{prefix_name}.output.dense"), f"{prefix_name}.output.LayerNorm")
    x = layer_norm(act(dense(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    return x @ w["cls.predictions.decoder.weight"].T + w["cls.predictions.bias"]


def reference_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over each row's real tokens: token t's logits against token t + 1, both real."""
    terms = [F.cross_entropy(logits[row, mask[row].bool()][:-1], ids[row, mask[row].bool()][1:], reduction="none")
             for row in range(ids.shape[0])]
    return torch.cat(terms).mean()


def random_decoder(seed: int, **fixed) -> RoFormerForCausalLM:
    """A small post-norm RoFormer decoder of a random configuration (heads, depth, rotated values, rope type)."""
    gen = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    rope = pick({"rope_type": "default", "rope_theta": 10000.0},
                {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    options = {"num_attention_heads": pick(2, 4), "num_hidden_layers": pick(1, 2), "rotary_value": pick(False, True),
               "hidden_act": pick("gelu", "relu"), "rope_parameters": rope, "max_position_embeddings": 8,
               "is_decoder": True}
    torch.manual_seed(seed)
    model = RoFormerForCausalLM(tiny_config(**{**options, **fixed})).eval()
    with torch.no_grad():  # a bias of its own, so that a mix-up with the decoder's tied one shows
        model.cls.predictions.bias.normal_(0, 0.5)
    return model


def random_prefix_batch(seed: int, left: bool):
    """Rows of 3 to 11 real tokens (padded on one side), each a prefix (segment 0) then segment 1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (4,), generator=gen).tolist()
    lengths[0] = 11  # the longest row beyond max_position_embeddings: dynamic rope scales
    ids, mask = padded_batch(lengths, seed=seed, left=left)
    types = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        prefix = int(torch.randint(1, n, (1,), generator=gen))
        real = mask[row].nonzero().squeeze(-1)
        types[row, real[prefix:]] = 1
    return ids, mask, types


CONFIG_SEEDS = range(6)


def described(model: RoFormerForCausalLM) -> dict:
    """The randomly chosen part of a model's configuration, for failure messages."""
    return {key: getattr(model.config, key) for key in ("num_attention_heads", "num_hidden_layers", "rotary_value",
                                                           "hidden_act", "rope_parameters")}
PADDING_SIDES = pytest.mark.parametrize("left", [pytest.param(False, id="right"), pytest.param(True, id="left")])


@PADDING_SIDES
def test_causal_lm_logits_of_padded_rows_equal_the_reference(left):
    for seed in CONFIG_SEEDS:
        model = random_decoder(seed)
        ids, mask, _ = random_prefix_batch(seed, left)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        expected = reference_logits(model, ids, mask, torch.zeros_like(ids))
        real = mask.bool()
        torch.testing.assert_close(logits[real].double(), expected[real], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{described(model)}: {m}")


@PADDING_SIDES
def test_causal_lm_loss_of_padded_rows_equals_the_reference(left):
    for seed in CONFIG_SEEDS:
        model = random_decoder(seed, rotary_value=False, rope_parameters=None)  # positions aside
        ids, mask, _ = random_prefix_batch(seed, left)
        with torch.no_grad():
            loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        expected = reference_loss(reference_logits(model, ids, mask, torch.zeros_like(ids)), ids, mask)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{described(model)}: {m}")


@PADDING_SIDES
def test_prefix_lm_logits_of_padded_rows_equal_the_reference(left):
    for seed in CONFIG_SEEDS:
        model = random_decoder(seed, prefix_lm=True)
        ids, mask, types = random_prefix_batch(seed, left)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, token_type_ids=types).logits
        expected = reference_logits(model, ids, mask, types)
        real = mask.bool()
        torch.testing.assert_close(logits[real].double(), expected[real], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{described(model)}: {m}")


@PADDING_SIDES
def test_prefix_lm_loss_of_padded_rows_equals_the_reference(left):
    for seed in CONFIG_SEEDS:
        model = random_decoder(seed, prefix_lm=True, rotary_value=False, rope_parameters=None)  # positions aside
        ids, mask, types = random_prefix_batch(seed, left)
        with torch.no_grad():
            loss = model(ids, attention_mask=mask, token_type_ids=types, labels=ids.masked_fill(mask == 0, -100)).loss
        expected = reference_loss(reference_logits(model, ids, mask, types), ids, mask)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{described(model)}: {m}")


@PADDING_SIDES
@pytest.mark.parametrize("types", ["zeros", "omitted", "ones at padding"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_prefix_lm_on_its_prefix_alone_reads_as_an_encoder_without_its_padding(left, types, attn_implementation):
    """Rows whose real tokens all sit in the prefix (RoFormer-Sim's sentence embeddings) attend bidirectionally: the
    states equal the reference's on real tokens, and the forward skips the padding as an encoder's does."""
    for seed in CONFIG_SEEDS:
        model = random_decoder(seed, prefix_lm=True)
        model.set_attn_implementation(attn_implementation)
        ids, mask, _ = random_prefix_batch(seed, left)
        token_types = {"zeros": torch.zeros_like(ids), "omitted": None,
                       "ones at padding": (mask == 0).long()}[types]
        plan = ForwardPlan.build(model.config, ids, mask, token_type_ids=token_types, use_cache=False)
        assert plan.layout.mode == "varlen" and not plan.attention_mask.is_causal
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, token_type_ids=token_types, use_cache=False,
                           output_attentions=attn_implementation == "eager").logits  # eager attends padded
            cached = model(ids, attention_mask=mask, token_type_ids=token_types).logits  # a cache: the prefix's mask
        expected = reference_logits(model, ids, mask, torch.zeros_like(ids))
        real = mask.bool()
        for actual in (logits, cached):
            torch.testing.assert_close(actual[real].double(), expected[real], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{described(model)}: {m}")


def test_prefix_lm_with_a_row_past_its_prefix_keeps_the_prefix_mask():
    model = random_decoder(0, prefix_lm=True)
    ids, mask, types = random_prefix_batch(0, left=False)
    types[1:] = 0  # one row reaches segment 1: the batch keeps the prefix-LM's mask, padded
    plan = ForwardPlan.build(model.config, ids, mask, token_type_ids=types, use_cache=False)
    assert plan.layout.mode == "padded" and plan.attention_mask.is_causal
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, token_type_ids=types, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real].double(), reference_logits(model, ids, mask, types)[real], rtol=1e-4,
                               atol=1e-4)


def random_encoder_states(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An encoder's states `(B, 6, H)` and their padding (right-padded rows of 2 to 6 tokens)."""
    gen = torch.Generator().manual_seed(seed + 100)
    lengths = torch.randint(2, 7, (batch,), generator=gen)
    lengths[0] = 6
    states = torch.randn(batch, 6, TINY["hidden_size"], generator=gen)
    return states, (torch.arange(6) < lengths[:, None]).long()


@PADDING_SIDES
def test_cross_attention_decoder_on_padded_rows_equals_the_reference(left):
    for seed in CONFIG_SEEDS:
        model = random_decoder(seed, add_cross_attention=True)
        ids, mask, _ = random_prefix_batch(seed, left)
        types = torch.zeros_like(ids)
        states, states_mask = random_encoder_states(seed, ids.shape[0])
        inputs = {"attention_mask": mask, "encoder_hidden_states": states, "encoder_attention_mask": states_mask}
        with torch.no_grad():
            out = model(ids, labels=ids.masked_fill(mask == 0, -100), **inputs)
        expected = reference_logits(model, ids, mask, types, states, states_mask)
        real = mask.bool()
        torch.testing.assert_close(out.logits[real].double(), expected[real], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{described(model)}: {m}")
        torch.testing.assert_close(out.loss.double(), reference_loss(expected, ids, mask), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{described(model)}: {m}")


# --- the text-generation pipeline -----------------------------------------------------------------------------------

PIECES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "king", "queen", "speaks", "sm", "##ile", "##s", "."]


def trained_causal_lm(folder, eos: bool = True):
    """A tiny causal LM trained on two texts as the tokenizer encodes them (`[CLS] text [SEP]`: [SEP] ends a text),
    saved to `folder` with its tokenizer; `eos`: its generation config says so."""
    from roformer_hf import RoFormerHFTokenizer

    tokenizer = RoFormerHFTokenizer(vocab={token: i for i, token in enumerate(PIECES)})
    batch = tokenizer(["the king speaks.", "the queen smiles."], padding=True, return_tensors="pt")
    assert tokenizer.convert_ids_to_tokens(batch["input_ids"][1])[-4:] == ["##ile", "##s", ".", "[SEP]"]
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(vocab_size=len(PIECES), is_decoder=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for _ in range(25):
        optimizer.zero_grad()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
    if eos:
        model.generation_config.eos_token_id = tokenizer.sep_token_id  # training ended every text with [SEP]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def causal_lm_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("causal_lm")
    trained_causal_lm(folder)
    return folder


def test_text_generation_pipeline_continues_a_prompt_and_stops_at_the_end(causal_lm_folder):
    generator = transformers.pipeline("text-generation", model=str(causal_lm_folder))
    tokenizer = generator.tokenizer
    assert not tokenizer.add_sep_token  # a causal LM's folder: prompts are [CLS] text, to be continued
    assert tokenizer("the queen")["input_ids"] == [2, 5, 7]
    options = {"max_new_tokens": 8, "do_sample": False}
    assert generator("the queen", **options)[0]["generated_text"] == "the queen smiles."  # pieces joined, stops
    assert generator("the king", **options)[0]["generated_text"] == "the king speaks."
    assert generator("the queen", return_full_text=False, **options)[0]["generated_text"] == " smiles."


def test_a_causal_lm_tokenizer_encodes_training_texts_when_asked(causal_lm_folder, tmp_path):
    import shutil

    from roformer_hf import RoFormerHFTokenizer

    shutil.copytree(causal_lm_folder, tmp_path, dirs_exist_ok=True)
    assert RoFormerHFTokenizer.from_pretrained(tmp_path, add_sep_token=True)("the king")["input_ids"] == [2, 5, 6, 3]
    tokenizer = RoFormerHFTokenizer.from_pretrained(tmp_path)
    tokenizer.add_sep_token = True  # recorded: the folder keeps it
    assert tokenizer("the king")["input_ids"] == [2, 5, 6, 3]
    tokenizer.save_pretrained(tmp_path)
    assert RoFormerHFTokenizer.from_pretrained(tmp_path)("the king")["input_ids"] == [2, 5, 6, 3]
    assert tokenizer("the king", "speaks")["input_ids"] == [2, 5, 6, 3, 8, 3]  # pairs keep both [SEP]s


def test_decoding_a_continuation_joins_it_to_the_text_before_it():
    from roformer_hf import RoFormerHFTokenizer

    tokenizer = RoFormerHFTokenizer(vocab={token: i for i, token in enumerate(PIECES)})
    ids = tokenizer("the queen smiles.")["input_ids"]  # [CLS] the queen sm ##ile ##s . [SEP]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the queen smiles."  # a whole text: unchanged
    assert tokenizer.decode([0, 0] + ids, skip_special_tokens=True) == "the queen smiles."  # left-padded
    for split in range(2, len(ids) - 1):
        head = tokenizer.decode(ids[:split], skip_special_tokens=True)
        assert head + tokenizer.decode(ids[split:], skip_special_tokens=True) == "the queen smiles.", split
