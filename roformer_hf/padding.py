"""Skipping padding: every token-wise layer runs on the real tokens only.

A padded batch ``(B, L, ...)`` with an attention mask becomes ``(N, ...)``, the ``N`` real tokens side by side.
Projections, the feed-forward, LayerNorms and the MLM head are token-wise, so they run on the packed tokens
unchanged and spend nothing on padding. Only attention needs the sequences apart: it scatters its packed
queries, keys and values back to ``(B, L, ...)`` (or hands flash-attn the sequence boundaries).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch


def _exporting() -> bool:
    """Whether torch.export is tracing (torch 2.7+ can tell; earlier releases never report it)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting is not None and is_exporting())


@dataclass
class PackedBatch:
    """Where the real tokens of a padded batch sit.

    Attributes:
        batch_size, seq_len: ``B`` and ``L`` of the padded batch.
        indices: ``(N,)`` flat positions (in ``B * L``) of the real tokens, or ``None`` when nothing is padded
            and tensors keep their ``(B, L, ...)`` shape.
        key_mask: ``(B, 1, 1, L)`` boolean, True where a key may be attended to; ``None`` without padding.
        cu_seqlens: ``(B + 1,)`` int32 offsets of each sequence among the packed tokens (flash-attn varlen).
        max_seqlen: the longest sequence.
        spans: ``(start, end)`` of each non-empty sequence among the packed tokens, on the host.
        padding_indices: ``(B * L - N,)`` flat positions of the padding.
        mask: ``(B, L)`` boolean, True at the real tokens; ``None`` without padding.
    """

    batch_size: int
    seq_len: int
    indices: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    spans: list[tuple[int, int]] | None = None
    padding_indices: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @classmethod
    def from_attention_mask(
        cls, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, unpad: bool = True
    ) -> PackedBatch:
        """Builds the layout of a ``(B, L)`` mask (1 = real token, 0 = padding); ``None`` means no padding.

        With ``unpad=False`` tensors stay padded and attention masks the padding instead.
        """
        if attention_mask is None:
            return cls(batch_size, seq_len)
        mask = attention_mask.bool()
        # torch.export wants one graph for every mask: no data-dependent branch or shape, so the padded layout.
        exporting = _exporting()
        if not exporting and bool(mask.all()):  # a host sync, and the choice between packed and padded layout
            return cls(batch_size, seq_len)
        # A fully padded row would leave softmax nothing to normalise (NaN); let it see its first (zero) key.
        key_mask = mask.clone()
        key_mask[:, 0] |= ~mask.any(dim=-1)
        key_mask = key_mask[:, None, None, :]
        if not unpad or exporting:
            return cls(batch_size, seq_len, key_mask=key_mask, mask=mask)
        lengths = mask.sum(dim=-1, dtype=torch.int32)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        indices = mask.flatten().nonzero().squeeze(-1)
        padding_indices = (~mask).flatten().nonzero().squeeze(-1)
        offsets = cu_seqlens.tolist()  # one host copy gives the spans and the longest length
        spans = [(start, end) for start, end in zip(offsets[:-1], offsets[1:]) if end > start]
        max_seqlen = max((end - start for start, end in spans), default=0)
        return cls(batch_size, seq_len, indices, key_mask, cu_seqlens, max_seqlen, spans, padding_indices, mask)

    @cached_property
    def blocks(self) -> list[tuple[int, int, int]] | None:
        """Each non-empty sequence as one run of rows, ``(packed start, flat padded start, length)``, when every
        sequence's real tokens are contiguous (right or left padding); ``[]`` when there is no real token, ``None``
        for masks with holes. On the host: computed (one device-to-host copy) only when asked for."""
        if self.spans is None:
            return None
        starts = [start for start, _ in self.spans]
        firsts_lasts = self.indices[starts + [end - 1 for _, end in self.spans]].tolist()
        firsts, lasts = firsts_lasts[:len(starts)], firsts_lasts[len(starts):]
        if any(last - first != end - start - 1 for first, last, (start, end) in zip(firsts, lasts, self.spans)):
            return None
        return [(start, first, end - start) for first, (start, end) in zip(firsts, self.spans)]

    @property
    def is_packed(self) -> bool:
        return self.indices is not None

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, ...)`` -> ``(N, ...)``; unchanged when nothing is padded."""
        if self.indices is None:
            return x
        return x.flatten(0, 1).index_select(0, self.indices)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, ...)`` -> ``(B, L, ...)`` with zeros at the padding; unchanged when nothing is padded."""
        if self.indices is None:
            return x
        # Write every row once: the real tokens, then zeros at the padding (cheaper than zero-filling it all first,
        # which matters for (B, L, vocab) logits).
        padded = x.new_empty(self.batch_size * self.seq_len, *x.shape[1:])
        padded = padded.index_copy_(0, self.indices, x).index_fill_(0, self.padding_indices, 0)
        return padded.view(self.batch_size, self.seq_len, *x.shape[1:])

    def edge_tokens(self, x: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Each sequence's first real token (its [CLS]), or its last one, ``(B, ...)``, from packed ``(N, ...)`` or
        padded ``(B, L, ...)`` states; right and left padding alike, zeros for a sequence without real tokens."""
        padded = self.unpack(x)
        if self.mask is None:
            return padded[:, -1 if last else 0]
        real = self.mask.int()  # argmax gives the first maximal position
        position = self.seq_len - 1 - real.flip(-1).argmax(-1) if last else real.argmax(-1)
        tokens = padded[torch.arange(self.batch_size, device=padded.device), position]
        has_tokens = self.mask.any(dim=-1).view(-1, *[1] * (tokens.dim() - 1))
        return torch.where(has_tokens, tokens, 0)

    def unpack_map(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   min_rows: int = 64) -> torch.Tensor:
        """``unpack(fn(x))`` for a token-wise ``fn`` whose output is wide (the MLM head's logits).

        On CPU, with contiguous sequences of ``min_rows`` tokens on average or more, ``fn`` runs one sequence at a
        time and each result goes straight into the padded output. That skips the packed ``(N, vocab)``
        intermediate and its copy (at the benchmark size 126 MiB of fresh memory and ~40 ms per forward). Shorter
        sequences would make ``fn`` too small a GEMM each (re-reading its whole weight), so they, other devices,
        masks with holes and batches without a real token take ``unpack(fn(x))``.
        """
        blocks = self.blocks if self.indices is not None and x.device.type == "cpu" else None
        if not blocks or x.shape[0] < min_rows * len(blocks):
            return self.unpack(fn(x))
        padded, end = None, 0
        for packed_start, padded_start, length in blocks:
            rows = fn(x[packed_start:packed_start + length])
            if rows.shape[0] != length:
                raise ValueError(f"unpack_map needs a token-wise fn (one output row per input row); it turned "
                                 f"{length} rows into {rows.shape[0]}")
            if padded is None:
                padded = rows.new_empty(self.batch_size * self.seq_len, *rows.shape[1:])
            padded[end:padded_start] = 0
            padded[padded_start:padded_start + length] = rows
            end = padded_start + length
        padded[end:] = 0
        return padded.view(self.batch_size, self.seq_len, *padded.shape[1:])
