"""Whether two versions of roformer_hf compute the same bits on every path: used by `ab_versions.py` before it times.

Each case builds one small model per version from the same config and the same weights (the old version's state
dict loaded into the new one), runs the same inputs, and compares every output tensor and every gradient with
`torch.equal`: a refactor must change nothing, not even the last bit. The cases cover the heads, the batch layouts
(no padding, right and left padding, packed rows by `position_ids` and by `cu_seq_lens`), the rope types, grouped
queries, RoFormer-V2, pre-norm, the rotate-half layout, rotated values, the attention kernels (SDPA, eager with
weights), training with dropout (seeded), the decoder (causal LM with labels, a cache, greedy, sampled and beam
generation, the prefix-LM of RoFormer-Sim, cross-attention).
"""

from __future__ import annotations

import torch

SMALL = {"vocab_size": 120, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "max_position_embeddings": 64}
ROPES = {"linear": {"rope_type": "linear", "factor": 2.0}, "dynamic": {"rope_type": "dynamic", "factor": 2.0},
         "yarn": {"rope_type": "yarn", "factor": 4.0}, "llama3": {"rope_type": "llama3", "factor": 2.0,
                                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0},
         "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                      "original_max_position_embeddings": 8}}
ENCODER_VARIANTS = {
    "default": {}, "padded layout (unpad_inputs=False)": {"unpad_inputs": False},
    "GQA (2 key/value heads)": {"num_key_value_heads": 2},
    "V2 (rms_norm, no bias, relu)": {"use_bias": False, "norm_type": "rms_norm", "hidden_act": "relu"},
    "pre-norm": {"norm_position": "pre"}, "rotate-half": {"rotary_layout": "half"},
    "rotary_value": {"rotary_value": True}, "embedding_size 16": {"embedding_size": 16},
    "chunked feed-forward": {"chunk_size_feed_forward": 3},
    **{f"rope {name}": {"rope_parameters": params} for name, params in ROPES.items()},
}
HEADS = ("RoFormerModel", "RoFormerForMaskedLM", "RoFormerForSequenceClassification",
         "RoFormerForTokenClassification", "RoFormerForQuestionAnswering")


def _pair(old, new, class_name: str, seed: int = 0, **config):
    """The same model in both versions: the old one built with `seed`, its weights loaded into the new one."""
    torch.manual_seed(seed)
    old_model = getattr(old, class_name)(old.RoFormerConfig(**{**SMALL, **config}))
    new_model = getattr(new, class_name)(new.RoFormerConfig(**{**SMALL, **config}))
    new_model.load_state_dict(old_model.state_dict())
    return old_model, new_model


def _tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a model output (nested tuples, caches), by path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):  # ModelOutput
        return {k: t for key in value.keys() for k, t in _tensors(value[key], f"{prefix}.{key}").items()}
    if hasattr(value, "layers"):  # a Cache
        return {k: t for i, layer in enumerate(value.layers)
                for k, t in _tensors((layer.keys, layer.values), f"{prefix}[{i}]").items()}
    if hasattr(value, "self_attention_cache"):
        return {**_tensors(value.self_attention_cache, f"{prefix}.self"),
                **_tensors(value.cross_attention_cache, f"{prefix}.cross")}
    if isinstance(value, (tuple, list)):
        return {k: t for i, item in enumerate(value) for k, t in _tensors(item, f"{prefix}[{i}]").items()}
    return {}


def _differences(old_out, new_out) -> list[str]:
    old_t, new_t = _tensors(old_out), _tensors(new_out)
    if old_t.keys() != new_t.keys():
        return [f"outputs differ: {sorted(old_t.keys() ^ new_t.keys())}"]
    return [name for name in old_t if not torch.equal(old_t[name], new_t[name])]


def _run(model, train: bool, seed: int, kwargs: dict, generate: dict | None = None):
    """One forward (or `generate`) of `model`, with the gradients of its loss when `train`."""
    model.train(train)
    torch.manual_seed(seed)
    if generate is not None:
        with torch.no_grad():
            return model.generate(**kwargs, **generate)
    if not train:
        with torch.no_grad():
            return model(**kwargs)
    model.zero_grad(set_to_none=True)
    output = model(**kwargs)
    loss = output.loss if output.get("loss") is not None else output[0].float().pow(2).mean()
    loss.backward()
    grads = tuple(p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None)
    return output, grads


def _inputs(kind: str, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    ids = torch.randint(4, SMALL["vocab_size"], (3, 12))
    mask = torch.ones_like(ids)
    if kind == "right-padded":
        mask[1, 8:] = 0
        mask[2, 5:] = 0
    elif kind == "left-padded":
        mask[1, :4] = 0
        mask[2, :7] = 0
    elif kind == "packed (position_ids)":
        return {"input_ids": ids, "position_ids": torch.tensor([list(range(5)) + list(range(7))] * 3)}
    elif kind == "packed (cu_seq_lens)":
        offsets = torch.tensor([0, 5, 12, 16, 24, 30, 36], dtype=torch.int32)
        return {"input_ids": ids, "cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets}
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


def cases():
    """(name, class, config, forward kwargs, generate kwargs or None, train)."""
    layouts = ("no padding", "right-padded", "left-padded", "packed (position_ids)", "packed (cu_seq_lens)")
    for variant, config in ENCODER_VARIANTS.items():
        for layout in layouts if variant == "default" else ("right-padded",):
            inputs = _inputs(layout)
            labels = inputs["input_ids"].masked_fill(torch.rand(inputs["input_ids"].shape) > 0.3, -100)
            yield f"MLM {variant}, {layout}", "RoFormerForMaskedLM", config, {**inputs, "labels": labels}, None, False
            yield (f"MLM {variant}, {layout}, training", "RoFormerForMaskedLM",
                   {**config, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
                   {**inputs, "labels": labels}, None, True)
    padded = _inputs("right-padded")
    for head in HEADS:
        extra = {"labels": torch.tensor([0, 1, 0])} if head == "RoFormerForSequenceClassification" else {}
        if head == "RoFormerForQuestionAnswering":
            extra = {"start_positions": torch.tensor([1, 2, 3]), "end_positions": torch.tensor([3, 4, 4])}
        yield f"{head}, right-padded, training", head, {"num_labels": 2}, {**padded, **extra}, None, True
    for implementation in ("eager", "sdpa"):
        yield (f"MLM {implementation}, weights and hidden states", "RoFormerForMaskedLM",
               {"attn_implementation": implementation},
               {**_inputs("left-padded"), "output_attentions": True, "output_hidden_states": True}, None, False)
    choices = torch.randint(4, SMALL["vocab_size"], (2, 3, 7))
    yield "multiple choice", "RoFormerForMultipleChoice", {}, {"input_ids": choices, "labels": torch.tensor([1, 2])}, \
        None, True

    decoder = {"is_decoder": True}
    for layout in ("no padding", "right-padded", "left-padded"):
        inputs = _inputs(layout)
        labels = inputs["input_ids"].masked_fill(inputs.get("attention_mask", 1) == 0, -100)
        yield f"causal LM, {layout}, training", "RoFormerForCausalLM", decoder, {**inputs, "labels": labels}, None, True
        yield f"causal LM, {layout}, with a cache", "RoFormerForCausalLM", decoder, {**inputs, "use_cache": True}, \
            None, False
    left = _inputs("left-padded")
    for name, generate in {"greedy": {"do_sample": False}, "sampled": {"do_sample": True, "top_k": 20},
                           "beam search": {"do_sample": False, "num_beams": 3}}.items():
        yield f"generate, {name}, left-padded", "RoFormerForCausalLM", decoder, left, \
            {"max_new_tokens": 6, "pad_token_id": 0, **generate}, False
    for variant, config in {"GQA": {"num_key_value_heads": 2}, "rope dynamic": {"rope_parameters": ROPES["dynamic"]},
                            "rotary_value": {"rotary_value": True}}.items():
        yield f"generate, greedy, {variant}", "RoFormerForCausalLM", {**decoder, **config}, left, \
            {"max_new_tokens": 6, "pad_token_id": 0, "do_sample": False}, False
    sim = {**decoder, "prefix_lm": True, "add_pooling_layer": True, "pooler_activation": "linear"}
    segments = torch.tensor([[0] * 7 + [1] * 5] * 3)
    yield "prefix-LM (RoFormer-Sim), right-padded, training", "RoFormerForCausalLM", sim, \
        {**padded, "token_type_ids": segments, "labels": padded["input_ids"]}, None, True
    yield "prefix-LM (RoFormer-Sim), generate, sampled", "RoFormerForCausalLM", sim, _inputs("no padding"), \
        {"max_new_tokens": 6, "pad_token_id": 0, "do_sample": True, "top_p": 0.9}, False
    cross = {**decoder, "add_cross_attention": True}
    torch.manual_seed(1)
    encoder_states, encoder_mask = torch.randn(3, 9, SMALL["hidden_size"]), torch.ones(3, 9, dtype=torch.long)
    encoder_mask[0, 6:] = 0
    crossing = {"encoder_hidden_states": encoder_states, "encoder_attention_mask": encoder_mask}
    yield "cross-attention, right-padded, training", "RoFormerForCausalLM", cross, \
        {**padded, **crossing, "labels": padded["input_ids"]}, None, True
    yield "cross-attention, generate, greedy", "RoFormerForCausalLM", cross, {**_inputs("no padding"), **crossing}, \
        {"max_new_tokens": 5, "pad_token_id": 0, "do_sample": False}, False
    every_encoder_token = {"encoder_hidden_states": encoder_states}
    yield "cross-attention without an encoder mask, training", "RoFormerForCausalLM", cross, \
        {**padded, **every_encoder_token, "labels": padded["input_ids"]}, None, True
    yield "cross-attention without an encoder mask, eager with weights", "RoFormerForCausalLM", \
        {**cross, "attn_implementation": "eager"}, {**padded, **every_encoder_token, "output_attentions": True}, None, \
        False
    yield "causal LM, positions given, with a cache", "RoFormerForCausalLM", decoder, \
        {**_inputs("no padding"), "position_ids": torch.arange(12)[None], "use_cache": True}, None, False


def compare(old, new) -> list[tuple[str, list[str]]]:
    """Every case, with the outputs and gradients that differ between the two packages (empty: identical)."""
    results = []
    for name, class_name, config, kwargs, generate, train in cases():
        old_model, new_model = _pair(old, new, class_name, **config)
        old_out = _run(old_model, train, 0, kwargs, generate)
        new_out = _run(new_model, train, 0, kwargs, generate)
        results.append((name, _differences(old_out, new_out)))
    return results
