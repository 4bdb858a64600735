"""What a forward decides before its first layer, decided once: `ForwardPlan`.

`RoFormerModel.encode` builds one plan from the inputs, the config and the cache, then runs embeddings, rotation and
layers as transformers' Llama does; the layers only read what the plan decided. Each input is resolved in one place:

- ``attention_mask`` ``(B, Lk)``: its last ``L`` columns give the queries' layout (`padding.BatchLayout`: dense,
  padded, real tokens only, packed rows); with a cache, all of it is the keys' padding. A decoder without
  ``position_ids`` counts its real tokens into positions.
- ``position_ids`` ``(B, L)``: given, or counted from the attention mask (a decoder: left padding takes no position),
  or continuing a cache (``cache_position``, else from the cache's length), or ``arange(L)``. Positions the caller
  gave, without an attention mask and without earlier keys, may restart inside a row: packed rows. Positions the
  plan made never mean packing.
- ``past_key_values``: checked and read once (`cache.check_cache`: the past length, whether cross-attention's keys
  are filled); made (`cache.create_cache`) when ``use_cache`` asks for one.

The kernel is chosen once (`kernels.choose_kernel`) and the masks rendered once in the form it takes
(`masks.create_attention_mask`); where a short input's self-attention can run in one call, rotation included, the
mask carries that call bound to its sequences (`few_token_attention`). A head that reads a few tokens only (a masked
LM in training with `sparse_prediction`) passes them as ``read_tokens``: where the forward allows, the last layer's
queries are those tokens alone (`masks.query_subset_mask`), since no other token's last state is read. Everything the
plan must know of the inputs' values (ids in range, the mask's lengths, packed offsets, a prefix-LM's segments) comes
to the host in one copy: one host sync per forward. Packed rows found from ``position_ids`` take a second (their
offsets), the ``"longrope"`` rope type one inside transformers' frequencies, labels one in the heads' checks, and
``read_tokens`` one (their count in each sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.import_utils import is_tracing

from . import few_rows
from .cache import CacheState, check_cache, create_cache
from .kernels import SDPA_VARLEN, choose_kernel
from .masks import AttentionMask, create_attention_mask, query_subset_mask
from .padding import BatchLayout, layout_reads
from .validation import (
    check_cross_attention_inputs,
    check_encoder_inputs,
    check_packed_offsets,
    check_prefix_segments,
    check_same_offsets,
    check_values,
    prefix_end_check,
    prefix_segment_check,
)


@dataclass(frozen=True)
class ForwardPlan:
    """The decisions of one forward, for every layer.

    Attributes:
        layout: where the queries sit in the ``(B, L)`` batch, with their lengths on the host.
        position_ids: ``(B, L)``, the positions the rotation reads.
        token_type_ids: ``(B, L)``.
        attention_mask: self-attention's mask, in the form of the kernel it names.
        encoder_attention_mask: cross-attention's (decoders with `config.add_cross_attention`, given encoder states).
        past_key_values: the cache this forward extends (given, or made for ``use_cache``); ``None``: none.
        use_cache: whether the forward returns the cache.
        cache_state: what the cache held before this forward.
        last_layer_mask: the last layer's self-attention mask, whose only queries are the tokens the caller reads
            (``read_tokens`` of `build`); ``None``: the last layer computes every token, as the others.
    """

    layout: BatchLayout
    position_ids: Tensor
    token_type_ids: Tensor
    attention_mask: AttentionMask
    encoder_attention_mask: AttentionMask | None = None
    past_key_values: Cache | None = None
    use_cache: bool = False
    cache_state: CacheState = CacheState()
    last_layer_mask: AttentionMask | None = None

    @classmethod
    def build(cls, config, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
              token_type_ids: Tensor | None = None, position_ids: Tensor | None = None,
              inputs_embeds: Tensor | None = None, past_key_values: Cache | None = None,
              encoder_hidden_states: Tensor | None = None, encoder_attention_mask: Tensor | None = None,
              use_cache: bool | None = None, *, training: bool = False, dtype: torch.dtype | None = None,
              output_attentions: bool = False, output_hidden_states: bool = False,
              cu_seq_lens_q: Tensor | None = None, cu_seq_lens_k: Tensor | None = None,
              cache_position: Tensor | None = None, read_tokens: Tensor | None = None,
              full_last_layer: bool = False) -> ForwardPlan:
        """The plan of `RoFormerModel.encode` on these inputs (its docstring says how each is read); `training`: the
        model's mode, `dtype`: its parameters' (what a cache must hold, unless autocast is on). `read_tokens`:
        ``(B, L)`` bool, the only tokens whose last state the caller reads, ``None``: all; `full_last_layer`: the
        model reads other tokens' last states itself (a pooler), so the last layer must compute them all."""
        if use_cache is None:
            use_cache = config.is_decoder and config.use_cache and not training
        source = input_ids if input_ids is not None else inputs_embeds
        cache_dtype = None if source is None or torch.is_autocast_enabled(source.device.type) else dtype
        cache_state = check_cache(config, past_key_values, use_cache, None if source is None else source.shape[0],
                                  cache_dtype)
        past_length = cache_state.past_length
        if source is not None:
            check_cross_attention_inputs(config, encoder_hidden_states, encoder_attention_mask, source.shape[0])
        value_checks = check_encoder_inputs(config, input_ids, attention_mask, token_type_ids, position_ids,
                                            inputs_embeds, past_length)
        offsets = check_packed_offsets(cu_seq_lens_q, cu_seq_lens_k)
        batch_size, seq_len = source.shape[:2]
        device = source.device
        if use_cache and past_key_values is None:
            past_key_values = create_cache(config.add_cross_attention)
        if token_type_ids is None:
            token_type_ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        given_positions = position_ids is not None
        position_ids = resolve_positions(config, position_ids, attention_mask, batch_size, seq_len, past_length,
                                         cache_position, device)
        packing_positions = position_ids if given_positions and not past_length else None  # only the caller's pack

        prefix = token_type_ids == 0 if config.prefix_lm else None
        keys_beyond_queries = past_key_values is not None or encoder_hidden_states is not None
        query_mask = attention_mask[:, -seq_len:] if attention_mask is not None else None
        unpad = config.unpad_inputs and not output_hidden_states and not keys_beyond_queries
        # A prefix-LM whose queries all sit in the prefix (RoFormer-Sim's sentence embeddings) attends as an encoder:
        # bidirectionally, and without its padding.
        past_prefix = None if keys_beyond_queries else prefix_end_check(config, token_type_ids, query_mask)

        # Everything the plan needs of the inputs' values, to the host in one copy.
        both_offsets = cu_seq_lens_q is not None and cu_seq_lens_k is not None  # to compare on the host
        reads = [check.extremes for check in value_checks]
        reads.append(prefix_segment_check(config, token_type_ids, attention_mask))
        reads.append(past_prefix)
        reads.append(layout_values := layout_reads(query_mask, packing_positions, offsets,
                                                   unpad and (prefix is None or past_prefix is not None)))
        reads.append(cu_seq_lens_k.long() if both_offsets and layout_values is not None else None)
        extremes, goes_back, past_prefix, layout_host, key_offsets = read_on_host(reads, len(value_checks))
        check_values(value_checks, extremes)
        if goes_back is not None:
            check_prefix_segments(token_type_ids, goes_back)
        if key_offsets is not None:
            check_same_offsets(layout_host, key_offsets)
        causal = config.is_decoder
        if past_prefix == [0]:
            prefix, causal = None, False
        unpad = unpad and prefix is None

        layout = BatchLayout.from_inputs(batch_size, seq_len, query_mask, packing_positions, offsets, unpad,
                                         host=layout_host)
        kernel = choose_kernel("eager" if output_attentions else config._attn_implementation, device,
                               dropout=training and config.attention_probs_dropout_prob > 0,
                               packed_rows=layout.has_packed_rows)
        self_mask = create_attention_mask(layout, kernel, device, causal=causal, past_length=past_length,
                                          key_padding=attention_mask if past_key_values is not None else None,
                                          prefix=prefix)
        self_mask = few_token_attention(config, self_mask, source, dtype, training, past_key_values)
        cross_mask = None
        if encoder_hidden_states is not None:
            encoder_padding = None if encoder_attention_mask is None else encoder_attention_mask.bool()
            cross_mask = create_attention_mask(layout, kernel, device, key_padding=encoder_padding,
                                               keys_are_queries=False)
        # The last layer's other tokens are read by nothing when they are neither hidden states to return nor keys
        # kept for later (a cache), and its queries see their whole sequence (no causality, no prefix).
        only_read = read_tokens is not None and not (full_last_layer or output_hidden_states or causal
                                                     or prefix is not None or keys_beyond_queries)
        last_layer_mask = query_subset_mask(layout, kernel, read_tokens) if only_read else None
        return cls(layout, position_ids, token_type_ids, self_mask, cross_mask, past_key_values, use_cache,
                   cache_state, last_layer_mask)


def resolve_positions(config, position_ids: Tensor | None, attention_mask: Tensor | None, batch_size: int,
                      seq_len: int, past_length: int, cache_position: Tensor | None,
                      device: torch.device) -> Tensor:
    """The ``(B, L)`` positions of the forward's tokens (see the module's docstring)."""
    if position_ids is None and config.is_decoder and attention_mask is not None:
        # A decoder's positions count real tokens only, as generation derives them: a left-padded row reads as the
        # row alone (rotated values and the rope types that adapt to the length would see the padding).
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_len:]
    elif position_ids is None and (past_length or cache_position is not None):
        position_ids = cache_position if cache_position is not None else \
            torch.arange(past_length, past_length + seq_len, device=device)
    elif position_ids is None:
        position_ids = torch.arange(seq_len, device=device)
    return position_ids.expand(batch_size, seq_len)


def read_on_host(reads: list[Tensor | None], value_checks: int) -> tuple[list[int], ...]:
    """The device tensors of `reads` on the host, in one copy: the first `value_checks` as one flat list of extremes,
    then each other one as its own list (``None`` where its tensor is)."""
    present = [t.reshape(-1).long() for t in reads if t is not None]
    flat = torch.cat([t.to(present[0].device) for t in present]).tolist() if present else []
    values, start = [], 0
    for tensor in reads:
        size = 0 if tensor is None else tensor.numel()
        values.append(None if tensor is None else flat[start:start + size])
        start += size
    extremes = [value for part in values[:value_checks] for value in part]
    return extremes, *values[value_checks:]


# The longest sequence `few_token_attention` sends to `few_rows.attention`: beyond it SDPA's own kernel, which works
# through the keys in blocks, takes over. On a Zen 5 a forward with it took 0.88-0.96x the time up to 256 tokens,
# 0.91x at 512, 0.97x at 1024 and 1.12x at 2048; on an AVX2 EPYC (Zen 3) one layer's attention took 0.69-0.93x the
# time of the rotations and SDPA at 32-256 tokens (benchmarks/RESULTS.md).
FEW_TOKENS_LONGEST = 256


def few_token_attention(config, mask: AttentionMask, source: Tensor, dtype: torch.dtype | None, training: bool,
                        past_key_values: Cache | None) -> AttentionMask:
    """`mask` with `few_rows.attention` bound to its sequences (`AttentionMask.few_tokens`) where self-attention can
    run it in place of rotating and calling SDPA: inference on CPU (no autograd, no attention dropout, no autocast, not
    traced or exported: `source`, the input ids or embeddings, is a real tensor) in float32 or bfloat16, with
    transformers' SDPA as the attention (not replaced in `ALL_ATTENTION_FUNCTIONS`), every token of each sequence
    seeing every other (no padding among the keys, no causality, no prefix, no cache), sequences of at most
    `FEW_TOKENS_LONGEST` tokens, a head size the kernel takes, and the kernel built here (AVX2 and FMA, or AVX-512).
    On a Zen 5 at 16 tokens a call took 0.47-0.68x the time of the two rotations and SDPA call it replaces."""
    layout = mask.layout
    multiple = 32 if config.rotary_layout == "half" else 16
    if (source.device.type != "cpu" or is_tracing(source) or torch.is_grad_enabled()
            or (training and config.attention_probs_dropout_prob > 0)
            or dtype not in (torch.float32, torch.bfloat16) or torch.is_autocast_enabled("cpu")
            or mask.is_causal or mask.dense is not None or not mask.keys_are_queries or past_key_values is not None
            or ALL_ATTENTION_FUNCTIONS.get("sdpa") is not sdpa_attention_forward or config.head_dim % multiple
            or not few_rows.attention_available()):
        return mask
    if mask.form == "varlen" and mask.queries is None and mask.kernel == SDPA_VARLEN:
        lengths = layout.seq_lengths
    elif mask.form == "dense" and mask.kernel == "sdpa" and layout.mode == "dense":
        lengths = (layout.seq_len,) * layout.batch_size
    else:
        return mask
    if max(lengths, default=0) > FEW_TOKENS_LONGEST:
        return mask
    return replace(mask, few_tokens=few_rows.bind_attention(lengths))
