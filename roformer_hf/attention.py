"""Ways of attending: functions on tensors, a batch layout and a mask description (`masks.AttentionMask`), no modules.

Every function follows transformers' attention interface: ``fn(module, query, key, value, attention_mask,
scaling, dropout, **kwargs) -> (output, weights)`` with ``query`` of shape ``(B, nh, Lq, d)``, ``key`` and ``value``
of shape ``(B, nkv, Lk, d)`` and ``output`` of shape ``(B, Lq, nh, d)``; ``module`` tells train from eval, causal
from not (``module.is_causal``, which every kernel here honours, as transformers' own do, when it is given no mask)
and, as ``module.num_key_value_groups = nh / nkv``, how many query heads share each key/value head (grouped-query
attention; transformers' kernels read it too). Packed tokens use flash-attn's varlen convention: ``B = 1``,
``L = N`` real tokens, sequence boundaries in ``cu_seq_lens_q``/``cu_seq_lens_k``.

Which of them a forward calls is decided once, before its first layer (`kernels.choose_kernel`, then
`masks.create_attention_mask`, which records the choice in the mask). `attend` takes the same arguments, with that
`masks.AttentionMask` as the mask and the tokens in the layout's shape ``(*T, n, d)``:

- the ``"varlen"`` form (the layout says everything: real tokens side by side, or packed rows), with flash-attn: its
  varlen kernel reads the tokens directly; with SDPA on CUDA, for packed rows: `cuda_varlen_attention_forward`,
  PyTorch's own flash-attention varlen kernel; with SDPA on CPU: `sdpa_varlen_attention_forward`, each sequence in
  its own slice, adjacent ones of one length as one batch (no padding, no mask); with attention dropout in training,
  `blocked_dropout_attention_forward`: up to 512 tokens `blocked_dropout.DropoutAttention`, every head's weights at
  once, beyond `blocked_dropout.BlockedDropoutAttention`, which keeps only the dropout mask, as bits;
- otherwise the padded layout ``(B, nh, L, d)`` with the mask's tensor (`attend_padded`): padding, packed rows,
  causality after a cache, a bidirectional prefix.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .blocked_dropout import DROPOUT_BLOCK_ROWS, BlockedDropoutAttention, DropoutAttention
from .kernels import CUDA_VARLEN, SDPA_DROPOUT, SDPA_VARLEN
from .masks import AttentionMask, causal_mask


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (B, nh, L, d)
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # (B, 1, 1 or Lq, Lk) bool, True = may attend
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention that also returns its weights ``(B, nh, Lq, Lk)`` (see `softmax_attention`)."""
    key, value = key_value_heads_for_every_query_head(module, key, value)
    attention_mask = causal_unless_masked(module, query, key, attention_mask, kwargs.get("is_causal"))
    output, weights = softmax_attention(query, key, value, attention_mask, scaling, dropout, module.training)
    return output.transpose(1, 2).contiguous(), weights  # (B, L, nh, d)


def softmax_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float,
                      dropout: float, training: bool) -> tuple[Tensor, Tensor]:
    """``softmax(q k^T * scaling)``, dropped out, times ``v``: ``(B, nh, Lq, d)`` and the weights ``(B, nh, Lq, Lk)``;
    `attention_mask` ``(B, 1 or nh, 1 or Lq, Lk)`` (bool, True = may attend) or ``None``: every key.

    The softmax runs in float32 whatever the input dtype, and masked keys are filled with `masked_fill` rather than
    by adding `finfo.min`, which overflows in float16.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(torch.float32).min)
    weights = nn.functional.dropout(scores.softmax(dim=-1).to(value.dtype), p=dropout, training=training)
    return torch.matmul(weights, value), weights


def sdpa_varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (1, nh, N, d): packed tokens
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    scaling: float,
    dropout: float = 0.0,
    *,
    cu_seq_lens_q: torch.Tensor,  # (S + 1,) offsets of the sequences among the N query tokens
    cu_seq_lens_k: torch.Tensor | None = None,  # (S + 1,) among the key tokens; default: those of the queries
    seq_lengths: tuple[int, ...] | None = None,  # the S lengths on the host, when queries and keys share them
    causal_mask: torch.Tensor | None = None,  # (1, 1, L, L) of the longest sequence, for kernels that take a mask
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA on packed tokens, one sequence at a time: no work and no mask for padding. Sequence ``s``
    attends its queries ``cu_seq_lens_q[s]:cu_seq_lens_q[s + 1]`` to its keys ``cu_seq_lens_k[s]:...`` (as flash-attn's
    varlen kernel), causally when ``module.is_causal``, which needs as many keys as queries in every sequence.

    Meant for the CPU, where a loop over sequences costs little next to the attention itself. Adjacent sequences of
    the same lengths are one call on their tokens viewed as a batch, which on the CPU gives the same bits as a call
    each: a batch of 32 short sentences sorted by length, as sentence-transformers embeds them, holds a few such runs,
    and took 0.96x the time (4 layers of base width, an AVX2 EPYC). With attention dropout a run's call draws the
    mask of all its sequences at once, each weight dropped independently. `split` (not indexing) lets the backward
    pass join the gradients with one `cat`. The model passes `seq_lengths`, read once per forward (without them the offsets are read here), and with attention
    dropout, a causal module's mask of the longest sequence, which each sequence slices (else the dropout kernel
    renders its own, per sequence).
    """
    if seq_lengths is not None:
        query_lengths = key_lengths = list(seq_lengths)
    else:
        query_lengths = cu_seq_lens_q.diff().tolist()
        key_lengths = query_lengths if cu_seq_lens_k is None else cu_seq_lens_k.diff().tolist()
    if len(key_lengths) != len(query_lengths):
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k delimit {len(query_lengths)} and {len(key_lengths)} "
                         "sequences; expected the same number")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal
    if causal and key_lengths != query_lengths:
        raise ValueError("causal attention on packed sequences needs as many keys as queries in each sequence "
                         f"(cu_seq_lens_q {cu_seq_lens_q.tolist()}, cu_seq_lens_k {cu_seq_lens_k.tolist()})")
    dropping = dropout and module.training
    runs = _equal_length_runs(query_lengths, key_lengths)
    sdpa = ALL_ATTENTION_FUNCTIONS[SDPA_DROPOUT if dropping else "sdpa"]
    masks = causal_mask if dropping and causal else None
    queries = query.split([count * q for count, q, _ in runs], dim=2)  # (1, nh, count * n, d) each
    keys, values = (t.split([count * k for count, _, k in runs], dim=2) for t in (key, value))
    outputs = []
    for (count, length, key_length), q, k, v in zip(runs, queries, keys, values):
        if not length:  # sequences without queries hold no rows
            continue
        q, k, v = (t[0].unflatten(1, (count, n)).transpose(0, 1)  # (count, nh, n, d)
                   for t, n in ((q, length), (k, key_length), (v, key_length)))
        output = sdpa(module, q, k, v, None if masks is None else masks[..., :length, :length], dropout=dropout,
                      scaling=scaling, is_causal=causal)[0]  # (count, n, nh, d)
        outputs.append(output.flatten(0, 1).unsqueeze(0))
    return torch.cat(outputs, dim=1), None  # (1, N, nh, d)


def cuda_varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (1, nh, N, d): packed tokens
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    scaling: float,
    dropout: float = 0.0,
    *,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor | None = None,
    seq_lengths: tuple[int, ...] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA's varlen kernels on packed tokens, for CUDA: every sequence in one call, no padding computed, no mask
    rendered; the arguments are `sdpa_varlen_attention_forward`'s. In fp16 and bf16 (head size up to 256, a multiple
    of 8, Ampere or later) it calls PyTorch's flash-attention varlen kernel directly: the operator that SDPA on nested
    tensors calls, without their bookkeeping, which costs more host time per call than a whole layer's kernels take
    on the GPU (an H200 ran an eager training step of base size at a third of the padded path's speed through nested
    tensors). Other dtypes go through nested (jagged) tensors: PyTorch's memory-efficient varlen kernel.

    Those kernels take no sequence without queries, which a last layer that queries the labelled tokens only can
    hold: such sequences are left out, their keys with them."""
    if seq_lengths is not None:
        query_lengths = key_lengths = list(seq_lengths)
    else:
        query_lengths = cu_seq_lens_q.diff().tolist()
        key_lengths = query_lengths if cu_seq_lens_k is None else cu_seq_lens_k.diff().tolist()
    offsets_q, offsets_k = cu_seq_lens_q, cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    if not min(query_lengths):
        kept = [s for s, n in enumerate(query_lengths) if n]
        starts = [0, *itertools.accumulate(key_lengths)]
        index = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in kept]).to(key.device, non_blocking=True)
        key, value = key.index_select(2, index), value.index_select(2, index)
        query_lengths, key_lengths = [query_lengths[s] for s in kept], [key_lengths[s] for s in kept]
        offsets_q, offsets_k = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(
            key.device, non_blocking=True) for lengths in (query_lengths, key_lengths))
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal
    dropout = dropout if module.training else 0.0
    key, value = key_value_heads_for_every_query_head(module, key, value)
    query, key, value = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (N, nh, d)
    if _flash_varlen_runs(query):
        output = torch.ops.aten._flash_attention_forward(
            query, key, value, offsets_q.to(torch.int32), offsets_k.to(torch.int32), max(query_lengths),
            max(key_lengths), dropout, causal, False, scale=scaling)[0]
        return output.unsqueeze(0), None  # (1, N, nh, d)

    def jagged(tokens: Tensor, offsets: Tensor, lengths: list[int]) -> Tensor:  # (N, nh, d) -> (S, nh, j, d)
        return torch.nested.nested_tensor_from_jagged(tokens, offsets, min_seqlen=min(lengths),
                                                      max_seqlen=max(lengths)).transpose(1, 2)

    output = torch.nn.functional.scaled_dot_product_attention(
        jagged(query, offsets_q, query_lengths), jagged(key, offsets_k, key_lengths),
        jagged(value, offsets_k, key_lengths), dropout_p=dropout, is_causal=causal, scale=scaling)
    return output.transpose(1, 2).values().unsqueeze(0), None  # (1, N, nh, d)


def _flash_varlen_runs(query: Tensor) -> bool:
    """PyTorch's flash-attention kernel takes `query` ``(N, nh, d)``: CUDA, fp16 or bf16, ``d`` up to 256 and a
    multiple of 8, compute capability 8.0 or later."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
            and query.shape[-1] % 8 == 0 and torch.cuda.get_device_capability(query.device)[0] >= 8)


def _equal_length_runs(query_lengths: list[int], key_lengths: list[int]) -> list[tuple[int, int, int]]:
    """Adjacent sequences of the same query and key lengths, as ``(count, query length, key length)``: each run is
    one batched SDPA call (sentence-transformers sorts a batch by length, so a batch of 32 short sentences holds a few
    runs)."""
    runs: list[tuple[int, int, int]] = []
    for q, k in zip(query_lengths, key_lengths):
        if runs and runs[-1][1:] == (q, k):
            runs[-1] = (runs[-1][0] + 1, q, k)
        else:
            runs.append((1, q, k))
    return runs


def blocked_dropout_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                      attention_mask: Tensor | None, scaling: float, dropout: float = 0.0,
                                      **kwargs) -> tuple[Tensor, None]:
    """SDPA with attention dropout in training, in blocks of `DROPOUT_BLOCK_ROWS` queries, for the CPU: query etc.
    ``(B, nh, L, d)``, the key mask ``(B, 1, 1 or L, L)``, the output ``(B, L, nh, d)``.

    PyTorch's fused CPU kernel has no dropout, so SDPA with dropout falls back to its math kernel, which keeps the
    ``(B, nh, L, L)`` weights, their dropout mask and the dropped weights for the backward pass: at 4096 tokens,
    several times the memory and time of the fused kernel. `BlockedDropoutAttention` attends one block of queries
    of one head at a time and keeps only the dropout mask, as bits. Sequences of up to two blocks, whose weights are
    small, take `DropoutAttention`: every head's weights at once in batched products, the mask drawn four weights to a
    random number (at 256 tokens a training step's attention took half the math kernel's time; benchmarks/RESULTS.md).
    Under `torch.compile` they take SDPA's math kernel, whose dropout inductor draws itself.
    """
    dropout = dropout if module.training else 0.0
    attention_mask = causal_unless_masked(module, query, key, attention_mask, kwargs.get("is_causal"))
    compiling = torch.compiler.is_compiling()
    if not dropout or (compiling and query.shape[2] <= 2 * DROPOUT_BLOCK_ROWS):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, is_causal=False)  # any causality is in the mask
    key, value = key_value_heads_for_every_query_head(module, key, value)
    if query.shape[2] <= 2 * DROPOUT_BLOCK_ROWS:
        output = DropoutAttention.apply(query, key, value, attention_mask, scaling, dropout)
        return output.transpose(1, 2), None
    if compiling:  # plain ops the compiler can trace: each block recomputed in the backward pass
        blocks = [checkpoint(_attend_block, q, key, value, attention_mask, scaling, dropout, use_reentrant=False)
                  for q in query.split(DROPOUT_BLOCK_ROWS, dim=2)]
        return torch.cat(blocks, dim=2).transpose(1, 2), None
    output = BlockedDropoutAttention.apply(query, key, value, attention_mask, scaling, dropout, DROPOUT_BLOCK_ROWS)
    return output.transpose(1, 2), None  # (B, L, nh, d)


def _attend_block(query, key, value, attention_mask, scaling, dropout):
    return softmax_attention(query, key, value, attention_mask, scaling, dropout, training=True)[0]


def causal_unless_masked(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None,
                         is_causal: bool | None = None) -> Tensor | None:
    """The mask a kernel applies: the one given, else, for a causal module (``is_causal``, or ``module.is_causal``, as
    transformers' kernels read it), query ``i`` of ``Lq`` sees the keys up to ``Lk - Lq + i`` (the queries are the
    last ``Lq`` of the ``Lk`` keys, as after a cache): ``(1, 1, Lq, Lk)`` bool."""
    if attention_mask is not None:
        return attention_mask
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    if not causal or query.shape[2] == 1:
        return None
    return causal_mask(query.shape[2], key.shape[2], query.device)


def key_value_heads_for_every_query_head(module: nn.Module, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query attention for kernels that want as many key/value heads as query heads: each of the ``nkv``
    heads repeated for its ``module.num_key_value_groups`` query heads, ``(B, nkv, L, d) -> (B, nh, L, d)``."""
    groups = getattr(module, "num_key_value_groups", 1)
    return repeat_kv(key, groups), repeat_kv(value, groups)



AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_attention_forward)
AttentionInterface.register(CUDA_VARLEN, cuda_varlen_attention_forward)
AttentionInterface.register(SDPA_DROPOUT, blocked_dropout_attention_forward)


def attend_varlen(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: AttentionMask,
                  scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Attention on the layout's tokens ``(*T, nh, d)`` through the mask's varlen kernel (flash-attn's, or
    `SDPA_VARLEN`), sequence by sequence as ``attention_mask.layout`` delimits them; causal when ``module.is_causal``.
    With ``attention_mask.queries`` the queries are those tokens only, ``(M, nh, d)``, and so is the context."""
    layout, subset = attention_mask.layout, attention_mask.queries
    if subset is None:
        offsets_q = offsets_k = layout.cu_seqlens
        longest_q = longest_k = layout.max_seqlen
    else:  # the kernel reads the queries' and the keys' lengths from their offsets
        offsets_q, offsets_k = subset.cu_seqlens_q, subset.cu_seqlens_k
        longest_q, longest_k = subset.longest
    if not longest_q:  # not a single query: nothing to attend, no kernel to call
        return torch.zeros_like(query), None
    tokens = query.shape[:-2]
    query, key, value = (t.flatten(0, -3).transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # (1, nh, N, d)
    output, _ = ALL_ATTENTION_FUNCTIONS[attention_mask.kernel](
        module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=attention_mask.is_causal,
        cu_seq_lens_q=offsets_q, cu_seq_lens_k=offsets_k, max_length_q=longest_q, max_length_k=longest_k,
        seq_lengths=layout.seq_lengths if subset is None else None,
        **({} if attention_mask.dense is None else {"causal_mask": attention_mask.dense}),
    )
    return output.squeeze(0).unflatten(0, tokens), None


def attend_padded(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: AttentionMask,
                  scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, Tensor | None]:
    """Attention on the padded layout ``(B, nh, L, d)`` with the mask's tensor, through the mask's kernel. Takes the
    queries in the layout's token shape ``(*T, nh, d)`` and the keys and values in it too, or ``(B, Lk, nkv, d)`` (a
    cache, cross-attention); returns the context in the queries' shape, and the weights when the kernel gives them
    (eager)."""
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attention_mask.kernel, eager_attention_forward)
    layout = attention_mask.layout
    query = layout.scatter_tokens(query).transpose(1, 2)  # (B, nh, L, d)
    key, value = ((layout.scatter_tokens(t) if attention_mask.keys_are_queries else t).transpose(1, 2)
                  for t in (key, value))
    output, weights = attention(module, query, key, value, attention_mask.tensor, dropout=dropout, scaling=scaling,
                                is_causal=attention_mask.is_causal)
    return layout.gather_tokens(output), weights


def attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: AttentionMask,
           scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, Tensor | None]:
    """Attention through the function the forward chose (``attention_mask.kernel``), in the mask's form.

    Args:
        module: the attention module (train or eval decides dropout; ``is_causal`` causality).
        query: ``(*T, nh, d)`` with ``T = (N,)`` in varlen mode, else ``(B, L)``.
        key, value: the same shape with ``nkv`` heads, or ``(B, Lk, nkv, d)`` when they are not the queries' tokens
            (a cache, cross-attention: ``attention_mask.keys_are_queries`` is then False).
        attention_mask: which keys each query may see, rendered for its kernel (`masks.create_attention_mask`).

    Returns:
        The context ``(*T, nh, d)``, and the weights ``(B, nh, L, Lk)`` from the eager kernel (else ``None``).
    """
    if attention_mask.form == "varlen":
        return attend_varlen(module, query, key, value, attention_mask, scaling, dropout)
    return attend_padded(module, query, key, value, attention_mask, scaling, dropout)
