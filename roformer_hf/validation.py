"""Input checks run once at the top of a forward, so bad input fails with a message instead of an IndexError
deep inside an embedding or a silent NaN.

Shape checks are free. Value checks (ids inside the vocabulary, ...) need one host sync for the whole batch;
they are skipped while tracing or compiling, where data-dependent Python branches are not allowed.
"""

from __future__ import annotations

import torch


def _tracing() -> bool:
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _check_shape(name: str, tensor: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {expected} to match the input")


def _check_integer(name: str, tensor: torch.Tensor | None) -> None:
    if tensor is not None and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected an integer tensor (torch.long)")


def check_range(name: str, tensor: torch.Tensor, high: int, allowed: int | None = None) -> None:
    """Raises unless every value is in [0, high) (or equals `allowed`, e.g. the -100 of ignored labels)."""
    if _tracing() or tensor.numel() == 0:
        return
    values = tensor if allowed is None else tensor[tensor != allowed]
    if values.numel() == 0:
        return
    low_value, high_value = torch.aminmax(values)
    if low_value < 0 or high_value >= high:
        bad = low_value.item() if low_value < 0 else high_value.item()
        extra = f" or {allowed}" if allowed is not None else ""
        raise ValueError(f"{name} contains {bad}; expected values in [0, {high}){extra}")


def check_encoder_inputs(config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds) -> None:
    """Validates the inputs of `RoFormerModel.encode` against `config`."""
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
    _check_shape("attention_mask", attention_mask, shape)
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
    if position_ids is not None and not _tracing() and position_ids.numel() and position_ids.min() < 0:
        raise ValueError(f"position_ids contains {position_ids.min().item()}; expected positions >= 0")
