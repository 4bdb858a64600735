"""Skipping padding: where the real tokens of a batch sit, and how tensors move between layouts.

A padded batch ``(B, L, ...)`` with an attention mask becomes ``(N, ...)``, the ``N`` real tokens side by side.
Projections, the feed-forward, norms and the MLM head are token-wise, so they run on the packed tokens unchanged
and spend nothing on padding. Only attention needs the sequences apart (see `attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from transformers.utils.import_utils import is_torchdynamo_exporting

LayoutMode = Literal["dense", "padded", "varlen"]


def graph_must_fit_any_mask() -> bool:
    """While `torch.export` or `torch.jit.trace` records a graph, that graph must serve every attention mask of the
    input's shape: no branch or shape may depend on the mask's values, so the batch keeps its padded layout."""
    return is_torchdynamo_exporting() or torch.jit.is_tracing()


@dataclass(frozen=True)
class BatchLayout:
    """How the tokens of a ``(B, L)`` batch are laid out while the encoder runs.

    Modes:
        ``"dense"``: ``(B, L, ...)``, every token is real; attention needs no mask.
        ``"padded"``: ``(B, L, ...)``; attention masks the padding with `key_mask`.
        ``"varlen"``: ``(N, ...)``, the real tokens only; sequence ``k`` holds rows
            ``cu_seqlens[k]:cu_seqlens[k + 1]``.

    Attributes:
        token_mask: ``(B, L)`` boolean, True at the real tokens; ``None`` in dense mode.
        key_mask: ``(B, 1, 1, L)`` boolean, True where a key may be attended to in the padded layout; ``None`` in
            dense mode.
        indices, padding_indices: flat positions (in ``B * L``) of the real tokens and of the padding (varlen mode).
        cu_seqlens: ``(B + 1,)`` int32 offsets of the sequences among the real tokens (varlen mode).
        max_seqlen: the longest sequence, on the host (varlen mode).
    """

    mode: LayoutMode
    batch_size: int
    seq_len: int
    token_mask: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    padding_indices: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    @classmethod
    def from_attention_mask(
        cls, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, unpad: bool = True
    ) -> BatchLayout:
        """The layout of a ``(B, L)`` mask (1 = real token, 0 = padding); ``None`` means no padding.

        Padding is skipped (varlen mode) when there is some and `unpad`; ``unpad=False`` and graphs recorded for
        every mask (`graph_must_fit_any_mask`) keep the padded layout.
        """
        if attention_mask is None:
            return cls("dense", batch_size, seq_len)
        mask = attention_mask.bool()
        if graph_must_fit_any_mask():
            return cls._padded(mask)
        lengths = mask.sum(dim=-1)
        host_lengths = lengths.tolist()  # the one host sync: picks the mode and gives the longest sequence
        real_tokens = sum(host_lengths)
        if real_tokens == batch_size * seq_len:
            return cls("dense", batch_size, seq_len)
        if not unpad:
            return cls._padded(mask)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return cls("varlen", batch_size, seq_len, token_mask=mask, key_mask=_key_mask(mask),
                   indices=mask.flatten().nonzero().squeeze(-1),
                   padding_indices=(~mask).flatten().nonzero().squeeze(-1),
                   cu_seqlens=cu_seqlens, max_seqlen=max(host_lengths))

    @classmethod
    def _padded(cls, mask: torch.Tensor) -> BatchLayout:
        return cls("padded", *mask.shape, token_mask=mask, key_mask=_key_mask(mask))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, ...)`` -> the layout's token shape: ``(N, ...)`` in varlen mode, else unchanged."""
        if self.mode != "varlen":
            return x
        return x.flatten(0, 1).index_select(0, self.indices)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """The layout's token shape -> ``(B, L, ...)``, zeros at the padding in varlen mode."""
        if self.mode != "varlen":
            return x
        # Write every row once: the real tokens, then zeros at the padding (cheaper than zero-filling it all first,
        # which matters for (B, L, vocab) logits).
        padded = x.new_empty(self.batch_size * self.seq_len, *x.shape[1:])
        padded = padded.index_copy_(0, self.indices, x).index_fill_(0, self.padding_indices, 0)
        return padded.view(self.batch_size, self.seq_len, *x.shape[1:])

    @cached_property
    def blocks(self) -> list[tuple[int, int, int]] | None:
        """Varlen mode, every sequence's real tokens contiguous (right or left padding): each sequence as one run of
        rows, ``(packed start, flat padded start, length)``. ``None`` for other modes and masks with holes. One
        device-to-host copy, made only when asked for."""
        if self.mode != "varlen":
            return None
        offsets = self.cu_seqlens.tolist()
        spans = [(start, end) for start, end in zip(offsets[:-1], offsets[1:]) if end > start]
        starts = [start for start, _ in spans]
        firsts_lasts = self.indices[starts + [end - 1 for _, end in spans]].tolist()
        firsts, lasts = firsts_lasts[:len(starts)], firsts_lasts[len(starts):]
        if any(last - first != end - start - 1 for first, last, (start, end) in zip(firsts, lasts, spans)):
            return None
        return [(start, first, end - start) for first, (start, end) in zip(firsts, spans)]

    def edge_tokens(self, x: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Each sequence's first real token (its [CLS]), or its last one, ``(B, ...)``, from states in this layout;
        right and left padding alike, zeros for a sequence without real tokens."""
        padded = self.unpack(x)
        if self.token_mask is None:
            return padded[:, -1 if last else 0]
        real = self.token_mask.int()  # argmax gives the first maximal position
        position = self.seq_len - 1 - real.flip(-1).argmax(-1) if last else real.argmax(-1)
        tokens = padded[torch.arange(self.batch_size, device=padded.device), position]
        has_tokens = self.token_mask.any(dim=-1).view(-1, *[1] * (tokens.dim() - 1))
        return torch.where(has_tokens, tokens, 0)


def _key_mask(token_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` real tokens -> ``(B, 1, 1, L)`` keys to attend to. A fully padded row would leave softmax nothing
    to normalise (NaN); it sees its first (zero) key instead."""
    key_mask = token_mask.clone()
    key_mask[:, 0] |= ~token_mask.any(dim=-1)
    return key_mask[:, None, None, :]
