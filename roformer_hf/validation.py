"""Input checks run once at the top of a forward, so bad input fails with a message instead of an IndexError
deep inside an embedding or a silent NaN.

Shape checks are free. Value checks (ids inside the vocabulary, ...) need the values on the host: a `ValueCheck`
holds the extremes on the device, and the forward reads them with everything else it needs from the device in one
copy (`plan.ForwardPlan`) before `check_values` judges them. They are skipped while tracing or compiling, where
data-dependent Python branches are not allowed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.utils.import_utils import is_tracing


def _check_shape(name: str, tensor: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {expected} to match the input")


def _check_integer(name: str, tensor: torch.Tensor | None) -> None:
    if tensor is not None and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected an integer tensor (torch.long)")


class ValueCheck(NamedTuple):
    """A range check waiting for its values: ``extremes`` ``(2,)`` int64 on the device, the smallest and largest value
    (those equal to `allowed` counted as 0); values must lie in ``[0, high)`` (``high=None``: no upper bound)."""

    name: str
    extremes: torch.Tensor
    high: int | None
    allowed: int | None = None


def value_check(name: str, tensor: torch.Tensor | None, high: int | None,
                allowed: int | None = None) -> ValueCheck | None:
    """The check that every value of `tensor` is in ``[0, high)`` (or equals `allowed`, e.g. the -100 of ignored
    labels); ``None`` when there is nothing to check, or while tracing."""
    if tensor is None or tensor.numel() == 0 or is_tracing():
        return None
    values = tensor if allowed is None else tensor.masked_fill(tensor == allowed, 0)  # 0 is always in range
    return ValueCheck(name, torch.stack(torch.aminmax(values)).long(), high, allowed)


def check_values(checks: list[ValueCheck], extremes: list[int]) -> None:
    """Judges `checks` on their extremes read to the host (two numbers per check, in order)."""
    for check, low_value, high_value in zip(checks, extremes[0::2], extremes[1::2]):
        if check.high is None:
            if low_value < 0:
                raise ValueError(f"{check.name} contains {low_value}; expected positions >= 0")
        elif low_value < 0 or high_value >= check.high:
            extra = f" or {check.allowed}" if check.allowed is not None else ""
            raise ValueError(f"{check.name} contains {low_value if low_value < 0 else high_value}; expected values in "
                             f"[0, {check.high}){extra}")


def check_range(name: str, tensor: torch.Tensor, high: int, allowed: int | None = None) -> None:
    """Raises unless every value is in [0, high) (or equals `allowed`, e.g. the -100 of ignored labels): one host
    sync."""
    if (check := value_check(name, tensor, high, allowed)) is not None:
        check_values([check], check.extremes.tolist())


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
    if bad.any():  # a host sync, with labels only
        row = bad.nonzero()[0, 0].item()
        value = positions[row].item()
        expected = "positions >= 0" if value < 0 else "a real token, or a position >= seq_len to ignore the example"
        raise ValueError(f"{name}[{row}] = {value}" + ("" if value < 0 else " points at padding (attention_mask "
                                                      "is 0 there)") + f"; expected {expected}")


def check_encoder_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                         past_length: int = 0) -> list[ValueCheck]:
    """Validates the shapes and dtypes of the inputs of `RoFormerModel.encode` against `config` (after a cache of
    `past_length` tokens, `attention_mask` covers the cached tokens too) and returns the checks of their values (ids
    in the vocabulary, positions >= 0), for `check_values` once they are on the host."""
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
    checks = (value_check("input_ids", input_ids, config.vocab_size),
              value_check("token_type_ids", token_type_ids, config.type_vocab_size),
              value_check("position_ids", position_ids, None))
    return [check for check in checks if check is not None]


def check_packed_offsets(cu_seq_lens_q: torch.Tensor | None, cu_seq_lens_k: torch.Tensor | None) -> torch.Tensor | None:
    """The sequence offsets of packed rows (`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`): 1-D integer
    tensors; the two must agree (`check_same_offsets`, once on the host), since a token attends to its own
    sequence."""
    offsets = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
    if offsets is None:
        return None
    for name, tensor in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)):
        if tensor is not None and (tensor.dim() != 1 or tensor.is_floating_point()):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; expected a 1-D integer "
                             "tensor of sequence offsets")
    return offsets


def check_same_offsets(query_offsets: list[int], key_offsets: list[int]) -> None:
    """`cu_seq_lens_q` and `cu_seq_lens_k`, read to the host, are the same offsets (self-attention)."""
    if query_offsets != key_offsets:
        raise ValueError(f"cu_seq_lens_q = {query_offsets} and cu_seq_lens_k = {key_offsets} differ; expected the "
                         "same sequence offsets (self-attention)")


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


def prefix_segment_check(config, token_type_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The segments of a prefix-LM (`config.prefix_lm`): each row's real tokens go 0 then 1 (prompt, then what follows
    it). A 0 after a 1 has no place in the mask (segment 0 would see a later token while segment 1 before it could
    not). Returns ``(B,)`` int64 on the device, 1 for a row that goes back, for `check_prefix_segments` once on the
    host; ``None`` when there is nothing to check (no prefix-LM, or tracing)."""
    if not config.prefix_lm or is_tracing():
        return None
    real = torch.ones_like(token_type_ids, dtype=torch.bool) if attention_mask is None else \
        attention_mask[:, -token_type_ids.shape[1]:].bool()
    seen = token_type_ids.masked_fill(~real, 0).cummax(dim=-1).values  # the largest segment so far in each row
    return (real & (token_type_ids < seen)).any(dim=-1).long()


def prefix_end_check(config, token_type_ids: torch.Tensor, query_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Whether a prefix-LM's real queries reach past the prefix (`token_type_ids` 1): ``(1,)`` int64 on the device, 0
    when every one sits in the prefix, where the model attends as an encoder; ``None`` when there is nothing to read
    (no prefix-LM, or tracing, which keeps the prefix's mask)."""
    if not config.prefix_lm or is_tracing():
        return None
    past = token_type_ids != 0
    if query_mask is not None:
        past = past & query_mask.bool()
    return past.any().long().reshape(1)


def check_prefix_segments(token_type_ids: torch.Tensor, goes_back: list[int]) -> None:
    """Refuses the first row that `prefix_segment_check` found going back from segment 1 to 0."""
    if any(goes_back):
        row = goes_back.index(1)
        raise ValueError(f"token_type_ids[{row}] = {token_type_ids[row].tolist()} goes back from segment 1 to 0; "
                         "expected each row's real tokens to be segment 0 (the prefix, read bidirectionally) then "
                         "segment 1 (causal) with config.prefix_lm=True")
