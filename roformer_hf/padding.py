"""Skipping padding: where the sequences of a batch sit, and how tensors move between layouts.

A padded batch ``(B, L, ...)`` with an attention mask becomes ``(N, ...)``, the ``N`` real tokens side by side.
Projections, the feed-forward, norms and the MLM head are token-wise, so they run on the packed tokens unchanged
and spend nothing on padding. Only attention needs the sequences apart (see `attention.py`).

Rows may also hold several sequences back to back, without padding (transformers' `DataCollatorWithFlattening`):
their boundaries come from `cu_seq_lens_q`/`cu_seq_lens_k`, or from `position_ids` that restart, and attention
stays inside each sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from transformers.utils.import_utils import is_torchdynamo_exporting

LayoutMode = Literal["dense", "padded", "varlen", "packed"]


def graph_must_fit_any_mask() -> bool:
    """While `torch.export` or `torch.jit.trace` records a graph, that graph must serve every attention mask of the
    input's shape: no branch or shape may depend on the mask's values, so the batch keeps its padded layout."""
    return is_torchdynamo_exporting() or torch.jit.is_tracing()


@dataclass(frozen=True)
class BatchLayout:
    """How the tokens of a ``(B, L)`` batch are laid out while the encoder runs.

    Modes:
        ``"dense"``: ``(B, L, ...)``, one sequence per row, every token real; attention needs no mask.
        ``"padded"``: ``(B, L, ...)``; attention masks the padding, or the other sequences of a row
            (`masks.layout_mask_function`).
        ``"varlen"``: ``(N, ...)``, the real tokens only; sequence ``k`` holds rows
            ``cu_seqlens[k]:cu_seqlens[k + 1]``.
        ``"packed"``: ``(B, L, ...)``, every token real, several sequences per row; sequence ``k`` holds the
            flat tokens ``cu_seqlens[k]:cu_seqlens[k + 1]`` of ``B * L``.

    Attributes:
        token_mask: ``(B, L)`` boolean, True at the real tokens; ``None`` when every token is real.
        segment_ids: ``(B, L)``, which sequence of its row each token belongs to; ``None`` for one sequence per row.
        indices, padding_indices: flat positions (in ``B * L``) of the real tokens and of the padding (varlen mode).
        cu_seqlens: int32 offsets of the sequences among the layout's tokens (varlen and packed modes).
        max_seqlen: the longest sequence, on the host (varlen and packed modes).
        seq_lengths: every sequence's length, on the host (varlen and packed modes): what the varlen kernels split
            the tokens by, read once per forward.
        row_edges: each row's first and last real column, on the host (varlen mode; ``(L, -1)`` for a row without
            real tokens).
    """

    mode: LayoutMode
    batch_size: int
    seq_len: int
    token_mask: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    padding_indices: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    seq_lengths: tuple[int, ...] = ()
    row_edges: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_inputs(cls, batch_size: int, seq_len: int, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                    unpad: bool = True, host: list[int] | None = None) -> BatchLayout:
        """The layout of a batch: packed rows when `cu_seqlens` is given or, without an attention mask, when
        `position_ids` restart inside a row (a new sequence wherever a position does not follow its predecessor by
        exactly 1, as transformers detects packed rows); else one sequence per row, padded by `attention_mask`.

        `host`: the values of `layout_reads` (same arguments), when the caller read them already with its own (one
        device-to-host copy per forward); ``None``: read here. Packed rows found from `position_ids` need a second
        read, for their offsets.
        """
        if host is None:
            reads = layout_reads(attention_mask, position_ids, cu_seqlens, unpad)
            host = None if reads is None else reads.tolist()
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("Pass attention_mask or cu_seq_lens_q/cu_seq_lens_k, not both: packed sequences "
                                 "(cu_seq_lens) have no padding to mask")
            return cls._packed(batch_size, seq_len, cu_seqlens, host)
        if attention_mask is None and position_ids is not None:
            if graph_must_fit_any_mask():
                return cls("padded", batch_size, seq_len, segment_ids=segment_ids_of(position_ids))
            if sum(host):  # some row's positions restart: packed rows
                segment_ids = segment_ids_of(position_ids)
                starts = torch.ones_like(segment_ids, dtype=torch.bool)
                starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
                flat_starts = torch.nonzero_static(starts.flatten(), size=batch_size + sum(host)).squeeze(-1)
                total = torch.tensor([batch_size * seq_len], device=flat_starts.device)
                return cls._packed(batch_size, seq_len, torch.cat([flat_starts, total]))
        return cls.from_attention_mask(attention_mask, batch_size, seq_len, unpad, host)

    @classmethod
    def _packed(cls, batch_size: int, seq_len: int, cu_seqlens: torch.Tensor,
                offsets: list[int] | None = None) -> BatchLayout:
        if offsets is None:
            offsets = cu_seqlens.tolist()  # checks, and the sequences' lengths
        total = batch_size * seq_len
        if cu_seqlens.dim() != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
            raise ValueError(f"cu_seq_lens_q = {offsets}: expected sequence offsets from 0 to the number of tokens, "
                             f"{total} ({batch_size} row(s) of {seq_len})")
        lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
        if min(lengths) <= 0:
            raise ValueError(f"cu_seq_lens_q = {offsets}: expected strictly increasing offsets (no empty sequence)")
        if batch_size > 1 and not {row * seq_len for row in range(1, batch_size)} <= set(offsets):  # row 0: above
            raise ValueError(f"cu_seq_lens_q = {offsets}: a sequence crosses from one row to the next; expected a "
                             f"boundary at every multiple of the row length {seq_len}")
        cu_seqlens = cu_seqlens.to(torch.int32)
        # Which sequence of its row each token belongs to, for attention on the padded layout (a block mask).
        flat_ids = torch.zeros(total, dtype=torch.int64, device=cu_seqlens.device)
        flat_ids[cu_seqlens[1:-1].long()] = 1
        segment_ids = flat_ids.view(batch_size, seq_len).cumsum(-1)
        return cls("packed", batch_size, seq_len, segment_ids=segment_ids, cu_seqlens=cu_seqlens,
                   max_seqlen=max(lengths), seq_lengths=tuple(lengths))

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int,
                            unpad: bool = True, host: list[int] | None = None) -> BatchLayout:
        """The layout of a ``(B, L)`` mask (1 = real token, 0 = padding); ``None`` means no padding.

        Padding is skipped (varlen mode) when there is some and `unpad`. ``unpad=False`` and graphs recorded for
        every mask (`graph_must_fit_any_mask`) keep the padded layout without reading the mask's values, so that
        nothing depends on them (`torch.compile(fullgraph=True)` works there). `host`: `mask_facts` of the mask, read
        by the caller; ``None``: read here.
        """
        if attention_mask is None:
            return cls("dense", batch_size, seq_len)
        mask = attention_mask.bool()
        if not unpad or graph_must_fit_any_mask():  # no look at the mask's values: torch.compile(fullgraph=True)
            return cls._padded(mask)
        if host is None:
            host = mask_facts(mask).tolist()  # picks the mode, gives the lengths and where each row's tokens are
        lengths, firsts, lasts = host[:batch_size], host[batch_size:2 * batch_size], host[2 * batch_size:]
        real = sum(lengths)
        if real == batch_size * seq_len:
            return cls("dense", batch_size, seq_len)
        flat = mask.flatten()
        offsets = [0, *itertools.accumulate(lengths)]
        return cls("varlen", batch_size, seq_len, token_mask=mask,
                   indices=torch.nonzero_static(flat, size=real).squeeze(-1),
                   padding_indices=torch.nonzero_static(~flat, size=flat.numel() - real).squeeze(-1),
                   cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=mask.device),
                   max_seqlen=max(lengths), seq_lengths=tuple(lengths), row_edges=tuple(zip(firsts, lasts)))

    @classmethod
    def _padded(cls, mask: torch.Tensor) -> BatchLayout:
        return cls("padded", *mask.shape, token_mask=mask)

    @property
    def has_packed_rows(self) -> bool:
        """Whether rows hold several sequences (packed rows, in the "packed" mode or, traced, the "padded" one)."""
        return self.segment_ids is not None

    def require_one_sequence_per_row(self, user: str) -> None:
        """Sequence-level outputs (one per row) have no meaning for packed rows: refuse them."""
        if self.has_packed_rows:
            raise ValueError(f"{user} gives one output per row, but the rows hold several sequences (packed with "
                             "cu_seq_lens_q/k, or position_ids that restart). Pass one sequence per row, padded "
                             "with an attention_mask, e.g. with DataCollatorWithPadding instead of "
                             "DataCollatorWithFlattening")

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, ...)`` -> the layout's token shape: the real tokens ``(N, ...)`` in varlen mode; unchanged in the
        others, whose token shape is the batch's."""
        if self.mode != "varlen":
            return x
        return x.flatten(0, 1).index_select(0, self.indices)

    def scatter_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `gather_tokens`: the layout's token shape -> ``(B, L, ...)``, zeros at the padding in varlen
        mode."""
        if self.mode != "varlen":
            return x
        # Write every row once: the real tokens, then zeros at the padding (cheaper than zero-filling it all first,
        # which matters for (B, L, vocab) logits).
        padded = x.new_empty(self.batch_size * self.seq_len, *x.shape[1:])
        padded = padded.index_copy_(0, self.indices, x).index_fill_(0, self.padding_indices, 0)
        return padded.view(self.batch_size, self.seq_len, *x.shape[1:])

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """An output in the layout's token shape -> ``(B, L, ...)`` with zeros at the padding, in every mode (so that
        eager, traced and exported models return the same tensors)."""
        if self.mode == "padded" and self.token_mask is not None:
            return x.masked_fill(~self.token_mask.view(*self.token_mask.shape, *[1] * (x.dim() - 2)), 0)
        return self.scatter_tokens(x)

    def blocks(self) -> list[tuple[int, int, int]] | None:
        """Varlen mode, every sequence's real tokens contiguous (right or left padding): each sequence as one run of
        rows, ``(packed start, flat padded start, length)``. ``None`` for other modes and masks with holes. Read from
        the host-side lengths and edges: no device-to-host copy."""
        if self.mode != "varlen":
            return None
        spans, start = [], 0
        for row, (length, (first, last)) in enumerate(zip(self.seq_lengths, self.row_edges)):
            if length:
                if last - first != length - 1:
                    return None
                spans.append((start, row * self.seq_len + first, length))
            start += length
        return spans

    def mean_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of each sequence's real tokens, ``(B, ...)``, from states in this layout; zeros for a sequence
        without real tokens."""
        padded = self.to_padded(x)  # zeros at the padding
        if self.token_mask is None:
            return padded.mean(dim=1)
        counts = self.token_mask.sum(dim=-1).clamp(min=1).to(padded.dtype)
        return padded.sum(dim=1) / counts.view(-1, *[1] * (padded.dim() - 2))

    def edge_tokens(self, x: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Each sequence's first real token (its [CLS]), or its last one, ``(B, ...)``, from states in this layout;
        right and left padding alike, zeros for a sequence without real tokens."""
        padded = self.scatter_tokens(x)
        if self.token_mask is None:
            return padded[:, -1 if last else 0]
        real = self.token_mask.int()  # argmax gives the first maximal position
        position = self.seq_len - 1 - real.flip(-1).argmax(-1) if last else real.argmax(-1)
        tokens = padded[torch.arange(self.batch_size, device=padded.device), position]
        has_tokens = self.token_mask.any(dim=-1).view(-1, *[1] * (tokens.dim() - 1))
        return torch.where(has_tokens, tokens, 0)


def mask_facts(mask: torch.Tensor) -> torch.Tensor:
    """What the layout of a ``(B, L)`` bool mask needs on the host, as one ``(3 * B,)`` int64 tensor on its device:
    each row's count of real tokens, then its first real column, then its last (``L`` and ``-1`` for a row without
    real tokens)."""
    columns = torch.arange(mask.shape[-1], device=mask.device)
    firsts = torch.where(mask, columns, mask.shape[-1]).amin(-1)
    lasts = torch.where(mask, columns, -1).amax(-1)
    return torch.cat([mask.sum(-1), firsts, lasts])


def segment_ids_of(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, L)``: which sequence of its row each token belongs to, a new one wherever a position does not follow its
    predecessor by exactly 1 (transformers' `find_packed_sequence_indices`, without its check for no restart)."""
    restarts = torch.diff(position_ids, dim=-1) != 1
    return torch.nn.functional.pad(restarts, (1, 0)).cumsum(-1)


def layout_reads(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None, unpad: bool = True) -> torch.Tensor | None:
    """The device values `BatchLayout.from_inputs` needs on the host, as a 1-D int64 tensor (``None``: none), so that
    a caller reads them with its own in one copy: the packed offsets; or, for positions without a mask, how often
    each row's positions restart; or the mask's `mask_facts` when padding is skipped."""
    if graph_must_fit_any_mask():
        return None
    if cu_seqlens is not None:
        return cu_seqlens.long()
    if attention_mask is None:
        return None if position_ids is None else (torch.diff(position_ids, dim=-1) != 1).sum(-1)
    return mask_facts(attention_mask.bool()) if unpad else None


def logits_in_padded_layout(head: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor,
                            layout: BatchLayout, min_rows: int = 64, max_rows: int = 512) -> torch.Tensor:
    """``layout.to_padded(head(hidden_states))`` for the MLM head, whose output is wide: ``(B, L, vocab_size)``.

    On CPU, with contiguous sequences of ``min_rows`` tokens on average or more, the head runs one sequence at a
    time, at most ``max_rows`` tokens per call, and its logits are copied into their rows of the padded output: no
    packed ``(N, vocab)`` intermediate, only ``max_rows`` tokens' logits at a time (25 MB at 12000 words in fp32),
    whose memory the allocator reuses. Shorter sequences would make each GEMM too
    small (re-reading the whole decoder weight), so they, other devices and masks with holes take
    ``to_padded(head(x))``.
    """
    blocks = layout.blocks() if hidden_states.device.type == "cpu" else None
    if not blocks or hidden_states.shape[0] < min_rows * len(blocks):
        return layout.to_padded(head(hidden_states))
    padded, end = None, 0
    for packed_start, padded_start, length in blocks:
        for offset in range(0, length, max_rows):
            rows = min(max_rows, length - offset)
            logits = head(hidden_states[packed_start + offset:packed_start + offset + rows])  # (rows, V)
            if padded is None:  # the logits' width and dtype (autocast, adapters, quantized layers), as computed
                padded = logits.new_empty(layout.batch_size * layout.seq_len, logits.shape[-1])
            padded[padded_start + offset:padded_start + offset + rows] = logits
        padded[end:padded_start] = 0
        end = padded_start + length
    padded[end:] = 0
    return padded.view(layout.batch_size, layout.seq_len, -1)
