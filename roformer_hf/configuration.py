"""Configuration of roformer_hf models."""

from __future__ import annotations

import numbers
from typing import Literal

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .rotary import ROTARY_LAYOUTS, check_head_dim

NORM_POSITIONS = ("post", "pre")
DECODER_SWITCHES = ("is_decoder", "add_cross_attention")  # transformers' RoFormer has them; this encoder does not
TRANSFORMERS_MODEL_TYPE = "roformer"  # transformers' own RoFormer, whose checkpoints we load


def refuse_decoder_switches(values) -> None:
    """transformers' RoFormer configs carry decoder switches (`is_decoder`, `add_cross_attention`) that this
    bidirectional encoder does not implement: refuse them wherever they are set (a mapping, or a config)."""
    get = values.get if hasattr(values, "get") else lambda name: getattr(values, name, None)
    for switch in DECODER_SWITCHES:
        if get(switch):
            raise ValueError(f"{switch}=True is not supported: roformer_hf builds bidirectional encoders (no causal "
                             "mask, no cross-attention, no cache)")


class RoFormerConfig(PreTrainedConfig):
    r"""Configuration of a RoFormer encoder: a BERT-style encoder whose attention rotates queries and keys by
    their position (rotary position embeddings, RoPE) instead of adding absolute position embeddings.

    It accepts every field of transformers' `RoFormerConfig`, so the `config.json` of a published RoFormer
    checkpoint loads unchanged, and adds:

    - `rope_theta`: the base of the rotary frequencies, theta_i = rope_theta ** (-2i / head_dim).
    - `rotary_layout`: which dimensions rotate together. `"interleaved"` pairs (2i, 2i+1), the layout of
      RoFormer and of its published checkpoints; `"half"` pairs (i, i + head_dim/2), the "rotate-half" layout of
      GPT-NeoX, Llama-HF and ModernBERT.
    - `norm_position`: `"post"` puts the LayerNorm after each residual add (RoFormer/BERT); `"pre"` puts it
      before each sublayer and adds a final LayerNorm.
    - `unpad_inputs`: run every token-wise layer on the real tokens only when the batch is padded (faster,
      same results); `False` keeps padded tensors and masks the padding in attention.
    - `sparse_prediction`: in training with labels, run the MLM head only on labelled tokens (-100 elsewhere)
      and return only their logits; a large saving with big vocabularies.

    Positions are encoded from `position_ids` on the fly, so `max_position_embeddings` does not cap the sequence
    length. It is kept as metadata: the longest sequence the model was trained on, which tokenizers and
    pipelines use as their default truncation length.

    Example:

    ```python
    >>> from roformer_hf import RoFormerConfig, RoFormerModel
    >>> config = RoFormerConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                         intermediate_size=128)
    >>> model = RoFormerModel(config)
    >>> config.head_dim
    16
    ```
    """

    model_type = "roformer_hf"

    vocab_size: int = 50000
    embedding_size: int | None = None
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 1536
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    rotary_value: bool = False
    tie_word_embeddings: bool = True
    classifier_dropout: float | None = None
    rope_theta: float = 10000.0
    rotary_layout: Literal["interleaved", "half"] = "interleaved"
    norm_position: Literal["post", "pre"] = "post"
    unpad_inputs: bool = True
    sparse_prediction: bool = False

    def __post_init__(self, **kwargs):
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        refuse_decoder_switches(kwargs)
        for switch in DECODER_SWITCHES:
            kwargs.pop(switch, None)
        kwargs.pop("use_cache", None)
        super().__post_init__(**kwargs)
        self._check()

    def _check(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"RoFormerConfig.{name}={getattr(self, name)!r}: expected {expected}")

        for name in ("vocab_size", "embedding_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "type_vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fail(name, "a positive integer")
        if self.hidden_size % self.num_attention_heads:
            fail("num_attention_heads", f"a divisor of hidden_size={self.hidden_size}")
        try:
            check_head_dim(self.head_dim)
        except ValueError:
            fail("num_attention_heads",
                 f"a value giving an even head dimension (hidden_size / heads = {self.head_dim})")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            fail("hidden_act", f"one of transformers' activations ({', '.join(sorted(ACT2FN))})")
        if self.pad_token_id is not None and not (isinstance(self.pad_token_id, int)
                                                  and 0 <= self.pad_token_id < self.vocab_size):
            fail("pad_token_id", f"None or an id in [0, vocab_size={self.vocab_size})")
        if self.num_labels < 1:
            fail("num_labels", "at least 1")
        if self.rotary_layout not in ROTARY_LAYOUTS:
            fail("rotary_layout", f"one of {ROTARY_LAYOUTS}")
        if self.norm_position not in NORM_POSITIONS:
            fail("norm_position", f"one of {NORM_POSITIONS}")
        chunk = self.chunk_size_feed_forward
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            fail("chunk_size_feed_forward", "a non-negative integer (0: no chunking)")

        def number(value) -> bool:  # numpy scalars too
            return isinstance(value, numbers.Real) and not isinstance(value, bool)

        for name in ("rope_theta", "layer_norm_eps"):
            if not (number(getattr(self, name)) and getattr(self, name) > 0):
                fail(name, "a number > 0")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if not (number(value) and 0.0 <= value <= 1.0) and not (name == "classifier_dropout" and value is None):
                fail(name, "a probability in [0, 1]" + (" or None" if name == "classifier_dropout" else ""))

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == TRANSFORMERS_MODEL_TYPE:
            # A checkpoint of transformers' RoFormer: its fields are a subset of ours, with the same meaning.
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


__all__ = ["RoFormerConfig"]
