"""Skipping padding: where the sequences of a batch sit, and how tensors move between layouts.

A padded batch ``(B, L, ...)`` with an attention mask becomes ``(N, ...)``, the ``N`` real tokens side by side.
Projections, the feed-forward, norms and the MLM head are token-wise, so they run on the packed tokens unchanged
and spend nothing on padding. Only attention needs the sequences apart (see `attention.py`).

Rows may also hold several sequences back to back, without padding (transformers' `DataCollatorWithFlattening`):
their boundaries come from `cu_seq_lens_q`/`cu_seq_lens_k`, or from `position_ids` that restart, and attention
stays inside each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from transformers.masking_utils import find_packed_sequence_indices
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

    @classmethod
    def from_inputs(cls, batch_size: int, seq_len: int, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                    unpad: bool = True) -> BatchLayout:
        """The layout of a batch: packed rows when `cu_seqlens` is given or, without an attention mask, when
        `position_ids` restart inside a row (a new sequence wherever a position does not follow its predecessor by
        exactly 1, as transformers detects packed rows); else one sequence per row, padded by `attention_mask`."""
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("Pass attention_mask or cu_seq_lens_q/cu_seq_lens_k, not both: packed sequences "
                                 "(cu_seq_lens) have no padding to mask")
            return cls._packed(batch_size, seq_len, cu_seqlens)
        if attention_mask is None and position_ids is not None:
            segment_ids = find_packed_sequence_indices(position_ids)  # None: one sequence per row
            if segment_ids is not None:
                if graph_must_fit_any_mask():
                    return cls("padded", batch_size, seq_len, segment_ids=segment_ids)
                starts = torch.ones_like(segment_ids, dtype=torch.bool)
                starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
                flat_starts = starts.flatten().nonzero().squeeze(-1)
                total = torch.tensor([batch_size * seq_len], device=flat_starts.device)
                return cls._packed(batch_size, seq_len, torch.cat([flat_starts, total]))
        return cls.from_attention_mask(attention_mask, batch_size, seq_len, unpad)

    @classmethod
    def _packed(cls, batch_size: int, seq_len: int, cu_seqlens: torch.Tensor) -> BatchLayout:
        offsets = cu_seqlens.tolist()  # the one host sync: checks, and the longest sequence
        total = batch_size * seq_len
        if cu_seqlens.dim() != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
            raise ValueError(f"cu_seq_lens_q = {offsets}: expected sequence offsets from 0 to the number of tokens, "
                             f"{total} ({batch_size} row(s) of {seq_len})")
        lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
        if min(lengths) <= 0:
            raise ValueError(f"cu_seq_lens_q = {offsets}: expected strictly increasing offsets (no empty sequence)")
        if not {row * seq_len for row in range(batch_size)} <= set(offsets):
            raise ValueError(f"cu_seq_lens_q = {offsets}: a sequence crosses from one row to the next; expected a "
                             f"boundary at every multiple of the row length {seq_len}")
        cu_seqlens = cu_seqlens.to(torch.int32)
        # Which sequence of its row each token belongs to, for attention on the padded layout (a block mask).
        flat_ids = torch.zeros(total, dtype=torch.int64, device=cu_seqlens.device)
        flat_ids[cu_seqlens[1:-1].long()] = 1
        segment_ids = flat_ids.view(batch_size, seq_len).cumsum(-1)
        return cls("packed", batch_size, seq_len, segment_ids=segment_ids, cu_seqlens=cu_seqlens,
                   max_seqlen=max(lengths))

    @classmethod
    def from_attention_mask(
        cls, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, unpad: bool = True
    ) -> BatchLayout:
        """The layout of a ``(B, L)`` mask (1 = real token, 0 = padding); ``None`` means no padding.

        Padding is skipped (varlen mode) when there is some and `unpad`. ``unpad=False`` and graphs recorded for
        every mask (`graph_must_fit_any_mask`) keep the padded layout without reading the mask's values, so that
        nothing depends on them (`torch.compile(fullgraph=True)` works there).
        """
        if attention_mask is None:
            return cls("dense", batch_size, seq_len)
        mask = attention_mask.bool()
        if not unpad or graph_must_fit_any_mask():  # no look at the mask's values: torch.compile(fullgraph=True)
            return cls._padded(mask)
        lengths = mask.sum(dim=-1)
        host_lengths = lengths.tolist()  # the one host sync: picks the mode and gives the longest sequence
        if sum(host_lengths) == batch_size * seq_len:
            return cls("dense", batch_size, seq_len)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return cls("varlen", batch_size, seq_len, token_mask=mask,
                   indices=mask.flatten().nonzero().squeeze(-1),
                   padding_indices=(~mask).flatten().nonzero().squeeze(-1),
                   cu_seqlens=cu_seqlens, max_seqlen=max(host_lengths))

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
        rows, ``(packed start, flat padded start, length)``. ``None`` for other modes and masks with holes. One
        device-to-host copy."""
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
