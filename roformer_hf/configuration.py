"""Configuration of roformer_hf models."""

from __future__ import annotations

import inspect
import logging
import numbers
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args, get_origin

import torch
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .rotary import RotaryLayout, check_head_dim, inverse_frequencies

logger = logging.getLogger(__name__)

# `norm_type`: the two spellings RoFormer configs are published with: LayerNorm (RoFormer), or RoFormer-V2's
# parameter-free RMS norm. JunnYu's `roformer` (whose V2 checkpoints carry the field; transformers' RoFormer has none)
# builds LayerNorm for "layer_norm" and its RMS norm otherwise, and its V2 configs say "rms_norm". Other spellings
# ("layernorm", "LayerNorm", "rmsnorm") appear in no published RoFormer config, so they are refused rather than
# guessed: a typo must not silently build the other model.
NormType = Literal["layer_norm", "rms_norm"]


def _roformer_frequencies(config: RoFormerConfig, device: torch.device | None = None,
                          seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """The "default" rope type: RoFormer's own frequencies (`inverse_frequencies`, in float64), attention factor 1.
    The interface of transformers' `ROPE_INIT_FUNCTIONS`."""
    return inverse_frequencies(config.head_dim, config.rope_theta, device), 1.0


class RopeType(NamedTuple):
    """A row of `ROPE_TYPES`: how a rope type of `rope_parameters` makes its frequencies and what it reads."""

    # (config, device, longest sequence or None) -> the frequencies theta (d/2,) and the attention factor
    init: Callable[..., tuple[torch.Tensor, float]]
    reads: tuple[str, ...] = ()  # keys it reads besides `rope_type`, `rope_theta` and `partial_rotary_factor`
    requires: tuple[str, ...] = ()  # those it cannot do without
    adapts_to_length: bool = False  # its frequencies follow the batch's longest sequence


# The one table of rope types: RoFormer's own frequencies for "default", transformers' `ROPE_INIT_FUNCTIONS` for the
# others; each key they read is checked by `ROPE_KEY_CHECKS`.
ROPE_TYPES = {
    "default": RopeType(_roformer_frequencies),
    "linear": RopeType(ROPE_INIT_FUNCTIONS["linear"], reads=("factor",), requires=("factor",)),
    "dynamic": RopeType(ROPE_INIT_FUNCTIONS["dynamic"], reads=("factor",), requires=("factor",),
                        adapts_to_length=True),
    "yarn": RopeType(ROPE_INIT_FUNCTIONS["yarn"],
                     reads=("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                            "beta_slow", "mscale", "mscale_all_dim", "truncate"),
                     requires=("factor",)),
    "longrope": RopeType(ROPE_INIT_FUNCTIONS["longrope"],
                         reads=("short_factor", "long_factor", "original_max_position_embeddings", "factor",
                                "attention_factor"),
                         requires=("short_factor", "long_factor"), adapts_to_length=True),
    "llama3": RopeType(ROPE_INIT_FUNCTIONS["llama3"],
                       reads=("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                       requires=("factor", "low_freq_factor", "high_freq_factor")),
}


def _positive(value, *context) -> bool:  # numpy scalars too; `context`: the rope parameters and head_dim / 2
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


def _at_least_one(value, *context) -> bool:
    return _positive(value) and value >= 1


def _count(value, *context) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def _flag(value, *context) -> bool:
    return isinstance(value, bool)


def _above_low_freq_factor(value, params: dict, half: int) -> bool:
    return _positive(value) and value > (params.get("low_freq_factor") or 0.0)


def _factors(value, params: dict, half: int) -> bool:
    return isinstance(value, list) and len(value) == half and all(_positive(x) for x in value)


def _one(value, *context) -> bool:
    return value == 1


# What each key of `rope_parameters` must hold: `valid(value, rope_parameters, head_dim // 2)`, and what is expected.
ROPE_KEY_CHECKS = {
    "rope_theta": (_positive, "a number > 0"),
    "factor": (_at_least_one, "a number >= 1"),
    "original_max_position_embeddings": (_count, "a positive integer (the training length)"),
    "attention_factor": (_positive, "a number > 0"),
    "beta_fast": (_positive, "a number > 0"),
    "beta_slow": (_positive, "a number > 0"),
    "mscale": (_positive, "a number > 0"),
    "mscale_all_dim": (_positive, "a number > 0"),
    "truncate": (_flag, "True or False"),
    "low_freq_factor": (_positive, "a number > 0"),
    "high_freq_factor": (_above_low_freq_factor, "a number > low_freq_factor"),
    "short_factor": (_factors, "a list of {half} numbers > 0 (head_dim / 2)"),
    "long_factor": (_factors, "a list of {half} numbers > 0 (head_dim / 2)"),
    "partial_rotary_factor": (_one, "1.0: roformer_hf rotates whole heads"),
}

TRANSFORMERS_MODEL_TYPE = "roformer"  # transformers' own RoFormer, whose checkpoints we load


def _copied_rope_parameters(given, name: str) -> dict | None:
    """A copy of rope parameters as given (transformers fills them in place), which must be a dict; the legacy
    spelling `type` becomes `rope_type`."""
    if given is None:
        return None
    if not isinstance(given, dict):
        raise ValueError(f"RoFormerConfig.{name}={given!r}: expected a dict such as {{'rope_type': 'linear', "
                         "'factor': 2.0}")
    params = dict(given)
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    return params


class RoFormerConfig(PreTrainedConfig):
    r"""Configuration of a RoFormer encoder: a BERT-style encoder whose attention rotates queries and keys by
    their position (rotary position embeddings, RoPE) instead of adding absolute position embeddings.

    It accepts every field of transformers' `RoFormerConfig`, so the `config.json` of a published RoFormer
    checkpoint loads unchanged, and adds the ones after `tie_word_embeddings` below. `docs/reference.md` tabulates
    these attributes with their types and defaults (generated from this class: `python docs/make_reference.py`).

    Attributes:
        vocab_size: the number of tokens the embeddings and the MLM head know.
        embedding_size: the width of the token embeddings; a dense layer (`embeddings_project`) maps them to
            `hidden_size` when they differ. Default: `hidden_size`.
        hidden_size: the width of the hidden states.
        num_hidden_layers: the number of encoder layers.
        num_attention_heads: query heads per attention layer; `head_dim = hidden_size / num_attention_heads`.
        intermediate_size: the width of the feed-forward's inner layer.
        hidden_act: the feed-forward's activation, a name of transformers' `ACT2FN` (`"gelu"`; RoFormer-V2 `"relu"`).
        hidden_dropout_prob: dropout on the embeddings and on each sublayer's output.
        attention_probs_dropout_prob: dropout on the attention weights (in training).
        max_position_embeddings: the longest sequence the model was trained on: not a cap (positions are rotated on
            the fly), but the default truncation length of tokenizers and pipelines and the length `"dynamic"` rope
            scaling compares with.
        type_vocab_size: the number of segments (`token_type_ids`).
        initializer_range: the standard deviation of the initial weights.
        layer_norm_eps: the epsilon of every norm.
        pad_token_id: the padding token's id (its embedding row starts at zero).
        rotary_value: rotate the values too, as some RoFormer checkpoints do (`roformer_small_discriminator`).
        tie_word_embeddings: the MLM and causal-LM heads' decoder shares the word embeddings.
        classifier_dropout: dropout before the task heads' classifiers; default `hidden_dropout_prob`.
        classifier_pooling: what `RoFormerForSequenceClassification` classifies: `"cls"`, the first token's state
            (BERT, transformers' RoFormer), or `"mean"`, the mean of the real tokens' states (ModernBERT's option of
            the same name), which fine-tunes faster when the label lies in the whole text.
        rope_parameters: the rotary frequencies, in transformers 5's format (as Llama's): `{"rope_type": "default",
            "rope_theta": 10000.0}` by default, theta_i = rope_theta ** (-2i / head_dim). Other `rope_type`s stretch
            them for inputs longer than training (`factor`): `"linear"`, `"dynamic"` (NTK scaling that grows with
            the longest sequence of each batch beyond `max_position_embeddings`), `"yarn"`, `"longrope"`
            (`short_factor`, `long_factor`), `"llama3"` (`low_freq_factor`, `high_freq_factor`);
            `original_max_position_embeddings` defaults to `max_position_embeddings`. The frequencies are those of
            transformers' `ROPE_INIT_FUNCTIONS`; the legacy `rope_scaling` key is read into it, and `rope_theta` is
            a view of `rope_parameters["rope_theta"]`.
        num_key_value_heads: grouped-query attention: key/value heads, each shared by `num_attention_heads /
            num_key_value_heads` query heads (default: `num_attention_heads`; 1: multi-query).
        use_bias: whether the encoder's dense layers (attention projections, feed-forward) have biases. The
            embedding projection and the task heads always have them, as in RoFormer-V2.
        norm_type: `"layer_norm"` (RoFormer), or `"rms_norm"`, RoFormer-V2's parameter-free RMS norm `x /
            sqrt(mean(x^2) + layer_norm_eps)`, in the same places. Its MLM head is the tied decoder alone, so
            `embedding_size` must equal `hidden_size` there (`check_mlm_head`). RoFormer-V2 is `use_bias=False,
            norm_type="rms_norm", hidden_act="relu"`, as its config.json says.
        pooler_activation: the activation of BERT's pooler (`add_pooling_layer`): `"tanh"`; RoFormer-Sim `"linear"`.
        is_decoder: causal self-attention with a cache of keys and values (`RoFormerForCausalLM`, `generate()`).
        add_cross_attention: decoders only: a cross-attention sublayer in every layer, on an encoder's states
            (`EncoderDecoderModel`), named as in transformers' RoFormer (`crossattention`).
        use_cache: decoders return the cache outside training.
        prefix_lm: decoders only: the UniLM mask of RoFormer-Sim: tokens of segment 0 (`token_type_ids`) see each
            other bidirectionally, tokens of segment 1 the prefix and the tokens before them; a row's segments go 0
            then 1. A folder of JunnYu's RoFormer-Sim (config.json with `is_decoder` and `pooler_activation`) loads
            with it and `add_pooling_layer` on.
        add_pooling_layer: BERT's pooler (`roformer.pooler.dense`): `pooler_output = pooler_activation(dense(first
            token))`, for sentence embeddings (RoFormer-Sim ranks its generations by it).
        rotary_layout: which dimensions rotate together: `"interleaved"` pairs (2i, 2i+1), RoFormer's layout and
            that of its published checkpoints; `"half"` pairs (i, i + head_dim/2), the rotate-half layout of GPT-NeoX,
            Llama-HF and ModernBERT.
        norm_position: `"post"` normalises after each residual add (RoFormer, BERT); `"pre"` before each sublayer,
            with a final norm.
        unpad_inputs: run every token-wise layer on the real tokens only when the batch is padded (faster, the same
            results); `False` keeps padded tensors and masks the padding in attention.
        sparse_prediction: in training with labels, run the MLM head on the labelled tokens only (-100 elsewhere)
            and return only their logits; a large saving with big vocabularies. The last layer's queries are then
            those tokens only too (every token still a key and value), where nothing else reads its output.

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
    >>> # RoFormer-V2, with two key/value heads and YaRN scaling for inputs up to 4x the training length:
    >>> v2 = RoFormerConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    ...                     intermediate_size=128, use_bias=False, norm_type="rms_norm", hidden_act="relu",
    ...                     num_key_value_heads=2, max_position_embeddings=512,
    ...                     rope_parameters={"rope_type": "yarn", "factor": 4.0})
    >>> v2.rope_parameters["original_max_position_embeddings"], v2.rope_theta
    (512, 10000.0)
    >>> RoFormerModel(v2).encoder.layer[0].attention.self.key.weight.shape  # 2 heads of 16
    torch.Size([32, 64])
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
    classifier_pooling: Literal["cls", "mean"] = "cls"
    rope_parameters: dict | None = None
    num_key_value_heads: int | None = None
    use_bias: bool = True
    norm_type: NormType = "layer_norm"
    pooler_activation: str = "tanh"
    is_decoder: bool = False
    add_cross_attention: bool = False
    use_cache: bool = True
    prefix_lm: bool = False
    add_pooling_layer: bool = False
    rotary_layout: RotaryLayout = "interleaved"
    norm_position: Literal["post", "pre"] = "post"
    unpad_inputs: bool = True
    sparse_prediction: bool = False

    def __post_init__(self, **kwargs):
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._take_rope_parameters(kwargs)
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
        kv_heads = self.num_key_value_heads
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or \
                self.num_attention_heads % kv_heads:
            fail("num_key_value_heads", f"a positive divisor of num_attention_heads={self.num_attention_heads}")
        try:
            check_head_dim(self.head_dim)
        except ValueError:
            fail("num_attention_heads",
                 f"a value giving an even head dimension (hidden_size / heads = {self.head_dim})")
        for name in ("hidden_act", "pooler_activation"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in ACT2FN:
                fail(name, f"one of transformers' activations ({', '.join(sorted(ACT2FN))})")
        for name in ("use_bias", "rotary_value", "is_decoder", "add_cross_attention", "use_cache", "prefix_lm",
                     "add_pooling_layer"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "True or False")
        for name in ("add_cross_attention", "prefix_lm"):
            if getattr(self, name) and not self.is_decoder:
                fail(name, "False unless is_decoder=True (it describes a decoder's attention)")
        for name, annotation in inspect.get_annotations(RoFormerConfig, eval_str=True).items():
            if get_origin(annotation) is Literal and getattr(self, name) not in get_args(annotation):
                fail(name, f"one of {get_args(annotation)}")  # the field's one list of values: its `Literal` type
        if self.pad_token_id is not None and not (isinstance(self.pad_token_id, int)
                                                  and 0 <= self.pad_token_id < self.vocab_size):
            fail("pad_token_id", f"None or an id in [0, vocab_size={self.vocab_size})")
        if self.num_labels < 1:
            fail("num_labels", "at least 1")
        chunk = self.chunk_size_feed_forward
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            fail("chunk_size_feed_forward", "a non-negative integer (0: no chunking)")

        def number(value) -> bool:  # numpy scalars too
            return isinstance(value, numbers.Real) and not isinstance(value, bool)

        if not (number(self.layer_norm_eps) and self.layer_norm_eps > 0):
            fail("layer_norm_eps", "a number > 0")
        self._check_rope_parameters()
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if not (number(value) and 0.0 <= value <= 1.0) and not (name == "classifier_dropout" and value is None):
                fail(name, "a probability in [0, 1]" + (" or None" if name == "classifier_dropout" else ""))

    def _take_rope_parameters(self, kwargs: dict) -> None:
        """Before transformers standardises them (`convert_rope_params_to_dict`): the rope parameters given
        (`rope_parameters`, or the legacy `rope_scaling`, which wins as in transformers), and no second value of
        `rope_theta` beside the one inside them."""
        name = "rope_scaling" if kwargs.get("rope_scaling") else "rope_parameters"
        self.rope_parameters = _copied_rope_parameters(kwargs.pop("rope_scaling", None) or self.rope_parameters, name)
        inner, outer = (self.rope_parameters or {}).get("rope_theta"), kwargs.get("rope_theta")
        if inner is not None and outer is not None and inner != outer:
            raise ValueError(f"RoFormerConfig.rope_theta={outer!r} disagrees with rope_parameters['rope_theta']="
                             f"{inner!r}: give the base once (rope_parameters['rope_theta'] is where it lives)")

    def __setattr__(self, name, value):
        # Rope parameters set on a built config (`from_pretrained(folder, rope_parameters={...})` sets them on the
        # loaded one) keep its rope_theta unless they name one, and are completed and checked as at construction.
        if name != "rope_parameters" or not self.__dict__.get("_post_init_done") or value is self.__dict__.get(name):
            return super().__setattr__(name, value)  # (transformers' standardisation sets the same dict back)
        previous = self.__dict__.get("rope_parameters") or {}
        value = _copied_rope_parameters(value, name) or {}
        value.setdefault("rope_theta", previous.get("rope_theta", self.default_theta))
        super().__setattr__(name, value)
        try:
            self.standardize_rope_params()
            self._check_rope_parameters()
        except ValueError:
            super().__setattr__(name, previous)
            raise

    def _check_rope_parameters(self) -> None:
        """Refuses rope parameters that transformers' rope functions would misread, naming the key."""
        params = self.rope_parameters

        def fail(key: str, expected: str) -> None:
            raise ValueError(f"RoFormerConfig.rope_parameters[{key!r}]={params.get(key)!r}: expected {expected}")

        rope_type = params.get("rope_type")
        if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
            fail("rope_type", f"one of {tuple(ROPE_TYPES)}")
        read = {"rope_type", "rope_theta", "partial_rotary_factor", *ROPE_TYPES[rope_type].reads}
        unread = sorted(set(params) - read)
        if unread:  # as transformers' rope validation: kept in the config, warned about, and never read
            logger.warning("RoFormerConfig.rope_parameters has %s, which rope_type=%r does not read: ignored (it reads "
                           "%s)", unread, rope_type, sorted(read))
        for key in (*ROPE_TYPES[rope_type].requires, "rope_theta"):
            if params.get(key) is None:
                fail(key, f"a value: rope_type={rope_type!r} needs it")
        for key, (valid, expected) in ROPE_KEY_CHECKS.items():
            if key in read and params.get(key) is not None and not valid(params[key], params, self.head_dim // 2):
                fail(key, expected.format(half=self.head_dim // 2))

    @property
    def rope_theta(self) -> float:
        """The base of the rotary frequencies: `rope_parameters["rope_theta"]`, their one home."""
        return (self.rope_parameters or {}).get("rope_theta", self.default_theta)

    @rope_theta.setter
    def rope_theta(self, value: float) -> None:
        self.rope_parameters = {**(self.rope_parameters or {}), "rope_theta": value}

    @property
    def uses_layer_norm(self) -> bool:
        """LayerNorm (RoFormer), or RoFormer-V2's parameter-free RMS norm (`norm_type="rms_norm"`)."""
        return self.norm_type == "layer_norm"

    def check_mlm_head(self) -> None:
        """RoFormer-V2's MLM head (a `norm_type` other than LayerNorm) is the tied decoder alone, with no transform:
        the hidden states must have the embeddings' size. The MLM head asks; the encoder and the other heads take
        any `embedding_size`."""
        if not self.uses_layer_norm and self.embedding_size != self.hidden_size:
            raise ValueError(f"RoFormerConfig.embedding_size={self.embedding_size}: expected hidden_size="
                             f"{self.hidden_size} with norm_type={self.norm_type!r}: RoFormer-V2's MLM head has no "
                             "transform to map hidden states to the embeddings' size")

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == TRANSFORMERS_MODEL_TYPE:
            # A checkpoint of transformers' RoFormer: its fields are a subset of ours, with the same meaning.
            config_dict = {**config_dict, "model_type": cls.model_type}
            if config_dict.get("is_decoder") and "pooler_activation" in config_dict:
                # JunnYu's RoFormerForCausalLM (RoFormer-Sim), whose config class alone writes pooler_activation: a
                # pooler, and the prompt read bidirectionally as the prefix of what it generates.
                config_dict.setdefault("prefix_lm", True)
                config_dict.setdefault("add_pooling_layer", True)
        return config_dict, kwargs

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


__all__ = ["RoFormerConfig"]
