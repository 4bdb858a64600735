"""A layer-by-layer summary of a RoFormer model (output shapes, parameter counts), built on torchinfo.

torchinfo 1.8.0 counts a weight shared by two layers once per layer, so a masked-LM model, whose decoder is
tied to the word embeddings, gets `vocab_size * embedding_size` too many parameters in its total. `summary`
corrects the totals to the number of distinct parameters (`model.num_parameters()`) and says by how much.

Its mult-adds are corrected too: torchinfo 1.8.0 counts a layer's parameters once per *batch row* (a Linear
applied to (B, L, H) is counted B times, not B * L times), counts embedding lookups and norms as if they were
matrix products, leaves out attention, and prints its unit as "Units.MEGABYTES". `summary` counts the
multiply-accumulates of the matrix products: each Linear once per token it is applied to, plus attention's
scores and weighted sums.

torchinfo is optional (`pip install roformer_hf[summary]`): it is imported when a summary is made, not with the
package.
"""

from __future__ import annotations

import functools
import logging
import math
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

        def __init__(self, statistics: torchinfo.ModelStatistics, model: nn.Module, attention_mult_adds: int = 0):
            # Adopt the computed statistics rather than re-running torchinfo's accumulation over the layers.
            self.__dict__.update(vars(statistics))
            parameters = list(model.parameters())  # distinct tensors: shared ones are yielded once
            self.total_params = sum(p.numel() for p in parameters)
            self.trainable_params = sum(p.numel() for p in parameters if p.requires_grad)
            self.total_param_bytes = sum(p.numel() * p.element_size() for p in parameters)
            self.double_counted_params = statistics.total_params - self.total_params
            for layer in self.summary_list:
                layer.macs = _matrix_product_macs(layer)
            self.attention_mult_adds = attention_mult_adds
            self.total_mult_adds = attention_mult_adds + sum(
                layer.macs for layer in self.summary_list if layer.is_leaf_layer)

        def __repr__(self) -> str:
            lines = super().__repr__().split("\n")
            for index, line in enumerate(lines):
                if line.startswith("Total mult-adds"):
                    lines[index] = (f"Total mult-adds{_readable(self.total_mult_adds)}\n"
                                    f"  of which attention (scores and weighted sums, in no layer row)"
                                    f"{_readable(self.attention_mult_adds)}")
                elif line.startswith("Non-trainable params") and self.double_counted_params:
                    lines[index] += (f"\nShared (tied) params, counted once in the totals but in each layer row "
                                     f"using them: {self.double_counted_params:,}")
            return "\n".join(lines)

    DistinctParameterStatistics.__qualname__ = "DistinctParameterStatistics"  # found by pickle via __getattr__
    return DistinctParameterStatistics


def _matrix_product_macs(layer) -> int:
    """Multiply-accumulates of one torchinfo row: a Linear's weight once per token (every leading dimension of its
    output, where torchinfo 1.8.0 takes only the first); nothing for the layers that multiply no matrices
    (embedding lookups, norms, activations) nor for container rows, whose leaves are counted."""
    if not isinstance(layer.module, nn.Linear) or not layer.output_size:
        return 0
    rows = math.prod(layer.output_size[:-1])
    return rows * layer.module.in_features * layer.module.out_features


def attention_mult_adds(config: RoFormerConfig, sequences: int, seq_len: int) -> int:
    """Multiply-accumulates of attention's two matrix products (q·kᵀ and probabilities·v) over every layer, for
    `sequences` unpadded sequences of `seq_len` tokens: per layer and head, 2 * seq_len² * head_dim."""
    return 2 * config.num_hidden_layers * sequences * seq_len**2 * config.hidden_size


def _readable(count: int) -> str:
    """torchinfo's " (M): 12.35" style, with the unit as a letter."""
    unit, factor = next(((unit, factor) for unit, factor in (("T", 1e12), ("G", 1e9)) if count >= factor),
                        ("M", 1e6))
    return f" ({unit}): {count / factor:,.2f}"


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
        model.num_parameters()`); print them for the table. `total_mult_adds` counts the multiply-accumulates of
        the forward's matrix products: every Linear for every token, and attention's (`attention_mult_adds`, also
        printed); element-wise work (norms, biases, activations, the rotation) and embedding lookups are left out.

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
    sequences = math.prod(inputs["input_ids"].shape[:-1])  # (B,) or (B, num_choices)
    corrected = _distinct_parameter_statistics_class()(
        statistics, model, attention_mult_adds(model.config, sequences, seq_len))
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


# DistinctParameterStatistics comes from the module-level __getattr__.
__all__ = ["DistinctParameterStatistics", "attention_mult_adds", "example_inputs", "summary"]  # noqa: F822
