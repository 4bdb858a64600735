"""Input checks run once at the top of a forward, so bad input fails with a message instead of an IndexError
deep inside an embedding or a silent NaN.

Shape checks are free. Value checks (ids inside the vocabulary, ...) need one host sync for the whole batch;
they are skipped while tracing or compiling, where data-dependent Python branches are not allowed.
"""

from __future__ import annotations

import torch
from transformers.utils.import_utils import is_tracing


def _check_shape(name: str, tensor: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {expected} to match the input")


def _check_integer(name: str, tensor: torch.Tensor | None) -> None:
    if tensor is not None and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected an integer tensor (torch.long)")


def check_range(name: str, tensor: torch.Tensor, high: int, allowed: int | None = None) -> None:
    """Raises unless every value is in [0, high) (or equals `allowed`, e.g. the -100 of ignored labels)."""
    if is_tracing() or tensor.numel() == 0:
        return
    values = tensor if allowed is None else tensor.masked_fill(tensor == allowed, 0)  # 0 is always in range
    low_value, high_value = torch.stack(torch.aminmax(values)).tolist()  # the one host sync
    if low_value < 0 or high_value >= high:
        extra = f" or {allowed}" if allowed is not None else ""
        raise ValueError(f"{name} contains {low_value if low_value < 0 else high_value}; expected values in "
                         f"[0, {high}){extra}")


def check_token_labels(labels: torch.Tensor, shape: tuple[int, ...], high: int, name: str = "labels") -> None:
    """Per-token labels (MLM, token classification): the input's `(B, L)`, values in [0, high) or -100."""
    _check_shape(name, labels, shape)
    _check_integer(name, labels)
    check_range(name, labels, high, allowed=-100)


def sequence_problem_type(config, labels: torch.Tensor) -> str:
    """transformers' rule: `config.problem_type`, else regression for one label, single-label classification for
    integer labels, multi-label for float ones."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    return "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"


def check_sequence_labels(labels: torch.Tensor, config, batch_size: int) -> None:
    """Sequence classification labels, by problem type: a class (or -100, ignored) per sequence; a 0/1 target per
    sequence and label; a number per sequence and label for regression."""
    problem_type = sequence_problem_type(config, labels)
    num_labels = config.num_labels
    if problem_type == "single_label_classification":
        if labels.numel() != batch_size:
            raise ValueError(f"labels has shape {tuple(labels.shape)}; expected ({batch_size},): one class per "
                             "sequence (single_label_classification)")
        _check_integer("labels", labels)
        check_range("labels", labels, num_labels, allowed=-100)
    elif problem_type == "multi_label_classification" or num_labels > 1:
        _check_shape("labels", labels, (batch_size, num_labels))
    elif labels.numel() != batch_size:
        raise ValueError(f"labels has shape {tuple(labels.shape)}; expected ({batch_size},): a target per sequence "
                         "(regression)")


def check_choice_labels(labels: torch.Tensor, batch_size: int, num_choices: int) -> None:
    """Multiple choice: the index of the right choice per example, or -100 (ignored)."""
    _check_shape("labels", labels, (batch_size,))
    _check_integer("labels", labels)
    check_range("labels", labels, num_choices, allowed=-100)


def check_span_positions(name: str, positions: torch.Tensor, attention_mask: torch.Tensor | None,
                         shape: tuple[int, int]) -> None:
    """QA start/end positions, `(B,)` or `(B, 1)`. As in transformers, a position outside the sequence (>= L) is
    ignored; one inside must be a real token, since the padding's logits are masked out of the span; negative
    positions are refused (transformers would clamp them to 0)."""
    batch_size, seq_len = shape
    if tuple(positions.shape) not in ((batch_size,), (batch_size, 1)):
        raise ValueError(f"{name} has shape {tuple(positions.shape)}; expected ({batch_size},): one position per "
                         "sequence")
    _check_integer(name, positions)
    if is_tracing():
        return
    positions = positions.flatten()
    bad = positions < 0
    if attention_mask is not None:
        positions = positions.to(attention_mask.device)
        on_token = attention_mask.bool()[torch.arange(batch_size, device=attention_mask.device),
                                         positions.clamp(0, seq_len - 1)]
        bad = bad.to(attention_mask.device) | ((positions < seq_len) & ~on_token)
    if bad.any():  # the one host sync
        row = bad.nonzero()[0, 0].item()
        value = positions[row].item()
        expected = "positions >= 0" if value < 0 else "a real token, or a position >= seq_len to ignore the example"
        raise ValueError(f"{name}[{row}] = {value}" + ("" if value < 0 else " points at padding (attention_mask "
                                                      "is 0 there)") + f"; expected {expected}")


def check_encoder_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         past_length: int = 0) -> None:
    """Validates the inputs of `RoFormerModel.encode` against `config`; after a cache of `past_length` tokens,
    `attention_mask` covers the cached tokens too."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids or inputs_embeds (got "
                         f"{'both' if input_ids is not None else 'neither'})")
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected (batch_size, seq_len)")
        _check_integer("input_ids", input_ids)
        shape = tuple(input_ids.shape)
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.embedding_size:
            raise ValueError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; expected "
                             f"(batch_size, seq_len, {config.embedding_size}) (embedding_size)")
        shape = tuple(inputs_embeds.shape[:2])
    if 0 in shape:
        raise ValueError(f"{'input_ids' if input_ids is not None else 'inputs_embeds'} has shape {shape}: expected "
                         "at least one sequence of at least one token")
    _check_shape("attention_mask", attention_mask, (shape[0], past_length + shape[1]))
    _check_shape("token_type_ids", token_type_ids, shape)
    if position_ids is not None and tuple(position_ids.shape) not in (shape, (1, shape[1]), (shape[1],)):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; expected {shape}, "
                         f"(1, {shape[1]}) or ({shape[1]},)")
    for name, tensor in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        _check_integer(name, tensor)
    if input_ids is not None:
        check_range("input_ids", input_ids, config.vocab_size)
    if token_type_ids is not None:
        check_range("token_type_ids", token_type_ids, config.type_vocab_size)
    if position_ids is not None and not is_tracing() and position_ids.numel() and position_ids.min() < 0:
        raise ValueError(f"position_ids contains {position_ids.min().item()}; expected positions >= 0")


def check_packed_offsets(cu_seq_lens_q: torch.Tensor | None, cu_seq_lens_k: torch.Tensor | None) -> torch.Tensor | None:
    """The sequence offsets of packed rows (`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`): the two
    arguments must agree, since a token attends to its own sequence."""
    offsets = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
    if offsets is None:
        return None
    for name, tensor in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)):
        if tensor is not None and (tensor.dim() != 1 or tensor.is_floating_point()):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; expected a 1-D integer "
                             "tensor of sequence offsets")
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_q.cpu(),
                                                                                    cu_seq_lens_k.cpu()):
        raise ValueError(f"cu_seq_lens_q = {cu_seq_lens_q.tolist()} and cu_seq_lens_k = {cu_seq_lens_k.tolist()} "
                         "differ; expected the same sequence offsets (self-attention)")
    return offsets


def check_cross_attention_inputs(config, encoder_hidden_states: torch.Tensor | None,
                                 encoder_attention_mask: torch.Tensor | None, batch_size: int) -> None:
    """Cross-attention inputs: only where the config has cross-attention layers, shaped for the batch."""
    if (encoder_hidden_states is not None or encoder_attention_mask is not None) and not config.add_cross_attention:
        raise ValueError("encoder_hidden_states / encoder_attention_mask need cross-attention layers: build the "
                         "decoder with RoFormerConfig(is_decoder=True, add_cross_attention=True)")
    if encoder_hidden_states is not None:
        expected = (batch_size, encoder_hidden_states.shape[1], config.hidden_size)
        _check_shape("encoder_hidden_states", encoder_hidden_states, expected)
        _check_shape("encoder_attention_mask", encoder_attention_mask, expected[:2])


def check_prefix_segments(config, token_type_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """The segments of a prefix-LM (`config.prefix_lm`): each row's real tokens go 0 then 1 (prompt, then what follows
    it). A 0 after a 1 has no place in the mask (segment 0 would see a later token while segment 1 before it could
    not), so it is refused."""
    if config.prefix_lm and not is_tracing():
        real = torch.ones_like(token_type_ids, dtype=torch.bool) if attention_mask is None else \
            attention_mask[:, -token_type_ids.shape[1]:].bool()
        seen = token_type_ids.masked_fill(~real, 0).cummax(dim=-1).values  # the largest segment so far in each row
        if (real & (token_type_ids < seen)).any():  # the one host sync
            row = (real & (token_type_ids < seen)).any(dim=-1).nonzero()[0, 0].item()
            raise ValueError(f"token_type_ids[{row}] = {token_type_ids[row].tolist()} goes back from segment 1 to 0; "
                             "expected each row's real tokens to be segment 0 (the prefix, read bidirectionally) then "
                             "segment 1 (causal) with config.prefix_lm=True")
