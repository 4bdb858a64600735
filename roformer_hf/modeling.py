"""RoFormer encoder and task heads as transformers models.

Module and parameter names follow transformers' RoFormer (`roformer.encoder.layer.N.attention.self.query`, ...),
so its checkpoints load unchanged and ours load in it; only its frozen sinusoidal table
(`encoder.embed_positions.weight`) is dropped, since positions are rotated on the fly from `position_ids`.
RoFormer-V2 (`use_bias=False`, `norm_type="rms_norm"`) is the same model with fewer parameters, laid out as in
JunnYu's `roformer` package, which published its checkpoints.

Shapes: B batch, L sequence length, N real (unpadded) tokens, H hidden size, nh heads, d head size, and
T the token shape of the batch's layout: (N,) when padding is skipped, else (B, L).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .attention import attend
from .blocked_dropout import dropout
from .cache import CacheState, cached_cross_attention, generation_cache, past_length, update_layer
from .configuration import ROPE_TYPES, RoFormerConfig
from .fused import fused_linear, fused_linears, one_forward
from .loading import CheckpointPolicy
from .loss import masked_lm_loss
from .masks import AttentionMask
from .padding import BatchLayout, logits_in_padded_layout
from .plan import ForwardPlan
from .rotary import rotary_phases, rotate
from .validation import (
    check_choice_labels,
    check_sequence_labels,
    check_span_positions,
    check_token_labels,
    sequence_problem_type,
)

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

logger = logging.getLogger(__name__)


def linear(config: RoFormerConfig, in_features: int, out_features: int) -> nn.Linear:
    """Every dense layer of the encoder blocks (attention projections, feed-forward): the one place that decides
    whether they carry a bias (`config.use_bias`; RoFormer-V2 has none). The embedding projection and the task heads
    keep theirs in V2 too, as in its checkpoints: they are plain `nn.Linear`s."""
    return nn.Linear(in_features, out_features, bias=config.use_bias)


def norm(config: RoFormerConfig, size: int) -> nn.Module:
    """Every normalisation layer of the encoder and its heads: LayerNorm (RoFormer, BERT), or RoFormer-V2's
    parameter-free RMS norm ``x / sqrt(mean(x^2) + eps)`` for `config.norm_type="rms_norm"`."""
    if config.uses_layer_norm:
        return nn.LayerNorm(size, eps=config.layer_norm_eps)
    return nn.RMSNorm(size, eps=config.layer_norm_eps, elementwise_affine=False)


class RoFormerEmbeddings(nn.Module):
    """Word and token-type embeddings, norm and dropout; no position embeddings (attention rotates)."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = norm(config, config.embedding_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor,
                inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        return dropout(self.dropout, self.LayerNorm(embeddings))


class Rotation(NamedTuple):
    """The rotary embedding of a batch, computed once per forward (`RoFormerRotaryEmbedding`) for every layer."""

    phases: torch.Tensor  # rotary_phases: (*T, 1, d/2, 2)
    attention_factor: float = 1.0  # YaRN, LongRoPE: scales the rotated queries and keys (transformers' cos and sin)
    turns: torch.Tensor | None = None  # the phases as complex64, for `rotate` in eager mode (None while tracing)

    @property
    def for_rotate(self) -> torch.Tensor:
        return self.phases if self.turns is None else self.turns


class RoFormerRotaryEmbedding(nn.Module):
    """The rotation of every position of a batch, for the rope type of `config.rope_parameters` (a row of
    `configuration.ROPE_TYPES`): RoFormer's own frequencies (`inverse_frequencies`, in float64) for ``"default"``,
    else those of transformers' ``ROPE_INIT_FUNCTIONS``. Types that adapt to the input (``"dynamic"``,
    ``"longrope"``) see the batch's longest sequence: its largest real position + 1. No parameters, no buffers: the
    frequencies are computed per forward (a few dozen numbers), so nothing stale survives loading.

    The model calls `rotation` (phases in the batch's layout, and the attention factor apart, so that rotated values
    stay unscaled); `forward` is transformers' interface for a rotary module (`LlamaRotaryEmbedding`):
    ``(cos, sin)``, each ``(B, L, d/2)``, times the attention factor.
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.config = config

    def frequencies(self, device: torch.device | None = None,
                    longest: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """The rotation speeds theta ``(d/2,)`` and the attention factor; `longest`: a 0-d tensor, for the rope types
        that adapt to the length (``None``: the training length)."""
        init = ROPE_TYPES[self.config.rope_parameters["rope_type"]].init
        inv_freq, attention_factor = init(self.config, device, longest)
        return inv_freq, float(attention_factor)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The frequencies at the training length (transformers' name)."""
        return self.frequencies()[0]

    def rotation(self, position_ids: torch.Tensor, layout: BatchLayout) -> Rotation:
        """The rotation of the batch's `(B, L)` positions, in the layout's token shape."""
        longest = None
        if ROPE_TYPES[self.config.rope_parameters["rope_type"]].adapts_to_length:
            real = position_ids if layout.token_mask is None else position_ids.masked_fill(~layout.token_mask, 0)
            longest = real.max() + 1
        inv_freq, attention_factor = self.frequencies(position_ids.device, longest)
        phases = rotary_phases(layout.gather_tokens(position_ids), inv_freq).unsqueeze(-3)  # (*T, 1, d/2, 2)
        tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()  # no complex numbers there
        return Rotation(phases, attention_factor, None if tracing else torch.view_as_complex(phases))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' interface: ``(cos, sin)`` of `position_ids` ``(B, L)``, each ``(B, L, d/2)`` in `x`'s dtype,
        scaled by the attention factor as transformers' rotary modules scale them."""
        layout = BatchLayout.from_attention_mask(None, *position_ids.shape)
        rotation = self.rotation(position_ids.to(x.device), layout)
        cos, sin = (rotation.phases.squeeze(-3) * rotation.attention_factor).unbind(-1)
        return cos.to(x.dtype), sin.to(x.dtype)


class RoFormerSelfAttention(nn.Module):
    """Multi-head attention with rotary queries and keys (and values when `config.rotary_value`).

    Project, rotate, update the cache (`past_key_values.update(k, v, self.layer_idx)`), attend (`attention.attend`,
    with the kernel of `config._attn_implementation`), reshape. As cross-attention (`is_cross_attention`, in decoders
    with `config.add_cross_attention`) keys and values come from the encoder and nothing rotates, as in transformers'
    RoFormer. Returns the context `(*T, H)` (`(M, H)` when the mask's `queries` are some tokens only) and, from the
    eager kernel only, the weights `(B, nh, L, Lk)`.
    """

    def __init__(self, config: RoFormerConfig, layer_idx: int | None = None, is_cross_attention: bool = False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.is_causal = config.is_decoder and not is_cross_attention  # read by every attention kernel
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads  # query heads per key/value head
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.rotary_layout, self.rotary_value = config.rotary_layout, config.rotary_value
        self.attention_dropout = config.attention_probs_dropout_prob
        self.query = linear(config, config.hidden_size, config.hidden_size)
        self.key = linear(config, config.hidden_size, self.num_key_value_heads * self.head_dim)
        self.value = linear(config, config.hidden_size, self.num_key_value_heads * self.head_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (*T, H)
        attention_mask: AttentionMask,
        position_embeddings: Rotation | None = None,
        past_key_values: Cache | None = None,
        cache_state: CacheState = CacheState(),
        encoder_hidden_states: torch.Tensor | None = None,  # (B, Lk, H), cross-attention
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        heads, key_value_heads = (self.num_heads, self.head_dim), (self.num_key_value_heads, self.head_dim)
        if self.is_cross_attention:  # keys and values from the encoder, not rotated
            query = fused_linear(self.query, hidden_states).unflatten(-1, heads)  # (*T, nh, d)
            if cache_state.cross_attention_filled:  # projected once per generation
                key, value = cached_cross_attention(past_key_values, self.layer_idx)  # (B, Lk, nkv, d)
            else:
                key, value = (t.unflatten(-1, key_value_heads)
                              for t in fused_linears((self.key, self.value), encoder_hidden_states))
                key, value = update_layer(past_key_values, self.layer_idx, key, value, cross_attention=True)
        else:
            phases = position_embeddings.for_rotate
            if attention_mask.queries is None:
                query, key, value = fused_linears((self.query, self.key, self.value), hidden_states)
                if attention_mask.few_tokens is not None:  # rotation and attention in one call (`few_rows.attention`)
                    factor = position_embeddings.attention_factor
                    return attention_mask.few_tokens(query, key, value, position_embeddings.phases, self.num_heads,
                                                     self.scaling * factor**2, self.rotary_layout,
                                                     self.rotary_value), None
                query_phases = phases
            else:  # only some tokens query: (M, nh, d), projected and rotated alone
                query = fused_linear(self.query, attention_mask.select_queries(hidden_states))
                key, value = fused_linears((self.key, self.value), hidden_states)
                query_phases = attention_mask.select_queries(phases)
            query = query.unflatten(-1, heads)  # (*T, nh, d)
            key, value = key.unflatten(-1, key_value_heads), value.unflatten(-1, key_value_heads)  # (*T, nkv, d)
            query, key = rotate(query, query_phases, self.rotary_layout), rotate(key, phases, self.rotary_layout)
            if self.rotary_value:
                value = rotate(value, phases, self.rotary_layout)
            # With a cache the layout is padded, (B, L, nkv, d); after the update (B, past + L, nkv, d).
            key, value = update_layer(past_key_values, self.layer_idx, key, value)

        dropout = self.attention_dropout if self.training else 0.0
        # The attention factor scales rotated queries and keys alike, hence the scores by its square; applied here,
        # it leaves rotated values (`rotary_value`) unscaled.
        factor = 1.0 if self.is_cross_attention else position_embeddings.attention_factor
        output, weights = attend(self, query, key, value, attention_mask, self.scaling * factor**2, dropout, **kwargs)
        return output.flatten(-2), weights  # (*T, H)


class RoFormerResidual(nn.Module):
    """The output side of a sublayer: projection, dropout, residual add and norm.

    Post-norm (RoFormer, BERT) normalises after the add; pre-norm normalises the sublayer's input instead
    (`normalize_input`) and leaves the residual stream untouched.
    """

    def __init__(self, config: RoFormerConfig, in_features: int):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.dense = linear(config, in_features, config.hidden_size)
        self.LayerNorm = norm(config, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def normalize_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(hidden_states) if self.pre_norm else hidden_states

    def forward(self, sublayer_output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden_states = fused_linear(self.dense, sublayer_output, self.dropout, residual)
        return hidden_states if self.pre_norm else self.LayerNorm(hidden_states)


class RoFormerAttention(nn.Module):
    """Attention sublayer: `self` (rotary attention) and `output` (projection, residual, norm)."""

    def __init__(self, config: RoFormerConfig, layer_idx: int | None = None, is_cross_attention: bool = False):
        super().__init__()
        self.self = RoFormerSelfAttention(config, layer_idx, is_cross_attention)
        self.output = RoFormerResidual(config, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: AttentionMask,
                **kwargs: Unpack[TransformersKwargs]) -> torch.Tensor:
        context, _ = self.self(self.output.normalize_input(hidden_states), attention_mask, **kwargs)
        return self.output(context, attention_mask.select_queries(hidden_states))


class RoFormerIntermediate(nn.Module):
    """First half of the feed-forward: expansion to `intermediate_size` and the activation."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.dense = linear(config, config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return fused_linear(self.dense, hidden_states, self.intermediate_act_fn)


class RoFormerLayer(GradientCheckpointingLayer):
    """One block: attention sublayer, cross-attention sublayer (`crossattention`, decoders with
    `config.add_cross_attention`), then feed-forward sublayer (`intermediate` + `output`).

    With `config.chunk_size_feed_forward = n > 0` the feed-forward runs on `n` tokens at a time (as in
    transformers): the same result, with the `intermediate_size`-wide activation only `n` tokens long.
    """

    def __init__(self, config: RoFormerConfig, layer_idx: int | None = None):
        super().__init__()
        self.attention = RoFormerAttention(config, layer_idx)
        if config.add_cross_attention:
            self.crossattention = RoFormerAttention(config, layer_idx, is_cross_attention=True)
        self.intermediate = RoFormerIntermediate(config)
        self.output = RoFormerResidual(config, config.intermediate_size)
        self.chunk_size_feed_forward = config.chunk_size_feed_forward

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # token-wise: (*T, H) -> (*T, H)
        expanded = self.intermediate(self.output.normalize_input(hidden_states))
        return self.output(expanded, hidden_states)

    def forward(self, hidden_states: torch.Tensor, attention_mask: AttentionMask,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: AttentionMask | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> torch.Tensor:
        hidden_states = self.attention(hidden_states, attention_mask, **kwargs)
        if encoder_hidden_states is not None:
            hidden_states = self.crossattention(hidden_states, encoder_attention_mask,
                                                encoder_hidden_states=encoder_hidden_states, **kwargs)
        chunk = self.chunk_size_feed_forward
        if chunk and hidden_states.shape[-2] > chunk:  # tokens are dim -2: (N, H) or (B, L, H)
            return torch.cat([self.feed_forward(part) for part in hidden_states.split(chunk, dim=-2)], dim=-2)
        return self.feed_forward(hidden_states)


class RoFormerEncoder(nn.Module):
    """The stack of layers, plus the final norm of pre-norm models."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.layer = nn.ModuleList(RoFormerLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers))
        if config.norm_position == "pre":
            self.final_layer_norm = norm(config, config.hidden_size)
        self.gradient_checkpointing = False

    def forward(self, hidden_states: torch.Tensor, attention_mask: AttentionMask,
                last_layer_mask: AttentionMask | None = None, **kwargs: Unpack[TransformersKwargs]) -> torch.Tensor:
        """`last_layer_mask`, when given, is the last layer's: some tokens as its only queries
        (`masks.query_subset_mask`), whose states alone it returns, `(M, H)`."""
        last = len(self.layer) - 1
        for index, layer in enumerate(self.layer):
            mask = last_layer_mask if index == last and last_layer_mask is not None else attention_mask
            hidden_states = layer(hidden_states, mask, **kwargs)
        if hasattr(self, "final_layer_norm"):
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class RoFormerPooler(nn.Module):
    """BERT's pooler (`roformer.pooler.dense`): dense and `config.pooler_activation` on each sequence's first token,
    `(B, H)`. RoFormer-Sim ranks the sentences it generates by it."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACT2FN[config.pooler_activation]

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(first_tokens))


@dataclass
class RoFormerEncoding(ModelOutput):
    """What `RoFormerModel.encode` hands to the heads.

    Attributes:
        last_hidden_state: `(*T, H)`, in the batch's layout: only the real tokens when padding is skipped; `(M, H)`,
            the `read_tokens` only, when the caller asked for some.
        layout: where those tokens sit in the `(B, L)` batch (`layout.scatter_tokens` puts them back).
        read_tokens: `(M,)` flat positions among the layout's tokens of the states in `last_hidden_state`, when the
            last layer computed the `read_tokens` passed to `encode` only; `None`: all of them.
        pooler_output: `(B, H)`, the pooler on each sequence's first token (`config.add_pooling_layer`).
        past_key_values: the cache, updated with this forward's keys and values (decoders with `use_cache`).
        hidden_states: `(B, L, H)` each, the embeddings' output and every layer's, when requested.
        attentions: `(B, nh, L, Lk)` each, when requested; `cross_attentions` the same for cross-attention.
    """

    last_hidden_state: torch.Tensor | None = None
    layout: BatchLayout | None = None
    pooler_output: torch.Tensor | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None
    read_tokens: torch.Tensor | None = None


class RoFormerPreTrainedModel(CheckpointPolicy, PreTrainedModel):
    """Weight initialisation, capabilities and checkpoint policy (`loading.py`) shared by all RoFormer models."""

    config_class = RoFormerConfig
    config: RoFormerConfig
    base_model_prefix = "roformer"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["RoFormerEmbeddings", "RoFormerLayer"]
    # transformers' RoFormer stores its frozen sinusoidal table; rotary angles are computed on the fly here.
    _keys_to_ignore_on_load_unexpected = [r"encoder\.embed_positions\.weight"]
    # transformers' output capture: every layer's output, and the weights the eager attention returns.
    _can_record_outputs = {
        "hidden_states": RoFormerLayer,
        "attentions": OutputRecorder(RoFormerSelfAttention, index=1, layer_name="attention"),
        "cross_attentions": OutputRecorder(RoFormerSelfAttention, index=1, layer_name="crossattention"),
    }

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        # transformers looks for its attention interface in this file's source; the dispatch lives in attention.py.
        return True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RoFormerLMPredictions) and hasattr(module, "bias"):
            init.zeros_(module.bias)


class RoFormerModel(RoFormerPreTrainedModel):
    """The bare RoFormer encoder, returning hidden states.

    Example, a padded batch:

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerModel
    >>> model = RoFormerModel(RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                                      num_attention_heads=4, intermediate_size=64))
    >>> out = model(torch.tensor([[2, 5, 7, 3, 0]]), attention_mask=torch.tensor([[1, 1, 1, 1, 0]]))
    >>> out.last_hidden_state.shape
    torch.Size([1, 5, 32])
    ```
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.embeddings = RoFormerEmbeddings(config)
        if config.embedding_size != config.hidden_size:
            self.embeddings_project = nn.Linear(config.embedding_size, config.hidden_size)
        self.rotary_emb = RoFormerRotaryEmbedding(config)
        self.encoder = RoFormerEncoder(config)
        if config.add_pooling_layer:
            self.pooler = RoFormerPooler(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    @capture_outputs
    def encode(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
               token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, past_key_values: Cache | None = None,
               encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
               use_cache: bool | None = None, read_tokens: torch.Tensor | None = None,
               **kwargs: Unpack[TransformersKwargs]) -> RoFormerEncoding:
        """Runs the model and leaves the last hidden state in the batch's layout, for the heads to consume.

        `read_tokens` `(B, L)` bool: the only tokens whose last hidden state the caller reads (a masked LM's labelled
        tokens in training with `sparse_prediction`). Where the forward allows (bidirectional, no cache, no hidden
        states requested, no pooler, a kernel with a varlen form), the last layer computes only them, every token a
        key and value but only these queries, and the last hidden state is theirs alone, `(M, H)`, in the layout's
        order (`RoFormerEncoding.read_tokens` then says which); elsewhere it holds every token, as without.

        Rows may hold several sequences back to back (`DataCollatorWithFlattening`): their offsets come from
        `cu_seq_lens_q`/`cu_seq_lens_k` in `kwargs`, or, without an attention mask, from `position_ids` that
        restart. Requested hidden states are those the model computed with: they keep the padded layout.

        `position_ids` `(B, L)`, default `arange(L)` (after a cache: from its length; a decoder given an attention
        mask counts its real tokens, as generation does, so that left padding takes no position): the positions the
        rotation reads. An encoder counts left padding, as transformers' RoFormer does. Without an attention mask and
        without earlier keys in a cache, a position that does not follow its predecessor by exactly 1 starts a new
        sequence (transformers' `find_packed_sequence_indices` rule), so positions that skip (e.g. `2 * arange(L)`)
        make every token attend alone. Pass `attention_mask` (ones where there is no padding) and they are read as
        positions only; to stretch positions for long inputs, use `config.rope_parameters` (e.g. `"linear"`) instead.
        Positions the model derives itself never start a sequence. `plan.ForwardPlan` is where each input is read.

        Decoders (`config.is_decoder`) attend causally, or, with `config.prefix_lm`, bidirectionally within the
        prefix (`token_type_ids` 0) and causally after it; a prefix-LM forward whose real tokens all sit in the prefix,
        without a cache (RoFormer-Sim's sentence embeddings, `use_cache=False`), is an encoder's and skips the padding
        as an encoder does. With a cache (`past_key_values`, created when `use_cache`,
        which defaults to `config.use_cache` outside training) the keys of earlier forwards come first:
        `attention_mask` then covers them too, `(B, past + L)`, and positions continue from the real tokens before
        (from the cache's length without an attention mask) unless `position_ids` say otherwise.
        """
        plan = ForwardPlan.build(
            self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, past_key_values,
            encoder_hidden_states, encoder_attention_mask, use_cache, training=self.training, dtype=self.dtype,
            output_attentions=bool(kwargs.get("output_attentions", self.config.output_attentions)),
            output_hidden_states=kwargs.get("output_hidden_states", self.config.output_hidden_states),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
            cache_position=kwargs.get("cache_position"), read_tokens=read_tokens,
            full_last_layer=hasattr(self, "pooler"))
        layout = plan.layout

        # Token-wise from here on: gather the real tokens first so nothing is computed for padding.
        hidden_states = self.embeddings(
            layout.gather_tokens(input_ids) if input_ids is not None else None,
            layout.gather_tokens(plan.token_type_ids),
            layout.gather_tokens(inputs_embeds) if inputs_embeds is not None else None,
        )
        if hasattr(self, "embeddings_project"):
            hidden_states = self.embeddings_project(hidden_states)
        with one_forward(self, hidden_states):  # the dense calls checked at its start
            hidden_states = self.encoder(
                hidden_states, plan.attention_mask,
                position_embeddings=self.rotary_emb.rotation(plan.position_ids, layout),
                past_key_values=plan.past_key_values, cache_state=plan.cache_state,
                encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=plan.encoder_attention_mask,
                last_layer_mask=plan.last_layer_mask)
        pooler_output = self.pooler(layout.edge_tokens(hidden_states)) if hasattr(self, "pooler") else None
        read = None if plan.last_layer_mask is None else plan.last_layer_mask.queries.indices
        return RoFormerEncoding(last_hidden_state=hidden_states, layout=layout, pooler_output=pooler_output,
                                past_key_values=plan.past_key_values if plan.use_cache else None, read_tokens=read)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                **kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPoolingAndCrossAttentions:
        """`encode` with the last hidden state in the padded layout `(B, L, H)`, zeros at the padding (the
        `hidden_states`, when requested, are the tensors the model computed with, padding included). Inputs as in
        `encode`, whose docstring says how `position_ids` are read."""
        encoding = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               return_dict=True, **kwargs)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=encoding.layout.to_padded(encoding.last_hidden_state),
            pooler_output=encoding.pooler_output, past_key_values=encoding.past_key_values,
            hidden_states=encoding.hidden_states, attentions=encoding.attentions,
            cross_attentions=encoding.cross_attentions)


LOSS_KWARGS = ("num_items_in_batch",)  # what Trainer passes to a loss that accepts it (`accepts_loss_kwargs`)


class RoFormerHeadModel(RoFormerPreTrainedModel):
    """Base of the task heads: owns the encoder (`self.roformer`); each head's `predict` turns the encoding into
    its output and loss."""

    # Tells Trainer that the loss is a plain batch mean (it then divides by the gradient-accumulation steps
    # itself); only the language-model heads use Trainer's `num_items_in_batch` to average over labelled tokens.
    accepts_loss_kwargs = False

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.roformer = RoFormerModel(config)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                labels=None, **kwargs: Unpack[TransformersKwargs]) -> ModelOutput:
        loss_kwargs = {name: kwargs.pop(name) for name in LOSS_KWARGS if name in kwargs}
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                      position_ids=position_ids, inputs_embeds=inputs_embeds, **kwargs)
        return self.encode_and_predict(inputs, labels, **loss_kwargs)

    def encode_and_predict(self, inputs: dict, labels, **predict_kwargs) -> ModelOutput:
        """The encoder on `inputs`, then `predict` with `predict_kwargs` only: each argument reaches the one that reads
        it (Trainer's `num_items_in_batch` the loss, `cu_seq_lens_q` the encoder)."""
        encoding = self.roformer.encode(**inputs, read_tokens=self.tokens_read(inputs, labels), return_dict=True)
        output = self.predict(encoding, labels, **predict_kwargs)
        for name in ("hidden_states", "attentions", "cross_attentions"):
            if encoding.get(name) is not None and name in output.__dataclass_fields__:
                output[name] = encoding[name]
        return output

    def tokens_read(self, inputs: dict, labels) -> torch.Tensor | None:
        """`(B, L)` bool, the only tokens whose last hidden state `predict` reads (`RoFormerModel.encode`'s
        `read_tokens`); `None`: all of them."""
        return None

    def predict(self, encoding: RoFormerEncoding, labels, **kwargs) -> ModelOutput:
        """The head's output (and loss, with `labels`) from the encoder's result; `kwargs`: the loss's (Trainer's
        `num_items_in_batch`) and the head's own."""
        raise NotImplementedError

    def _dropout_probability(self) -> float:
        dropout = self.config.classifier_dropout
        return self.config.hidden_dropout_prob if dropout is None else dropout


class RoFormerPredictionTransform(nn.Module):
    """The MLM head's `transform`: dense (hidden -> embedding size), activation, LayerNorm."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.activation = ACT2FN[config.hidden_act]
        self.LayerNorm = norm(config, config.embedding_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(fused_linear(self.dense, hidden_states, self.activation))


class RoFormerLMPredictions(nn.Module):
    """MLM head (`cls.predictions`): `transform`, then the decoder tied to the word embeddings, with its own output
    bias. RoFormer-V2 (a `norm_type` other than LayerNorm) has the decoder alone, without bias, so its hidden states
    must have the embeddings' size."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        config.check_mlm_head()
        if config.uses_layer_norm:
            self.transform = RoFormerPredictionTransform(config)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size, bias=config.uses_layer_norm)
        if config.uses_layer_norm:
            self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (*, hidden_size) -> (*, vocab_size)
        if hasattr(self, "transform"):
            hidden_states = self.transform(hidden_states)
        return fused_linear(self.decoder, hidden_states)


class RoFormerLanguageModel(RoFormerHeadModel):
    """Base of the language-model heads (masked and causal): the encoder and `cls.predictions`, the decoder tied to
    the word embeddings; the loss averages over labelled tokens (Trainer's `num_items_in_batch` when given)."""

    accepts_loss_kwargs = True
    _tied_weights_keys = {"cls.predictions.decoder.weight": "roformer.embeddings.word_embeddings.weight"}

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.cls = nn.ModuleDict({"predictions": RoFormerLMPredictions(config)})  # checkpoint name: cls.predictions
        if self.cls.predictions.decoder.bias is not None:  # RoFormer; V2's decoder has no bias
            self._tied_weights_keys = {**self._tied_weights_keys,
                                       "cls.predictions.decoder.bias": "cls.predictions.bias"}
        self.post_init()

    def tie_weights(self, missing_keys: set[str] | None = None, recompute_mapping: bool = True):
        # A fresh head (loaded onto a bare encoder's checkpoint) lacks both tied biases, and transformers would call
        # the checkpoint corrupted. The head's bias is initialised (`_init_weights`): tie the decoder's to it as in a
        # new model, and keep both listed as new weights in the load report.
        fresh_bias = {"cls.predictions.bias", "cls.predictions.decoder.bias"}
        fresh_head = missing_keys is not None and fresh_bias <= missing_keys
        if fresh_head:
            missing_keys.discard("cls.predictions.bias")
        super().tie_weights(missing_keys=missing_keys, recompute_mapping=recompute_mapping)
        if fresh_head:
            missing_keys.update(fresh_bias)

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.cls.predictions.decoder = new_embeddings
        if new_embeddings.bias is not None:
            self.cls.predictions.bias = new_embeddings.bias


class RoFormerForMaskedLM(RoFormerLanguageModel):
    """RoFormer with a masked-language-modelling head (`fill-mask` pipeline).

    The head runs on real tokens only; `logits` come back padded to `(B, L, vocab_size)`. With
    `config.sparse_prediction=True`, a training forward with labels runs the head only on the labelled tokens
    and returns their logits, `(num_labelled, vocab_size)` (as ModernBERT does); evaluation is unaffected.

    Example (only the labelled token counts in the loss):

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerForMaskedLM
    >>> config = RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                         intermediate_size=64)
    >>> labels = torch.tensor([[-100, -100, 7, -100]])  # only the masked token is scored
    >>> out = RoFormerForMaskedLM(config)(torch.tensor([[2, 5, 4, 3]]), labels=labels)
    >>> out.logits.shape, out.loss.ndim
    (torch.Size([1, 4, 100]), 0)
    ```
    """

    @property
    def loss_function(self):
        """transformers' masked-LM loss (`loss.masked_lm_loss`: the same arguments and result, a cheaper backward
        pass), unless another was set (`model.loss_function = ...`) or `config.loss_type` names one."""
        if hasattr(self, "_loss_function") or self.loss_type != "ForMaskedLM":
            return super().loss_function
        return masked_lm_loss

    @loss_function.setter
    def loss_function(self, value):
        self._loss_function = value

    def tokens_read(self, inputs: dict, labels: torch.Tensor | None) -> torch.Tensor | None:
        """With `config.sparse_prediction`, in training with labels: the labelled tokens (the labels checked here,
        before the encoder runs). Not while compiling, where a last layer whose query count changes with each batch
        would compile again and again."""
        if not self._sparse(labels) or torch.compiler.is_compiling():
            return None
        source = inputs["input_ids"] if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
        if source is None:  # the encoder says what is missing
            return None
        check_token_labels(labels, tuple(source.shape[:2]), self.config.vocab_size)
        return labels != -100

    def _sparse(self, labels: torch.Tensor | None) -> bool:
        return labels is not None and self.training and self.config.sparse_prediction

    def predict(self, encoding: RoFormerEncoding, labels: torch.Tensor | None, **kwargs) -> MaskedLMOutput:
        hidden_states, layout = encoding.last_hidden_state, encoding.layout  # (*T, H), or (M, H): `read_tokens`
        if labels is None:
            return MaskedLMOutput(logits=logits_in_padded_layout(self.cls.predictions, hidden_states, layout))
        if encoding.read_tokens is None:  # else `tokens_read` checked them
            check_token_labels(labels, (layout.batch_size, layout.seq_len), self.config.vocab_size)
        labels = layout.gather_tokens(labels).long()  # int32 labels too (cross-entropy wants int64)
        sparse = self._sparse(labels)
        if sparse:  # the head only where there is something to predict (~15% of tokens)
            labelled = encoding.read_tokens
            if labelled is None:  # the last layer computed every token: keep the labelled ones
                labelled = (labels.flatten() != -100).nonzero().squeeze(-1)
                hidden_states = hidden_states.flatten(0, -2).index_select(0, labelled)  # (M, H)
            labels = labels.flatten().index_select(0, labelled)
        logits = self.cls.predictions(hidden_states)  # (*T, V) or (M, V)
        loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(loss=loss, logits=logits if sparse else layout.to_padded(logits))


@dataclass
class RoFormerCausalLMOutput(CausalLMOutputWithCrossAttentions):
    """transformers' causal-LM output, with the pooler's output when the model has one (RoFormer-Sim).

    Attributes:
        pooler_output: `(B, H)`, `config.pooler_activation(dense(first token))` (`config.add_pooling_layer`).
    """

    pooler_output: torch.Tensor | None = None


class RoFormerForCausalLM(RoFormerLanguageModel, GenerationMixin):
    """RoFormer as a decoder with a language-modelling head (`text-generation` pipeline, `generate()`), transformers'
    `RoFormerForCausalLM`: its checkpoints load unchanged, and so do those of JunnYu's RoFormer-Sim.

    Always a decoder: attention is causal, keys and values are cached (`past_key_values`, transformers'
    `DynamicCache`) and positions continue from the cache. A config with `is_decoder=False` (an encoder's, as
    `AutoModelForCausalLM.from_pretrained(encoder_folder)` reads it) builds the decoder on a copy with
    `is_decoder=True` (logged), never transformers' bidirectional "causal LM". The loss is next-token cross-entropy:
    the logits at each token against the label of the token after it (-100 ignored), as transformers computes it. With
    `config.prefix_lm` (UniLM, RoFormer-Sim) the tokens of segment 0 (`token_type_ids`) see each other
    bidirectionally and those of segment 1 are causal; `generate()` then gives the new tokens segment 1. With
    `config.add_cross_attention` it is the decoder of an `EncoderDecoderModel`.

    Example, greedy generation from a batch of two prompts, the shorter one left-padded:

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerForCausalLM
    >>> model = RoFormerForCausalLM(RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                                            num_attention_heads=4, intermediate_size=64, is_decoder=True))
    >>> prompts = torch.tensor([[0, 2, 5, 7], [2, 9, 4, 6]])
    >>> mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    >>> out = model.generate(prompts, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    >>> out.shape
    torch.Size([2, 9])
    ```
    """

    def __init__(self, config: RoFormerConfig):
        if not config.is_decoder:  # an encoder's config (or its folder): a causal LM is a decoder all the same
            logger.info("RoFormerForCausalLM: config.is_decoder=False; building a decoder (causal attention, a cache) "
                        "on a copy of the config with is_decoder=True")
            config = copy.deepcopy(config)
            config.is_decoder = True
        super().__init__(config)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None, use_cache=None,
                labels=None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs: Unpack[TransformersKwargs]) -> RoFormerCausalLMOutput:
        r"""
        encoder_hidden_states, encoder_attention_mask (`(B, Lk, H)`, `(B, Lk)`, optional): what cross-attention
            reads (`config.add_cross_attention`), as `EncoderDecoderModel` passes them.
        past_key_values, use_cache: the cache of keys and values (see `RoFormerModel.encode`); with `labels`,
            `use_cache` defaults to False (a loss needs no cache, and without one padding is skipped).
        labels (`(B, L)`, optional): the tokens to predict, -100 where nothing is; the logits at token `t` are scored
            against `labels[:, t + 1]`, so `labels=input_ids` (with -100 at padding) trains next-token prediction.
        shift_labels (`(B, L)`, optional): the targets already shifted, as transformers' sequence and context
            parallelism pass them: the logits at token `t` are scored against `shift_labels[:, t]`, and `labels`
            are not read.
        logits_to_keep: compute the logits of the last `n` positions only (`0`: all), as generation asks.
        """
        loss_kwargs = {name: kwargs.pop(name) for name in LOSS_KWARGS if name in kwargs}
        shift_labels = kwargs.pop("shift_labels", None)
        if use_cache is None and (labels is not None or shift_labels is not None):
            use_cache = False
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                      position_ids=position_ids, inputs_embeds=inputs_embeds,
                      encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=encoder_attention_mask,
                      past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        return self.encode_and_predict(inputs, labels, logits_to_keep=logits_to_keep, shift_labels=shift_labels,
                                       **loss_kwargs)

    def predict(self, encoding: RoFormerEncoding, labels: torch.Tensor | None, logits_to_keep: int | torch.Tensor = 0,
                shift_labels: torch.Tensor | None = None, **kwargs) -> RoFormerCausalLMOutput:
        hidden_states, layout = encoding.last_hidden_state, encoding.layout  # (*T, H)
        loss = None
        if labels is not None or shift_labels is not None:
            # (B, L): the label after each token; given as `shift_labels` (sequence parallelism shifts before it
            # shards), it is taken as is and `labels` are not read.
            name, next_labels = ("shift_labels", shift_labels) if shift_labels is not None else ("labels", labels)
            check_token_labels(next_labels, (layout.batch_size, layout.seq_len), self.config.vocab_size, name)
            if shift_labels is None:
                next_labels = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
                if layout.token_mask is not None:  # padding predicts nothing (left padding: the label after it is real)
                    next_labels = next_labels.masked_fill(~layout.token_mask, -100)
            logits = self.cls.predictions(hidden_states)  # (*T, V)
            loss = self.loss_function(logits, None, vocab_size=self.config.vocab_size,
                                      shift_labels=layout.gather_tokens(next_labels).long().contiguous(), **kwargs)
            logits = layout.to_padded(logits)
        elif isinstance(logits_to_keep, int) and logits_to_keep == 0:
            logits = logits_in_padded_layout(self.cls.predictions, hidden_states, layout)  # (B, L, V)
        else:
            logits = self.cls.predictions(slice_logits_to_keep(layout.to_padded(hidden_states), logits_to_keep))
        return RoFormerCausalLMOutput(loss=loss, logits=logits, past_key_values=encoding.past_key_values,
                                      pooler_output=encoding.pooler_output)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """transformers' cache for `generate()`, with the model's own in place of its default (`cache.generation_cache`)."""
        given = model_kwargs.get("past_key_values") is not None
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        generation_cache(model_kwargs, given, generation_config.cache_implementation, self.config.add_cross_attention)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: Cache | None = None,
                                      inputs_embeds: torch.Tensor | None = None, **kwargs):
        """transformers' preparation (`inputs_embeds`, named here, tells `generate()` that the prompt may be given as
        embeddings); with `config.prefix_lm`, the generated tokens (every step after the first, which reads the
        prompt) are segment 1, as JunnYu's RoFormer-Sim generates."""
        inputs = super().prepare_inputs_for_generation(input_ids, past_key_values=past_key_values,
                                                       inputs_embeds=inputs_embeds, **kwargs)
        if self.config.prefix_lm and past_length(past_key_values) > 0:
            inputs["token_type_ids"] = torch.ones_like(inputs["input_ids"])
        return inputs


class RoFormerClassificationHead(nn.Module):
    """Sentence-level head on one vector per sequence ([CLS], or the mean of its tokens): dropout, dense, activation,
    dropout, projection."""

    def __init__(self, config: RoFormerConfig, dropout: float):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACT2FN[config.hidden_act]
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (B, H) -> (B, num_labels)
        hidden = self.activation(self.dense(self.dropout(features)))
        return self.out_proj(self.dropout(hidden))


class RoFormerForSequenceClassification(RoFormerHeadModel):
    """RoFormer with a classification/regression head on [CLS] (`text-classification` pipeline).

    The head reads each sequence's first real token (transformers' RoFormer reads position 0, which is padding in
    left-padded rows), or with `config.classifier_pooling="mean"` the mean of its real tokens' states. The loss
    follows transformers: `num_labels == 1` regression (MSE); integer labels single-label cross-entropy; float labels
    of shape `(B, num_labels)` multi-label BCE (or set `config.problem_type`).

    Example, with three classes:

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerForSequenceClassification
    >>> model = RoFormerForSequenceClassification(RoFormerConfig(
    ...     vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    ...     num_labels=3))
    >>> out = model(torch.tensor([[2, 5, 7, 3]]), labels=torch.tensor([1]))
    >>> out.logits.shape
    torch.Size([1, 3])
    ```
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.classifier = RoFormerClassificationHead(config, self._dropout_probability())
        self.post_init()

    def predict(self, encoding: RoFormerEncoding, labels: torch.Tensor | None, **kwargs) -> SequenceClassifierOutput:
        encoding.layout.require_one_sequence_per_row(type(self).__name__)
        layout, states = encoding.layout, encoding.last_hidden_state
        pooled = layout.mean_tokens(states) if self.config.classifier_pooling == "mean" else layout.edge_tokens(states)
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            check_sequence_labels(labels, self.config, logits.shape[0])
            single_label = sequence_problem_type(self.config, labels) == "single_label_classification"
            labels = labels.long() if single_label else labels.to(logits.dtype)  # int32 classes, 0/1 multi-hot
            loss = self.loss_function(labels, logits, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class RoFormerForTokenClassification(RoFormerHeadModel):
    """RoFormer with a per-token classifier (NER, POS tagging); labels of -100 are ignored.

    Example (no tags on [CLS] and [SEP]):

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerForTokenClassification
    >>> config = RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                         intermediate_size=64, num_labels=5)
    >>> tags = torch.tensor([[-100, 1, 4, -100]])  # no tag for [CLS] and [SEP]
    >>> RoFormerForTokenClassification(config)(torch.tensor([[2, 5, 7, 3]]), labels=tags).logits.shape
    torch.Size([1, 4, 5])
    ```
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.dropout = nn.Dropout(self._dropout_probability())
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def predict(self, encoding: RoFormerEncoding, labels: torch.Tensor | None, **kwargs) -> TokenClassifierOutput:
        layout = encoding.layout
        logits = self.classifier(dropout(self.dropout, encoding.last_hidden_state))  # (*T, num_labels)
        loss = None
        if labels is not None:
            check_token_labels(labels, (layout.batch_size, layout.seq_len), self.num_labels)
            loss = self.loss_function(logits, layout.gather_tokens(labels).long(), self.config)
        return TokenClassifierOutput(loss=loss, logits=layout.to_padded(logits))


class RoFormerForQuestionAnswering(RoFormerHeadModel):
    """RoFormer with an extractive-QA head: start and end logits for every token. The logits at padding are masked
    out of the softmax, so a predicted span never starts or ends on padding.

    Example: a predicted span never starts or ends on padding.

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerForQuestionAnswering
    >>> qa = RoFormerForQuestionAnswering(RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                                                  num_attention_heads=4, intermediate_size=64))
    >>> mask = torch.tensor([[1, 1, 1, 1, 0]])
    >>> out = qa(torch.tensor([[2, 5, 7, 3, 0]]), attention_mask=mask)
    >>> int(out.start_logits.argmax()) < 4 and int(out.end_logits.argmax()) < 4  # never on the padding
    True
    ```
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None,
                **kwargs: Unpack[TransformersKwargs]) -> QuestionAnsweringModelOutput:
        spans = None if start_positions is None or end_positions is None else (start_positions, end_positions)
        return super().forward(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, spans, **kwargs)

    def predict(self, encoding: RoFormerEncoding, spans: tuple[torch.Tensor, torch.Tensor] | None,
                **kwargs) -> QuestionAnsweringModelOutput:
        layout = encoding.layout
        logits = layout.scatter_tokens(self.qa_outputs(encoding.last_hidden_state))  # (B, L, 2)
        # Padding must never win the argmax of a span.
        if layout.token_mask is not None:
            logits = logits.masked_fill(~layout.token_mask.unsqueeze(-1), torch.finfo(logits.dtype).min)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if spans is not None:
            layout.require_one_sequence_per_row(f"{type(self).__name__} with start_positions/end_positions")
            for name, positions in zip(("start_positions", "end_positions"), spans):
                check_span_positions(name, positions, layout.token_mask, tuple(start_logits.shape))
            loss = self.loss_function(start_logits, end_logits, *(positions.long() for positions in spans))
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)


class RoFormerForMultipleChoice(RoFormerHeadModel):
    """RoFormer scoring `num_choices` candidates per example: inputs `(B, num_choices, L)`, logits
    `(B, num_choices)`, one score per choice from the state of its last real token (as transformers' RoFormer,
    whose sequence summary takes the last position: the same token unless the choice is right-padded).

    Example, two choices for one question:

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerForMultipleChoice
    >>> model = RoFormerForMultipleChoice(RoFormerConfig(
    ...     vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    >>> model(torch.tensor([[[2, 5, 3], [2, 7, 3]]]), labels=torch.tensor([1])).logits.shape
    torch.Size([1, 2])
    ```
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.dropout = nn.Dropout(self._dropout_probability())
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs: Unpack[TransformersKwargs]) -> MultipleChoiceModelOutput:
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None or source.dim() < 3:
            raise ValueError("RoFormerForMultipleChoice expects input_ids of shape (batch, num_choices, seq_len) "
                             "or inputs_embeds of shape (batch, num_choices, seq_len, embedding_size)")

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:  # (B, num_choices, ...) -> (B * num_choices, ...)
            return None if t is None else t.flatten(0, 1)

        names = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
        inputs = {name: flat(t) for name, t in zip(names, (input_ids, attention_mask, token_type_ids, position_ids,
                                                           inputs_embeds))}
        return self.encode_and_predict({**inputs, **kwargs}, labels, num_choices=source.shape[1])

    def predict(self, encoding: RoFormerEncoding, labels: torch.Tensor | None, num_choices: int,
                **kwargs) -> MultipleChoiceModelOutput:
        encoding.layout.require_one_sequence_per_row(type(self).__name__)
        last_tokens = encoding.layout.edge_tokens(encoding.last_hidden_state, last=True)  # (B * num_choices, H)
        logits = self.classifier(self.dropout(last_tokens)).view(-1, num_choices)
        loss = None
        if labels is not None:
            check_choice_labels(labels, logits.shape[0], num_choices)
            loss = nn.functional.cross_entropy(logits, labels.long())
        return MultipleChoiceModelOutput(loss=loss, logits=logits)


class Head(NamedTuple):
    """A row of the table of RoFormer models."""

    model_class: type[RoFormerPreTrainedModel]
    auto_class: str  # the transformers Auto class that builds it
    pipeline_tag: str | None  # its task on the Hub


# The one list of models. Registration with the Auto classes, the `auto_map` of saved folders, model cards and
# `__all__` all derive from it.
HEADS = (
    Head(RoFormerModel, "AutoModel", "feature-extraction"),
    Head(RoFormerForMaskedLM, "AutoModelForMaskedLM", "fill-mask"),
    Head(RoFormerForSequenceClassification, "AutoModelForSequenceClassification", "text-classification"),
    Head(RoFormerForTokenClassification, "AutoModelForTokenClassification", "token-classification"),
    Head(RoFormerForQuestionAnswering, "AutoModelForQuestionAnswering", "question-answering"),
    Head(RoFormerForMultipleChoice, "AutoModelForMultipleChoice", None),  # the Hub has no multiple-choice task
    Head(RoFormerForCausalLM, "AutoModelForCausalLM", "text-generation"),
)

_MODULE = __name__.rsplit(".", 1)[-1]  # "modeling", also as remote code (transformers_modules.<repo>.modeling)
RoFormerPreTrainedModel.heads = HEADS
RoFormerPreTrainedModel.auto_map = {
    "AutoConfig": f"{RoFormerConfig.__module__.rsplit('.', 1)[-1]}.{RoFormerConfig.__name__}",
    **{head.auto_class: f"{_MODULE}.{head.model_class.__name__}" for head in HEADS},
}
for _head in HEADS:
    _head.model_class.register_for_auto_class(_head.auto_class)

__all__ = ["RoFormerPreTrainedModel", "RoFormerEncoding", *(head.model_class.__name__ for head in HEADS)]
