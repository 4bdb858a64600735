"""RoFormer encoder and task heads as transformers models.

Module and parameter names follow transformers' RoFormer (`roformer.encoder.layer.N.attention.self.query`, ...),
so its checkpoints load unchanged and ours load in it; only its frozen sinusoidal table
(`encoder.embed_positions.weight`) is dropped, since positions are rotated on the fly from `position_ids`.

Shapes: B batch, L sequence length, N real (unpadded) tokens, H hidden size, nh heads, d head size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging
try:
    from transformers.utils.generic import is_flash_attention_requested
except ImportError:  # transformers releases before it: the same test

    def is_flash_attention_requested(requested_attention_implementation: str | None = None) -> bool:
        return "flash" in (requested_attention_implementation or "")

from .configuration import AUTO_MAP, RoFormerConfig
from .hub import push_to_hub_with_card, write_model_card
from .padding import PackedBatch
from .rotary import rotary_phases, rotate
from .validation import (
    check_choice_labels,
    check_encoder_inputs,
    check_sequence_labels,
    check_span_positions,
    check_token_labels,
    sequence_problem_type,
)

logger = logging.get_logger(__name__)

# Parameters of the task heads; a checkpoint may lack them (a new head starts from scratch), never the encoder's.
HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")


class RoFormerEmbeddings(nn.Module):
    """Word and token-type embeddings, LayerNorm and dropout; no position embeddings (attention rotates)."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor,
                inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(embeddings))


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (B, nh, L, d)
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # (B, 1, 1, L) bool, True = may attend
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention that also returns its weights. The softmax runs in float32 whatever the input dtype, and
    padding is masked with `masked_fill` rather than by adding `finfo.min`, which overflows in float16."""
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling  # (B, nh, L, L)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(torch.float32).min)
    weights = scores.softmax(dim=-1).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, L, nh, d)
    return output, weights


class RoFormerSelfAttention(nn.Module):
    """Multi-head self-attention with rotary queries and keys (and values when `config.rotary_value`).

    Runs on packed tokens `(N, H)` or padded ones `(B, L, H)`; the kernel comes from transformers' attention
    interface (`config._attn_implementation`: "sdpa", "eager", "flash_attention_2", ...).
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (*T, H) with T = (N,) packed or (B, L) padded
        phases: torch.Tensor,  # rotary_phases: (*T, 1, d/2, 2)
        batch: PackedBatch,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = hidden_states.shape[:-1]
        head_shape = (*tokens, self.num_heads, self.head_dim)
        query, key, value = (proj(hidden_states).view(head_shape) for proj in (self.query, self.key, self.value))

        layout = self.config.rotary_layout
        query, key = rotate(query, phases, layout), rotate(key, phases, layout)
        if self.config.rotary_value:
            value = rotate(value, phases, layout)

        implementation = "eager" if output_attentions else self.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        dropout = self.config.attention_probs_dropout_prob if self.training else 0.0
        # flash_attention_2/3, or a flash kernel from the Hub ("kernels-community/flash-attn2", ...)
        flash = is_flash_attention_requested(requested_attention_implementation=implementation)

        if batch.is_packed and flash and not batch.max_seqlen:
            output, weights = query.new_zeros(query.shape), None  # not a single real token: nothing to attend
        elif batch.is_packed and flash:
            # flash-attn's varlen kernel reads the packed tokens directly: (1, nh, N, d) plus sequence offsets.
            query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            output, weights = attention(
                self, query, key, value, None, dropout=dropout, scaling=self.scaling,
                cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens,
                max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen,
            )
            output = output.squeeze(0)  # (N, nh, d)
        elif batch.is_packed and implementation == "sdpa" and hidden_states.device.type == "cpu":
            # On CPU, attending within each sequence's own slice does no work for padding and needs no mask.
            # `split` (not indexing) so that the backward pass joins the gradients with one `cat`.
            if batch.spans:
                lengths = [end - start for start, end in batch.spans]
                sequences = zip(*(t.split(lengths) for t in (query, key, value)))  # (n, nh, d) each
                output = torch.cat([
                    attention(self, *(t.transpose(0, 1).unsqueeze(0) for t in qkv), None,  # (1, nh, n, d)
                              dropout=dropout, scaling=self.scaling)[0].squeeze(0)  # (n, nh, d)
                    for qkv in sequences
                ])
            else:  # not a single real token
                output = query.new_zeros(query.shape)
            weights = None
        else:
            query, key, value = (batch.unpack(t).transpose(1, 2) for t in (query, key, value))  # (B, nh, L, d)
            mask = batch.key_mask
            if mask is not None and flash:
                mask = mask[:, 0, 0]  # flash-attn unpads by itself from a (B, L) mask
            output, weights = attention(self, query, key, value, mask, dropout=dropout, scaling=self.scaling)
            output = batch.pack(output)  # (*T, nh, d)
        return output.reshape(*tokens, self.num_heads * self.head_dim), weights


class RoFormerResidual(nn.Module):
    """The output side of a sublayer: projection, dropout, residual add and LayerNorm.

    Post-LN (RoFormer, BERT) normalises after the add; pre-LN normalises the sublayer's input instead
    (`normalize_input`) and leaves the residual stream untouched.
    """

    def __init__(self, config: RoFormerConfig, in_features: int):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def normalize_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(hidden_states) if self.pre_norm else hidden_states

    def forward(self, sublayer_output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden_states = residual + self.dropout(self.dense(sublayer_output))
        return hidden_states if self.pre_norm else self.LayerNorm(hidden_states)


class RoFormerAttention(nn.Module):
    """Self-attention sublayer: `self` (rotary attention) and `output` (projection + residual + LayerNorm)."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.self = RoFormerSelfAttention(config)
        self.output = RoFormerResidual(config, config.hidden_size)

    def forward(self, hidden_states, phases, batch, output_attentions=False):
        context, weights = self.self(self.output.normalize_input(hidden_states), phases, batch,
                                     output_attentions)
        return self.output(context, hidden_states), weights


class RoFormerIntermediate(nn.Module):
    """First half of the feed-forward: expansion to `intermediate_size` and the activation (GELU)."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class RoFormerLayer(GradientCheckpointingLayer):
    """One encoder block: attention sublayer, then feed-forward sublayer (`intermediate` + `output`).

    With `config.chunk_size_feed_forward = n > 0` the feed-forward runs on `n` tokens at a time (as in
    transformers): the same result, with the `intermediate_size`-wide activation only `n` tokens long.
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.attention = RoFormerAttention(config)
        self.intermediate = RoFormerIntermediate(config)
        self.output = RoFormerResidual(config, config.intermediate_size)
        self.chunk_size_feed_forward = config.chunk_size_feed_forward

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # token-wise: (*T, H) -> (*T, H)
        return self.output(self.intermediate(self.output.normalize_input(hidden_states)), hidden_states)

    def forward(self, hidden_states, phases, batch, output_attentions=False):
        hidden_states, weights = self.attention(hidden_states, phases, batch, output_attentions)
        chunk = self.chunk_size_feed_forward
        if chunk and hidden_states.shape[-2] > chunk:  # tokens are dim -2, packed (N, H) or padded (B, L, H)
            parts = hidden_states.split(chunk, dim=-2)
            return torch.cat([self.feed_forward(part) for part in parts], dim=-2), weights
        return self.feed_forward(hidden_states), weights


class EncoderOutput(NamedTuple):
    """What the encoder hands to the heads: the last hidden states still packed, and how to unpack them."""

    last_hidden_state: torch.Tensor  # (*T, H)
    batch: PackedBatch
    hidden_states: tuple[torch.Tensor, ...] | None  # each (B, L, H)
    attentions: tuple[torch.Tensor, ...] | None  # each (B, nh, L, L)


class RoFormerEncoder(nn.Module):
    """The stack of layers, plus the final LayerNorm of pre-LN models."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.layer = nn.ModuleList(RoFormerLayer(config) for _ in range(config.num_hidden_layers))
        if config.norm_position == "pre":
            self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False

    def forward(self, hidden_states, phases, batch, output_attentions=False,
                output_hidden_states=False) -> EncoderOutput:
        all_hidden_states = [batch.unpack(hidden_states)] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        for layer in self.layer:
            hidden_states, weights = layer(hidden_states, phases, batch, output_attentions)
            if output_hidden_states:
                all_hidden_states.append(batch.unpack(hidden_states))
            if output_attentions:
                all_attentions.append(weights)
        if hasattr(self, "final_layer_norm"):
            hidden_states = self.final_layer_norm(hidden_states)
            if output_hidden_states:
                all_hidden_states[-1] = batch.unpack(hidden_states)
        return EncoderOutput(
            hidden_states, batch,
            tuple(all_hidden_states) if output_hidden_states else None,
            tuple(all_attentions) if output_attentions else None,
        )


class RoFormerPreTrainedModel(PreTrainedModel):
    """Weight initialisation, checkpoint compatibility and the Auto-class map shared by all RoFormer models."""

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

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RoFormerForMaskedLM):
            init.zeros_(module.cls.predictions.bias)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, allow_missing_encoder_weights: bool = False,
                        **kwargs):
        """transformers' `from_pretrained`, refusing to return a half-initialised encoder.

        Weights load only from safetensors files, never from pickles. Task heads missing from the checkpoint are
        initialised as usual (fine-tuning starts that way), but a checkpoint lacking any encoder weight raises,
        unless `allow_missing_encoder_weights=True`. A truncated or corrupted safetensors file raises an `OSError`
        naming the checkpoint.
        """
        want_info = kwargs.pop("output_loading_info", False)
        if kwargs.setdefault("use_safetensors", True) is not True:
            raise ValueError("use_safetensors must be True: roformer_hf never unpickles weights (pickle can run code)")
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  **kwargs)
        except SafetensorError as error:
            raise OSError(f"The safetensors weights of {str(pretrained_model_name_or_path)!r} are truncated or "
                          f"corrupted and cannot be read ({error}); re-download or re-save them") from error
        missing = sorted(key for key in info["missing_keys"] if not key.startswith(HEAD_PREFIXES))
        if missing and not allow_missing_encoder_weights:
            raise ValueError(
                f"{str(pretrained_model_name_or_path)!r} lacks {len(missing)} encoder weight(s), e.g. "
                f"{missing[:3]}: the model would be half random. Check the checkpoint, or pass "
                "allow_missing_encoder_weights=True to initialise them randomly on purpose")
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Every Auto class, not only this one's, can then load the folder with trust_remote_code=True.
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        write_model_card(self, save_directory)  # README.md, unless the folder has one

    def push_to_hub(self, repo_id: str, **kwargs):
        """transformers' `push_to_hub`, but uploading this model's card (see `hub.push_to_hub_with_card`)."""
        return push_to_hub_with_card(self, repo_id, **kwargs)


class RoFormerModel(RoFormerPreTrainedModel):
    """The bare RoFormer encoder, returning hidden states.

    Example:

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
        self.encoder = RoFormerEncoder(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def encode(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
    ) -> EncoderOutput:
        """Runs the encoder and keeps the result packed (padding skipped), for the heads to consume."""
        check_encoder_inputs(self.config, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        batch_size, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (self.config.output_hidden_states if output_hidden_states is None
                                else output_hidden_states)

        if token_type_ids is None:
            token_type_ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
        else:
            position_ids = position_ids.expand(batch_size, seq_len)
        batch = PackedBatch.from_attention_mask(attention_mask, batch_size, seq_len,
                                                unpad=self.config.unpad_inputs)

        # Token-wise from here on: pack first so nothing is computed for padding.
        hidden_states = self.embeddings(
            batch.pack(input_ids) if input_ids is not None else None,
            batch.pack(token_type_ids),
            batch.pack(inputs_embeds) if inputs_embeds is not None else None,
        )
        if hasattr(self, "embeddings_project"):
            hidden_states = self.embeddings_project(hidden_states)
        phases = rotary_phases(batch.pack(position_ids), self.config.head_dim, self.config.rope_theta)
        phases = phases.unsqueeze(-3)  # (*T, 1, d/2, 2), broadcast over heads
        return self.encoder(hidden_states, phases, batch, output_attentions, output_hidden_states)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        encoded = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                              output_attentions, output_hidden_states)
        output = BaseModelOutput(
            last_hidden_state=encoded.batch.unpack(encoded.last_hidden_state),
            hidden_states=encoded.hidden_states,
            attentions=encoded.attentions,
        )
        return output if self._return_dict(return_dict) else output.to_tuple()

    def _return_dict(self, return_dict: bool | None) -> bool:
        return self.config.return_dict if return_dict is None else return_dict


class RoFormerHeadModel(RoFormerPreTrainedModel):
    """Base of the task heads: owns `self.roformer` and the output plumbing they share."""

    # Tells Trainer that the loss is a plain batch mean (it then divides by the gradient-accumulation steps
    # itself); only the MLM head uses Trainer's `num_items_in_batch` to average over the labelled tokens.
    accepts_loss_kwargs = False

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.roformer = RoFormerModel(config)

    def _finish(self, output_class, encoded: EncoderOutput, return_dict: bool | None, **fields):
        output = output_class(**fields, hidden_states=encoded.hidden_states, attentions=encoded.attentions)
        return output if self.roformer._return_dict(return_dict) else output.to_tuple()

    def _dropout_probability(self) -> float:
        dropout = self.config.classifier_dropout
        return self.config.hidden_dropout_prob if dropout is None else dropout


class RoFormerLMPredictions(nn.Module):
    """MLM head (`cls.predictions`): dense + activation + LayerNorm, then the decoder tied to the word
    embeddings, with its own output bias."""

    def __init__(self, config: RoFormerConfig):
        super().__init__()
        self.transform = nn.ModuleDict({
            "dense": nn.Linear(config.hidden_size, config.embedding_size),
            "LayerNorm": nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps),
        })
        self.activation = ACT2FN[config.hidden_act]
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.activation(self.transform["dense"](hidden_states))
        return self.decoder(self.transform["LayerNorm"](hidden_states))


class RoFormerForMaskedLM(RoFormerHeadModel):
    """RoFormer with a masked-language-modelling head (`fill-mask` pipeline).

    The head runs on real tokens only; `logits` come back padded to `(B, L, vocab_size)`. With
    `config.sparse_prediction=True`, a training forward with labels runs the head only on the labelled tokens
    and returns their logits, `(num_labelled, vocab_size)` (as ModernBERT does); evaluation is unaffected.

    Example:

    ```python
    >>> import torch
    >>> from roformer_hf import RoFormerConfig, RoFormerForMaskedLM
    >>> model = RoFormerForMaskedLM(RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                                            num_attention_heads=4, intermediate_size=64))
    >>> ids = torch.tensor([[2, 5, 4, 3]])
    >>> out = model(ids, labels=torch.tensor([[-100, -100, 7, -100]]))
    >>> out.logits.shape, out.loss.ndim
    (torch.Size([1, 4, 100]), 0)
    ```
    """

    accepts_loss_kwargs = True
    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "roformer.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.cls = nn.ModuleDict({"predictions": RoFormerLMPredictions(config)})  # checkpoint name: cls.predictions
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs) -> MaskedLMOutput | tuple:
        encoded = self.roformer.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                       output_attentions, output_hidden_states)
        hidden_states, batch = encoded.last_hidden_state, encoded.batch  # (*T, H), real tokens only
        if labels is not None:
            check_token_labels(labels, (batch.batch_size, batch.seq_len), self.config.vocab_size)
            labels = batch.pack(labels).long()  # int32 labels too (cross-entropy wants int64)
        sparse = labels is not None and self.training and self.config.sparse_prediction
        if sparse:  # the head only where there is something to predict (~15% of tokens)
            labelled = (labels.flatten() != -100).nonzero().squeeze(-1)
            hidden_states = hidden_states.flatten(0, -2).index_select(0, labelled)  # (M, H)
            labels = labels.flatten().index_select(0, labelled)
        if labels is None:
            logits, loss = batch.unpack_map(self.cls.predictions, hidden_states), None  # (B, L, V)
        else:
            logits = self.cls.predictions(hidden_states)  # (*T, V) or (M, V)
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
            logits = logits if sparse else batch.unpack(logits)
        return self._finish(MaskedLMOutput, encoded, return_dict, loss=loss, logits=logits)


class RoFormerClassificationHead(nn.Module):
    """Sentence-level head on the first token ([CLS]): dropout, dense, activation, dropout, projection."""

    def __init__(self, config: RoFormerConfig, dropout: float):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACT2FN[config.hidden_act]
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (B, H) -> (B, num_labels)
        hidden = self.activation(self.dense(self.dropout(features)))
        return self.out_proj(self.dropout(hidden))


def first_tokens(encoded: EncoderOutput) -> torch.Tensor:
    """The last hidden state at the first real token ([CLS]) of every sequence, left padding or right: `(B, H)`.

    transformers' RoFormer reads position 0, which is the same token unless the batch is left-padded (where
    position 0 is padding and the logits would not depend on the text)."""
    return encoded.batch.edge_tokens(encoded.last_hidden_state)


class RoFormerForSequenceClassification(RoFormerHeadModel):
    """RoFormer with a classification/regression head on [CLS] (`text-classification` pipeline).

    The loss follows transformers: `num_labels == 1` regression (MSE); integer labels single-label
    cross-entropy; float labels of shape `(B, num_labels)` multi-label BCE (or set `config.problem_type`).
    """

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.classifier = RoFormerClassificationHead(config, self._dropout_probability())
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs) -> SequenceClassifierOutput | tuple:
        encoded = self.roformer.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                       output_attentions, output_hidden_states)
        logits = self.classifier(first_tokens(encoded))
        loss = None
        if labels is not None:
            check_sequence_labels(labels, self.config, logits.shape[0])
            single_label = sequence_problem_type(self.config, labels) == "single_label_classification"
            labels = labels.long() if single_label else labels.to(logits.dtype)  # int32 classes, 0/1 multi-hot
            loss = self.loss_function(labels, logits, self.config)
        return self._finish(SequenceClassifierOutput, encoded, return_dict, loss=loss, logits=logits)


class RoFormerForTokenClassification(RoFormerHeadModel):
    """RoFormer with a per-token classifier (NER, POS tagging); labels of -100 are ignored."""

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.dropout = nn.Dropout(self._dropout_probability())
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs) -> TokenClassifierOutput | tuple:
        encoded = self.roformer.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                       output_attentions, output_hidden_states)
        logits = self.classifier(self.dropout(encoded.last_hidden_state))  # (*T, num_labels)
        loss = None
        if labels is not None:
            check_token_labels(labels, (encoded.batch.batch_size, encoded.batch.seq_len), self.num_labels)
            loss = self.loss_function(logits, encoded.batch.pack(labels).long(), self.config)
        return self._finish(TokenClassifierOutput, encoded, return_dict, loss=loss,
                            logits=encoded.batch.unpack(logits))


class RoFormerForQuestionAnswering(RoFormerHeadModel):
    """RoFormer with an extractive-QA head: start and end logits for every token."""

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs) -> QuestionAnsweringModelOutput | tuple:
        encoded = self.roformer.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                       output_attentions, output_hidden_states)
        logits = encoded.batch.unpack(self.qa_outputs(encoded.last_hidden_state))  # (B, L, 2)
        # Padding must never win the argmax of a span.
        if attention_mask is not None:
            logits = logits.masked_fill(~attention_mask.bool().unsqueeze(-1), torch.finfo(logits.dtype).min)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
                check_span_positions(name, positions, attention_mask, tuple(start_logits.shape))
            loss = self.loss_function(start_logits, end_logits, start_positions.long(), end_positions.long())
        return self._finish(QuestionAnsweringModelOutput, encoded, return_dict, loss=loss,
                            start_logits=start_logits, end_logits=end_logits)


class RoFormerForMultipleChoice(RoFormerHeadModel):
    """RoFormer scoring `num_choices` candidates per example: inputs `(B, num_choices, L)`, logits
    `(B, num_choices)`, one score per choice from the state of its last real token (as transformers' RoFormer,
    whose sequence summary takes the last position: the same token unless the choice is right-padded)."""

    def __init__(self, config: RoFormerConfig):
        super().__init__(config)
        self.dropout = nn.Dropout(self._dropout_probability())
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, **kwargs) -> MultipleChoiceModelOutput | tuple:
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None or source.dim() < 3:
            raise ValueError("RoFormerForMultipleChoice expects input_ids of shape (batch, num_choices, seq_len) "
                             "or inputs_embeds of shape (batch, num_choices, seq_len, embedding_size)")
        num_choices = source.shape[1]

        def flat(t: torch.Tensor | None, keep: int) -> torch.Tensor | None:  # merge batch and choice dims
            return None if t is None else t.reshape(-1, *t.shape[2:2 + keep])

        encoded = self.roformer.encode(flat(input_ids, 1), flat(attention_mask, 1), flat(token_type_ids, 1),
                                       flat(position_ids, 1), flat(inputs_embeds, 2), output_attentions,
                                       output_hidden_states)
        last_tokens = encoded.batch.edge_tokens(encoded.last_hidden_state, last=True)  # (B * num_choices, H)
        logits = self.classifier(self.dropout(last_tokens)).view(-1, num_choices)
        loss = None
        if labels is not None:
            check_choice_labels(labels, logits.shape[0], num_choices)
            loss = nn.functional.cross_entropy(logits, labels.long())
        return self._finish(MultipleChoiceModelOutput, encoded, return_dict, loss=loss, logits=logits)


for _auto_class, _reference in AUTO_MAP.items():
    if _reference.startswith("modeling."):
        globals()[_reference.removeprefix("modeling.")].register_for_auto_class(_auto_class)

__all__ = [
    "RoFormerPreTrainedModel",
    "RoFormerModel",
    "RoFormerForMaskedLM",
    "RoFormerForSequenceClassification",
    "RoFormerForTokenClassification",
    "RoFormerForQuestionAnswering",
    "RoFormerForMultipleChoice",
]
