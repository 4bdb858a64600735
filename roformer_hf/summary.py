"""A layer-by-layer summary of a RoFormer model (output shapes, parameter counts), built on torchinfo.

torchinfo 1.8.0 counts a weight shared by two layers once per layer, so a masked-LM model, whose decoder is
tied to the word embeddings, gets `vocab_size * embedding_size` too many parameters in its total. `summary`
corrects the totals to the number of distinct parameters (`model.num_parameters()`) and says by how much.

torchinfo is optional (`pip install roformer_hf[summary]`): it is imported when a summary is made, not with the
package.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from .configuration import RoFormerConfig
from .modeling import RoFormerForMaskedLM, RoFormerForMultipleChoice, RoFormerPreTrainedModel

if TYPE_CHECKING:
    from torchinfo import ModelStatistics

logger = logging.getLogger(__name__)

# depth 4 reaches the encoder layers: model > RoFormerModel > RoFormerEncoder > ModuleList > RoFormerLayer.
DEFAULT_TORCHINFO_KWARGS = {
    "depth": 4,
    "col_names": ("output_size", "num_params"),
    "row_settings": ("depth", "var_names"),
    "verbose": 0,  # return the statistics; torchinfo would otherwise print them
}


def _import_torchinfo():
    try:
        import torchinfo
    except ImportError as error:
        raise ImportError("roformer_hf.summary needs torchinfo: pip install roformer_hf[summary]") from error
    return torchinfo


@functools.cache
def _distinct_parameter_statistics_class() -> type:
    """`DistinctParameterStatistics`, defined on first use: it subclasses torchinfo's class, so it needs torchinfo."""
    torchinfo = _import_torchinfo()

    class DistinctParameterStatistics(torchinfo.ModelStatistics):
        """torchinfo's `ModelStatistics` with each parameter counted once in the totals.

        The layer rows are torchinfo's own: a tied weight still appears in every layer that uses it. The totals
        (`total_params`, `trainable_params`, `total_param_bytes`, and so what `repr` prints) count each distinct
        parameter once, and `double_counted_params` keeps torchinfo's surplus.
        """

        def __init__(self, statistics: torchinfo.ModelStatistics, model: nn.Module):
            # Adopt the computed statistics rather than re-running torchinfo's accumulation over the layers.
            self.__dict__.update(vars(statistics))
            parameters = list(model.parameters())  # distinct tensors: shared ones are yielded once
            self.total_params = sum(p.numel() for p in parameters)
            self.trainable_params = sum(p.numel() for p in parameters if p.requires_grad)
            self.total_param_bytes = sum(p.numel() * p.element_size() for p in parameters)
            self.double_counted_params = statistics.total_params - self.total_params

        def __repr__(self) -> str:
            text = super().__repr__()
            if not self.double_counted_params:
                return text
            note = (f"Shared (tied) params, counted once in the totals but in each layer row using them: "
                    f"{self.double_counted_params:,}\n")
            marker = "Non-trainable params"
            start = text.index(marker)
            end = text.index("\n", start) + 1
            return text[:end] + note + text[end:]

    DistinctParameterStatistics.__qualname__ = "DistinctParameterStatistics"  # found by pickle via __getattr__
    return DistinctParameterStatistics


def __getattr__(name: str):
    # `roformer_hf.summary.DistinctParameterStatistics` stays importable, with torchinfo imported only then.
    if name == "DistinctParameterStatistics":
        return _distinct_parameter_statistics_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def example_inputs(model: RoFormerPreTrainedModel, batch_size: int = 1, seq_len: int = 128,
                   num_choices: int = 2) -> dict[str, torch.Tensor]:
    """Unpadded `input_ids`, `attention_mask` and `token_type_ids` of shape (batch_size, seq_len), or
    (batch_size, num_choices, seq_len) for a multiple-choice model, on the model's device."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("num_choices", num_choices)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    multiple_choice = isinstance(model, RoFormerForMultipleChoice)
    shape = (batch_size, num_choices, seq_len) if multiple_choice else (batch_size, seq_len)
    input_ids = torch.arange(torch.Size(shape).numel(), device=model.device).remainder(model.config.vocab_size)
    input_ids = input_ids.view(shape)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "token_type_ids": torch.zeros_like(input_ids),
    }


def summary(model_or_config: RoFormerPreTrainedModel | RoFormerConfig, batch_size: int = 1, seq_len: int = 128,
            **torchinfo_kwargs) -> ModelStatistics:
    """Summarize a RoFormer model layer by layer with torchinfo, running one forward pass.

    Args:
        model_or_config: any RoFormer model (bare encoder or a head), or a `RoFormerConfig`, from which a
            randomly initialised `RoFormerForMaskedLM` is built on the CPU (it needs the memory of its weights).
        batch_size, seq_len: the shape of the example input (all real tokens, no padding).
        **torchinfo_kwargs: passed to `torchinfo.summary`, overriding the defaults `depth=4`,
            `col_names=("output_size", "num_params")`, `row_settings=("depth", "var_names")`, `verbose=0`.

    Returns:
        torchinfo's statistics, whose totals count a tied weight once (`total_params ==
        model.num_parameters()`); print them for the table. Its "mult-adds" are torchinfo 1.8.0's: a Linear layer
        applied to (B, L, H) is counted for B rows, not B * L tokens, so they are far below the real count.

    Example:

    ```python
    >>> from roformer_hf import RoFormerConfig, summary
    >>> config = RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                         intermediate_size=64)
    >>> stats = summary(config, seq_len=16)
    >>> stats.total_params
    21636
    ```
    """
    torchinfo = _import_torchinfo()
    model = _as_model(model_or_config)
    kwargs = {**DEFAULT_TORCHINFO_KWARGS, **torchinfo_kwargs}
    for name in ("input_data", "input_size"):
        if name in kwargs:
            raise ValueError(f"{name} is built from batch_size and seq_len: pass those instead")
    inputs = example_inputs(model, batch_size, seq_len)
    statistics = torchinfo.summary(model, input_data=inputs, **kwargs)
    corrected = _distinct_parameter_statistics_class()(statistics, model)
    if corrected.double_counted_params:
        logger.debug("torchinfo counted %d shared parameters twice; totals corrected",
                     corrected.double_counted_params)
    return corrected


def _as_model(model_or_config: RoFormerPreTrainedModel | RoFormerConfig) -> RoFormerPreTrainedModel:
    if isinstance(model_or_config, RoFormerConfig):
        return RoFormerForMaskedLM(model_or_config)
    if isinstance(model_or_config, RoFormerPreTrainedModel):
        return model_or_config
    raise ValueError(f"model_or_config={type(model_or_config).__name__}: expected a RoFormer model or a RoFormerConfig")


__all__ = ["DistinctParameterStatistics", "example_inputs", "summary"]
