"""Which keys each query may attend to: one description per forward (`AttentionMask`), read by every kernel.

An encoder's queries and keys are the same tokens, so the batch's layout (`padding.BatchLayout`) says it all: padding
and packed rows. A decoder adds what the layout cannot say:

- causality: query ``i`` sees keys up to its own position;
- a cache: keys from earlier forwards come first (``past_length`` of them), so keys outnumber queries, and the
  padding of the keys is the whole `attention_mask` ``(B, past + L)``, as transformers' generation passes it;
- a prefix read bidirectionally (UniLM, RoFormer-Sim): the tokens of segment 0 (`token_type_ids`) see each other
  whatever their order, segment 1 is causal;
- cross-attention: keys from an encoder, with their own padding.

Kernels that take a dense mask get `AttentionMask.dense()`; the varlen kernels, which cannot take one, are used only
where the layout and `module.is_causal` say everything (`AttentionMask.is_layout_only`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .padding import BatchLayout


@dataclass(frozen=True)
class AttentionMask:
    """The keys each query of a forward may attend to, built once per forward (`RoFormerModel.encode`) for every layer.

    Attributes:
        layout: where the queries sit in the ``(B, L)`` batch (and the keys, for self-attention without a cache).
        device: where the tokens are.
        causal: each query sees the keys up to its own position (self-attention of a decoder).
        past_length: keys from a cache before the queries' own; query ``i`` sits at key index ``past_length + i``.
        key_padding: ``(B, Lk)`` bool, True at real keys, when the keys are not the queries' tokens (a cache: ``Lk =
            past_length + L``; cross-attention: the encoder's tokens); else the layout's padding applies.
        prefix: ``(B, L)`` bool, True at the queries' tokens of the bidirectional prefix (segment 0 of a prefix-LM);
            every query of the prefix sees all of it.
    """

    layout: BatchLayout
    device: torch.device | None = None
    causal: bool = False
    past_length: int = 0
    key_padding: Tensor | None = None
    prefix: Tensor | None = None

    @property
    def is_layout_only(self) -> bool:
        """Whether the layout (and causality, which kernels read from ``module.is_causal``) says everything: no cache,
        no prefix, no keys of another length. Only then may a kernel that takes no mask (varlen) run."""
        return not self.past_length and self.key_padding is None and self.prefix is None

    def dense(self) -> Tensor | None:
        """The mask for kernels on the padded layout: ``(B, 1, Lq or 1, Lk)`` bool, True = may attend; ``None`` when
        every query may see every key.

        No query is left without a key (its softmax would be NaN, and NaN states at padding reach the real tokens
        through a cache): a padding query of self-attention sees at least itself, and a row of the layout's own
        mask without real keys its first key."""
        layout = self.layout
        if self.key_padding is not None:
            allowed = self.key_padding.bool()[:, None, None, :]  # (B, 1, 1, Lk)
        else:
            allowed = layout.key_mask  # (B, 1, 1 or L, L) or None
        if not self.causal:
            return allowed
        query_index = torch.arange(layout.seq_len, device=self.device) + self.past_length  # (L,)
        key_index = torch.arange(self.past_length + layout.seq_len, device=self.device)  # (Lk,)
        visible = key_index <= query_index[:, None]  # (L, Lk)
        if self.prefix is not None:  # the prefix's keys are visible to the prefix's queries
            prefix_keys = torch.nn.functional.pad(self.prefix.bool(), (self.past_length, 0))  # (B, Lk)
            visible = visible | (self.prefix.bool()[:, :, None] & prefix_keys[:, None, :])  # (B, L, Lk)
        visible = visible if visible.dim() == 3 else visible[None]
        mask = visible[:, None] if allowed is None else allowed & visible[:, None]
        return mask | (key_index == query_index[:, None])  # (B, 1, L, Lk): a query always sees itself

    def key_padding_2d(self) -> Tensor | None:
        """The keys' padding as a ``(B, Lk)`` mask (flash-attn's padded interface), ``None`` when every key is real."""
        if self.key_padding is not None:
            return self.key_padding
        return self.layout.token_mask
