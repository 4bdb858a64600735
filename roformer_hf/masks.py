"""Which keys each query may attend to: the one place a mask is built.

A mask is composed from small mask functions, as transformers' `masking_utils` composes them: each takes index
tensors ``(batch_idx, head_idx, q_idx, kv_idx)`` that broadcast against each other and says, for every combination,
whether the query may see the key. transformers' own functions give padding, causality and packed sequences; this
module adds what RoFormer needs besides:

- the empty-row rule: a row without real tokens sees its first key (softmax over nothing is NaN, and NaN states at
  padding reach the real tokens through a cache);
- a prefix read bidirectionally (UniLM, RoFormer-Sim's `prefix_lm`): the tokens of segment 0 (`token_type_ids`) see
  each other whatever their order, segment 1 is causal;
- a query always sees itself (a causal query at padding would otherwise see nothing).

`create_attention_mask` builds the mask of a forward once, from the batch's layout (`padding.BatchLayout`), and
renders it in the form the attention kernel takes (`AttentionMask.form`), for every layer:

- ``"varlen"``: no tensor; the varlen kernels (flash-attn's, or SDPA sequence by sequence on CPU) read the sequence
  offsets of the layout. Only where the layout says everything: no cache, no prefix, keys that are the queries. A
  kernel that takes causality as a mask (attention dropout on CPU) gets the longest sequence's causal mask, rendered
  once, which each sequence slices. With `QuerySubset` (`query_subset_mask`), some of the tokens are the only
  queries, each seeing every key of its sequence: the last layer of a model whose head reads only those tokens.
- ``"flash"``: the keys' padding ``(B, Lk)``, flash-attn's padded interface (causality from the mask's ``is_causal``).
- ``"dense"``: ``(B, 1, Lq or 1, Lk)`` bool, True = may attend, or ``None`` when every query may see every key.

Kernels given no mask are causal when their module is (transformers' convention): `causal_mask` is that mask.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    or_masks,
    packed_sequence_mask_function,
    padding_mask_function,
)

from .kernels import Kernel
from .padding import BatchLayout

MaskFunction = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
MaskForm = Literal["varlen", "flash", "dense"]


def empty_row_mask_function(token_mask: Tensor) -> MaskFunction:
    """A row of `token_mask` ``(B, L)`` without real tokens sees its first key."""
    empty_rows = ~token_mask.any(dim=-1)  # (B,)

    def inner_mask(batch_idx: Tensor, head_idx: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return empty_rows[batch_idx] & (kv_idx == 0)

    return inner_mask


def prefix_mask_function(prefix: Tensor, past_length: int = 0) -> MaskFunction:
    """The bidirectional prefix of a prefix-LM: a query of the prefix sees every key of it. `prefix` ``(B, L)`` bool
    marks the forward's own tokens; the ``past_length`` cached keys before them are not part of it."""
    prefix_keys = torch.nn.functional.pad(prefix.bool(), (past_length, 0))  # (B, past + L): query i is key past + i

    def inner_mask(batch_idx: Tensor, head_idx: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return prefix_keys[batch_idx, q_idx] & prefix_keys[batch_idx, kv_idx]

    return inner_mask


def diagonal_mask_function(batch_idx: Tensor, head_idx: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """A query sees its own key."""
    return kv_idx == q_idx


def layout_mask_function(layout: BatchLayout) -> MaskFunction | None:
    """What the layout says of self-attention without a cache: packed rows attend within their sequences, padding
    is masked (a row without real tokens sees its first key); ``None`` when every key is visible."""
    if layout.segment_ids is not None:
        return packed_sequence_mask_function(layout.segment_ids)
    if layout.token_mask is None:
        return None
    return or_masks(padding_mask_function(layout.token_mask), empty_row_mask_function(layout.token_mask))


def render(mask_function: MaskFunction, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
           device: torch.device | None = None) -> Tensor:
    """The mask function evaluated on every ``(batch, query, key)``: ``(B or 1, 1, q_length, kv_length)`` bool, the
    queries at key indices ``q_offset + i``. ``q_length=1`` renders a mask that is the same for every query."""
    batch_idx = torch.arange(batch_size, device=device)[:, None, None, None]
    head_idx = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q_idx = (torch.arange(q_length, device=device) + q_offset)[None, None, :, None]
    kv_idx = torch.arange(kv_length, device=device)[None, None, None, :]
    return mask_function(batch_idx, head_idx, q_idx, kv_idx)


def causal_mask(q_length: int, kv_length: int, device: torch.device | None = None) -> Tensor:
    """``(1, 1, Lq, Lk)``: the queries are the last ``Lq`` of the ``Lk`` keys (as after a cache) and each sees the keys
    up to its own."""
    return render(causal_mask_function, 1, q_length, kv_length, kv_length - q_length, device)


@dataclass(frozen=True)
class QuerySubset:
    """Some of the layout's tokens as the only queries of a layer, each attending bidirectionally to every token of its
    sequence (`query_subset_mask`): what the last layer computes when the head reads those tokens only.

    Attributes:
        indices: ``(M,)``, ascending: the queries' flat positions among the layout's tokens.
        token_dims: how many leading dimensions the layout's token shape has (1: ``(N,)``, 2: ``(B, L)``).
        cu_seqlens_q: ``(S + 1,)`` int32 offsets of each sequence's queries among the ``M``.
        cu_seqlens_k: ``(S + 1,)`` int32 offsets of each sequence's keys among the layout's tokens.
        query_lengths, key_lengths: each sequence's count of queries and of keys, on the host.
    """

    indices: Tensor
    token_dims: int
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    query_lengths: tuple[int, ...]
    key_lengths: tuple[int, ...]

    @property
    def longest(self) -> tuple[int, int]:
        """The most queries and the most keys of a sequence."""
        return max(self.query_lengths), max(self.key_lengths)

    def select(self, x: Tensor) -> Tensor:
        """The queries' rows of `x`, given in the layout's token shape ``(*T, ...)``: ``(M, ...)``."""
        return x.flatten(0, self.token_dims - 1).index_select(0, self.indices)


@dataclass(frozen=True)
class AttentionMask:
    """The keys each query of a forward may attend to, rendered once (`create_attention_mask`) for every layer.

    Attributes:
        layout: where the queries sit in the ``(B, L)`` batch.
        form: what the kernel takes (see the module's docstring).
        keys_are_queries: whether keys and values are the queries' own tokens, in the layout's token shape; else
            they are ``(B, Lk, nkv, d)`` (a cache, cross-attention).
        dense: ``(B, 1, Lq or 1, Lk)`` bool for the ``"dense"`` form; ``None``: every key is visible. In the
            ``"varlen"`` form, the causal mask of the longest sequence ``(1, 1, L, L)`` when the kernel takes causality
            as a mask (`kernels.Kernel.masks_causality`), else ``None``.
        key_padding: ``(B, Lk)`` bool, True at real keys, for the ``"flash"`` form; ``None``: every key is real.
        kernel: the name of the attention function that takes this form, in transformers' `ALL_ATTENTION_FUNCTIONS`
            (``"eager"`` is its fallback), chosen once per forward (`kernels.choose_kernel`).
        is_causal: whether each query sees only the keys up to its own position, passed to the kernel as its
            ``is_causal`` (transformers' override of the module's): a decoder's self-attention, unless the forward
            reads as an encoder's (a prefix-LM whose queries all sit in the prefix).
        queries: in the ``"varlen"`` form, the tokens that are the only queries (`QuerySubset`); ``None``: every token
            of the layout queries.
        few_tokens: `few_rows.attention` bound to the layout's sequences, which self-attention calls instead of
            rotating and calling `kernel` (a short input's inference on CPU: `plan.few_token_attention`); ``None``:
            `kernel`.
    """

    layout: BatchLayout
    form: MaskForm = "dense"
    keys_are_queries: bool = True
    dense: Tensor | None = None
    key_padding: Tensor | None = None
    kernel: str = "sdpa"
    is_causal: bool = False
    queries: QuerySubset | None = None
    few_tokens: Callable[..., Tensor] | None = None

    @property
    def tensor(self) -> Tensor | None:
        """The mask a kernel on the padded layout takes: the keys' padding for flash-attn, else the dense mask."""
        return self.key_padding if self.form == "flash" else self.dense

    def select_queries(self, x: Tensor) -> Tensor:
        """`x` ``(*T, ...)`` in the layout's token shape, at the queries only: ``(M, ...)`` with a `QuerySubset`, else
        `x` itself."""
        return x if self.queries is None else self.queries.select(x)


def query_subset_mask(layout: BatchLayout, kernel: Kernel, read: Tensor) -> AttentionMask | None:
    """Self-attention whose only queries are the tokens `read` marks, ``(B, L)`` bool, each seeing every token of its
    sequence (bidirectional, without a cache or a prefix), through `kernel`'s varlen function: a layer's output at
    those tokens alone, for a last layer whose head reads nothing else. ``None`` where that cannot run: a kernel
    without a varlen function (eager), a padded layout (whose keys need a mask). Reads the queries' count per
    sequence on the host (one copy)."""
    if kernel.varlen is None or layout.mode == "padded":
        return None
    flat = layout.gather_tokens(read).flatten()
    if layout.cu_seqlens is None:  # one whole row per sequence
        key_lengths = (layout.seq_len,) * layout.batch_size
        cu_seqlens_k = torch.arange(0, flat.numel() + 1, layout.seq_len, dtype=torch.int32, device=flat.device)
    else:
        key_lengths, cu_seqlens_k = layout.seq_lengths, layout.cu_seqlens
    running = torch.nn.functional.pad(flat.long().cumsum(0), (1, 0))
    counts = running[cu_seqlens_k[1:].long()] - running[cu_seqlens_k[:-1].long()]
    query_lengths = tuple(counts.tolist())
    offsets = [0, *itertools.accumulate(query_lengths)]
    subset = QuerySubset(
        indices=torch.nonzero_static(flat, size=offsets[-1]).squeeze(-1),
        token_dims=1 if layout.mode == "varlen" else 2, cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32, device=flat.device), cu_seqlens_k=cu_seqlens_k,
        query_lengths=query_lengths, key_lengths=key_lengths)
    return AttentionMask(layout, "varlen", kernel=kernel.varlen, queries=subset)


def create_attention_mask(layout: BatchLayout, kernel: Kernel, device: torch.device | None = None, *,
                          causal: bool = False, past_length: int = 0, key_padding: Tensor | None = None,
                          prefix: Tensor | None = None, keys_are_queries: bool | None = None) -> AttentionMask:
    """The mask of one forward, in the form the attention functions of `kernel` take.

    Args:
        layout: where the queries sit (and the keys, for self-attention without a cache).
        kernel: the attention functions of the forward (`kernels.choose_kernel`): a varlen one, when it has one,
            takes the ``"varlen"`` form; flash-attn's padded one the keys' padding; the others a dense mask.
        device: where the tokens are.
        causal: each query sees the keys up to its own position (a decoder's self-attention).
        past_length: keys from a cache before the queries' own; query ``i`` sits at key index ``past_length + i``.
        key_padding: ``(B, Lk)``, True at real keys, when the keys are not the queries' tokens (a cache: ``Lk = past +
            L``, the whole attention mask as generation passes it; cross-attention: the encoder's tokens); ``None``:
            every key is real.
        prefix: ``(B, L)`` bool, True at the queries of a bidirectional prefix (segment 0 of a prefix-LM).
        keys_are_queries: whether the keys are the queries' own tokens (default: when no `key_padding` is given and
            there is no cache); cross-attention without an encoder mask passes False.
    """
    if keys_are_queries is None:
        keys_are_queries = key_padding is None and not past_length
    layout_only = keys_are_queries and prefix is None
    if layout_only and layout.cu_seqlens is not None and kernel.varlen is not None:
        # Kernels that take a mask where flash-attn takes `is_causal` (attention dropout on CPU) slice their
        # sequence's causal mask from the longest one's, rendered here once.
        longest = causal_mask(layout.max_seqlen, layout.max_seqlen, device) if causal and kernel.masks_causality \
            else None
        return AttentionMask(layout, "varlen", dense=longest, kernel=kernel.varlen, is_causal=causal)
    if kernel.takes_key_padding:
        if prefix is not None:
            raise ValueError("flash-attn cannot apply a bidirectional prefix (prefix_lm): use "
                             "attn_implementation='sdpa' or 'eager'")
        if layout.has_packed_rows:
            raise ValueError("flash-attn on the padded layout cannot keep packed sequences apart; let the model skip "
                             "padding (config.unpad_inputs=True) and do not trace it")
        return AttentionMask(layout, "flash", keys_are_queries,
                             key_padding=layout.token_mask if keys_are_queries else key_padding, kernel=kernel.padded,
                             is_causal=causal)
    if not keys_are_queries and key_padding is None and not past_length:  # cross-attention to every encoder token
        return AttentionMask(layout, "dense", False, kernel=kernel.padded)  # never causal
    return AttentionMask(layout, "dense", keys_are_queries, dense=dense_mask(layout, device, causal, past_length,
                                                                             key_padding, prefix),
                         kernel=kernel.padded, is_causal=causal)


def dense_mask(layout: BatchLayout, device: torch.device | None, causal: bool, past_length: int,
               key_padding: Tensor | None, prefix: Tensor | None) -> Tensor | None:
    """``(B, 1, Lq or 1, Lk)`` bool (see `create_attention_mask` for the arguments), ``None`` when all is visible.
    Without causality the mask is the same for every query (``Lq = 1``) unless rows are packed."""
    seq_len = layout.seq_len
    kv_length = past_length + seq_len if key_padding is None else key_padding.shape[-1]
    allowed = layout_mask_function(layout) if key_padding is None else padding_mask_function(key_padding.bool())
    if not causal:
        if allowed is None:
            return None
        q_length = seq_len if layout.segment_ids is not None and key_padding is None else 1
        return render(allowed, layout.batch_size, q_length, kv_length, device=device)
    visible = causal_mask_function if prefix is None else or_masks(causal_mask_function,
                                                                   prefix_mask_function(prefix, past_length))
    if allowed is not None:
        visible = and_masks(allowed, visible)
    batch_size = layout.batch_size if allowed is not None or prefix is not None else 1
    return render(or_masks(visible, diagonal_mask_function), batch_size, seq_len, kv_length, past_length, device)
