"""Dropout on CPU, its mask drawn four elements to a 64-bit random number (`Tensor.bernoulli_` draws one each, about
4x slower): attention dropout without the ``(B, nh, L, L)`` weights, `BlockedDropoutAttention`; attention dropout on
short sequences, every head at once, `DropoutAttention`; and the hidden states' dropout, `dropout`.

PyTorch's fused CPU attention has no dropout: with dropout, SDPA falls back to its math kernel, which keeps the
weights, their dropout mask and the dropped weights for the backward pass. `BlockedDropoutAttention` attends one block
of queries of one head at a time and keeps only the dropout mask, as bits; `DropoutAttention` keeps the weights and a
byte of mask per weight, for sequences whose weights are small (`attention.blocked_dropout_attention_forward` chooses
between them, and is their entry point in transformers' attention interface).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from torch import Tensor, nn

DROPOUT_BLOCK_ROWS = 256  # queries per block of `BlockedDropoutAttention`, used beyond two blocks


class BlockedDropoutAttention(torch.autograd.Function):
    """``dropout(softmax(q k^T * scaling, masked)) v`` one block of queries of one head at a time, flash-attention
    style in plain torch ops: query ``(B, nh, Lq, d)``, key and value ``(B, nh, Lk, d)``, attention_mask ``(B, 1 or
    nh, 1 or Lq, Lk)`` (bool, True = may attend; or additive) or ``None``; returns ``(B, nh, Lq, d)``.

    Each weight is dropped with probability `dropout` (`draw_dropout_mask`) and each kept one scaled by
    ``1 / (1 - dropout)``, as `nn.functional.dropout` does. The forward pass keeps q, k, v, the output and the
    dropout mask packed in bits (``B * nh * L * L / 8`` bytes: 25 MB for 12 heads at 4096 tokens) instead of the
    weights; the backward pass recomputes each block's weights and reads its mask back, so it draws no random
    numbers and its gradients are those of the forward's mask. Half and bfloat16 inputs are computed in float32.

    The heads are shared out among torch's threads (`_for_each_head`), as the fused kernel does: each head's mask
    is drawn from its own generator, seeded from the default one, so the masks do not depend on the number of
    threads and `torch.manual_seed` repeats them.
    """

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float,
                dropout: float, block_rows: int) -> Tensor:
        ctx.input_dtype = query.dtype
        dtype = torch.promote_types(query.dtype, torch.float32)
        query, key, value = (t.to(dtype) for t in (query, key, value))
        (batch, heads, queries, _), keys = query.shape, key.shape[2]
        query = query * scaling
        output = query.new_empty(*query.shape[:-1], value.shape[-1])
        kept_bits = torch.empty(batch, heads, queries, _packed_length(keys), dtype=torch.uint8, device=query.device)
        seeds = torch.randint(1 << 62, (batch, heads)).tolist()  # from the default generator

        def attend_head(b: int, h: int, block: _Block) -> None:
            generator = torch.Generator(query.device).manual_seed(seeds[b][h])
            for rows in _row_blocks(queries, block_rows):
                weights = block.softmax(query[b, h, rows], key[b, h], attention_mask, b, h, rows)  # (rows, Lk)
                kept = block.draw_kept(len(weights), dropout, generator)  # (rows, Lk up to 8 n) uint8, 1 = kept
                kept_bits[b, h, rows] = block.pack(kept)
                weights.mul_(block.as_multiplier(kept))
                torch.addmm(output[b, h, rows], weights, value[b, h], beta=0, alpha=1 / (1 - dropout),
                            out=output[b, h, rows])

        _for_each_head(attend_head, batch, heads, partial(_Block, min(block_rows, queries), keys, dtype, query.device))
        ctx.save_for_backward(query, key, value, output, kept_bits, attention_mask)
        ctx.dropout, ctx.block_rows, ctx.scaling = dropout, block_rows, scaling
        return output.to(ctx.input_dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        query, key, value, output, kept_bits, attention_mask = ctx.saved_tensors
        (batch, heads, queries, _), keys = query.shape, key.shape[2]
        grad_output = grad_output.to(query.dtype)
        row_dot = (grad_output * output).sum(-1, keepdim=True)  # (B, nh, L, 1): rowsum(dO * O) = rowsum(P * dP)
        grad_output = grad_output / (1 - ctx.dropout)  # contiguous, like the gradients below
        grad_query, grad_key, grad_value = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)

        def differentiate_head(b: int, h: int, block: _Block) -> None:
            for rows in _row_blocks(queries, ctx.block_rows):
                weights = block.softmax(query[b, h, rows], key[b, h], attention_mask, b, h, rows)  # (rows, Lk)
                kept = block.kept_weights(weights, kept_bits[b, h, rows])  # 0 where dropped
                grad_value[b, h].addmm_(kept.T, grad_output[b, h, rows])
                grad_scores = block.product(grad_output[b, h, rows], value[b, h].T)  # dP
                grad_scores.mul_(kept).addcmul_(weights, row_dot[b, h, rows], value=-1)  # dS = P (dP - rowsum(P dP))
                torch.addmm(grad_query[b, h, rows], grad_scores, key[b, h], beta=0, alpha=ctx.scaling,
                            out=grad_query[b, h, rows])
                grad_key[b, h].addmm_(grad_scores.T, query[b, h, rows])

        _for_each_head(differentiate_head, batch, heads,
                       partial(_Block, min(ctx.block_rows, queries), keys, query.dtype, query.device, backward=True))
        grads = (g.to(ctx.input_dtype) for g in (grad_query, grad_key, grad_value))
        return *grads, None, None, None, None


class DropoutAttention(torch.autograd.Function):
    """``dropout(softmax(q k^T * scaling, masked)) v`` with the weights of every head in memory, in batched products:
    for sequences short enough that their weights are small (up to two blocks of `BlockedDropoutAttention`). The
    arguments and the result are those of `BlockedDropoutAttention`, and so is the dropout: each weight dropped with
    probability `dropout` (`draw_dropout_mask`'s draw, four weights to a random number), each kept one scaled by
    ``1 / (1 - dropout)``.

    SDPA's math kernel, what PyTorch runs for attention dropout on CPU, draws one random number per weight and keeps
    the weights, their mask and the dropped weights for the backward pass. This keeps the weights and the mask, one
    byte per weight, and draws the whole mask at once from the default generator (so its draw does not depend on the
    thread count). Half and bfloat16 inputs are computed in float32, and so is everything under autocast (which
    would otherwise run the products in its lower precision in the forward pass and not in the backward pass).
    """

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float,
                dropout: float) -> Tensor:
        with torch.autocast(query.device.type, enabled=False):
            return DropoutAttention._forward(ctx, query, key, value, attention_mask, scaling, dropout)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        with torch.autocast(grad_output.device.type, enabled=False):
            return DropoutAttention._backward(ctx, grad_output)

    @staticmethod
    def _forward(ctx, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float,
                 dropout: float) -> Tensor:
        ctx.input_dtype = query.dtype
        dtype = torch.promote_types(query.dtype, torch.float32)
        shape = query.shape[:-1] + value.shape[-1:]  # (B, nh, Lq, dv)
        query, key, value = (t.to(dtype).flatten(0, 1) for t in (query, key, value))  # (B nh, L, d)
        weights = torch.baddbmm(query.new_empty(()), query, key.transpose(1, 2), beta=0, alpha=scaling)
        if attention_mask is not None:
            scores = weights.view(*shape[:2], *weights.shape[1:])  # (B, nh, Lq, Lk)
            if attention_mask.dtype == torch.bool:
                scores.masked_fill_(~attention_mask, torch.finfo(dtype).min)
            else:
                scores.add_(attention_mask)
        torch.softmax(weights, dim=-1, out=weights)
        words = torch.empty(*weights.shape[:-1], 2 * _packed_length(weights.shape[-1]), dtype=torch.int64,
                            device=weights.device)
        kept = _random_int16(words)[..., :weights.shape[-1]] >= _drop_threshold(dropout)  # (B nh, Lq, Lk) bool
        dropped = weights * kept
        output = torch.baddbmm(dropped.new_empty(()), dropped, value, beta=0, alpha=1 / (1 - dropout))
        ctx.save_for_backward(query, key, value, output, weights, kept)
        ctx.dropout, ctx.scaling, ctx.heads = dropout, scaling, shape[:2]
        return output.view(shape).to(ctx.input_dtype)

    @staticmethod
    def _backward(ctx, grad_output: Tensor):
        query, key, value, output, weights, kept = ctx.saved_tensors
        grad_output = grad_output.to(query.dtype).flatten(0, 1)  # (B nh, Lq, dv)
        row_dot = (grad_output * output).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
        grad_output = grad_output / (1 - ctx.dropout)
        dropped = weights * kept
        grad_value = torch.bmm(dropped.transpose(1, 2), grad_output)
        grad_scores = torch.bmm(grad_output, value.transpose(1, 2))  # dP
        grad_scores.mul_(dropped).addcmul_(weights, row_dot, value=-1)  # dS = P (dP - rowsum(P dP))
        grad_query = torch.baddbmm(grad_scores.new_empty(()), grad_scores, key, beta=0, alpha=ctx.scaling)
        grad_key = torch.baddbmm(grad_scores.new_empty(()), grad_scores.transpose(1, 2), query, beta=0,
                                 alpha=ctx.scaling)
        grads = (g.unflatten(0, ctx.heads).to(ctx.input_dtype) for g in (grad_query, grad_key, grad_value))
        return *grads, None, None, None


def _for_each_head(work, batch: int, heads: int, new_block) -> None:
    """Calls ``work(b, h, block)`` for every head of every sequence, the heads shared out among
    `torch.get_num_threads()` Python threads, each with its own block from ``new_block()`` and running torch ops on
    one thread.

    A block's operations are too short to split well between threads (each is a parallel region of its own, and
    drawing random numbers runs on one thread anyway), so the threads take whole heads instead, as SDPA's fused
    kernel does. torch's thread count is global: 1 while the heads run, restored after.
    """
    torch_threads = torch.get_num_threads()
    threads = min(torch_threads, batch * heads)
    everything = [(b, h) for b in range(batch) for h in range(heads)]

    def work_through(share: list[tuple[int, int]], block: _Block) -> None:
        with torch.no_grad():  # grad mode is per thread, on in new ones, and ops with out= refuse it
            for b, h in share:
                work(b, h, block)

    blocks = [new_block() for _ in range(threads)]  # here: from the threads' own glibc arenas they raised peak memory
    if threads == 1:
        return work_through(everything, blocks[0])
    try:
        with ThreadPoolExecutor(threads) as pool:
            shares = [pool.submit(_single_threaded, work_through, everything[i::threads], blocks[i])
                      for i in range(threads)]
            for done in shares:
                done.result()  # raises what the thread raised
    finally:
        torch.set_num_threads(torch_threads)


def _single_threaded(function, *args):
    torch.set_num_threads(1)
    return function(*args)


class _Block:
    """The working memory of `BlockedDropoutAttention`: one block's weights and dropout mask, ``(rows, L)`` each,
    reused by every block. Two things make the passes over a block cheap on CPU:

    - no fresh memory per block: glibc hands blocks this large back to the system when they are freed, and the
      next allocation's first touch of each page costs as much as a pass over the block;
    - the mask as 0 / 1 in uint8 and float, applied by a multiplication: comparisons into bool, bool to float and
      `masked_fill` are not vectorized, and each costs about as much as one of the block's matrix products.
    """

    def __init__(self, rows: int, length: int, dtype: torch.dtype, device: torch.device, backward: bool = False):
        columns = 8 * _packed_length(length)  # the mask's columns: whole bytes of bits
        self.length = length
        self.scores = torch.empty(rows, length, dtype=dtype, device=device)
        self.multiplier = torch.empty(rows, columns, dtype=dtype, device=device)
        self.kept = torch.empty(rows, columns, dtype=torch.uint8, device=device)
        self.random_words = torch.empty(rows, columns // 4, dtype=torch.int64, device=device)
        self.spread_bits = torch.empty(rows, columns // 8, dtype=torch.int64, device=device)
        if backward:
            self.dropped_weights, self.grad_scores = torch.empty_like(self.scores), torch.empty_like(self.scores)

    def softmax(self, query: Tensor, key: Tensor, attention_mask: Tensor | None, b: int, h: int,
                rows: slice) -> Tensor:
        """``softmax(query key^T)`` of one block, ``(rows, L)``, masked as ``attention_mask[b, h, rows]`` says."""
        scores = torch.mm(query, key.T, out=self.scores[:len(query)])
        if attention_mask is not None:
            mask = attention_mask[b % attention_mask.shape[0], h % attention_mask.shape[1]]  # (1 or L, L)
            mask = mask[rows] if mask.shape[0] > 1 else mask
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
            else:
                scores.add_(mask)
        return torch.softmax(scores, dim=-1, out=scores)

    def draw_kept(self, rows: int, dropout: float, generator: torch.Generator | None = None) -> Tensor:
        """Which weights of a block to keep, drawn as `draw_dropout_mask` draws: ``(rows, L up to 8 n)`` uint8,
        1 = kept."""
        words = _random_int16(self.random_words[:rows], generator)
        return torch.ge(words, _drop_threshold(dropout), out=self.kept[:rows])

    def pack(self, kept: Tensor) -> Tensor:
        """`_pack_bits` of `kept`: ``(rows, n)`` int64, each holding a byte of bits."""
        return _pack_bits(kept, out=self.spread_bits[:len(kept)])

    def as_multiplier(self, kept: Tensor) -> Tensor:
        """``(rows, L)`` 0. / 1. from `kept`."""
        return self.multiplier[:len(kept)].copy_(kept)[:, :self.length]

    def unpack_kept(self, bits: Tensor) -> Tensor:
        """The inverse of `_pack_bits`, ``(rows, n)`` uint8 -> ``(rows, L)`` 0. / 1."""
        spread = self.spread_bits[:len(bits)]
        spread.copy_(bits).mul_(_SPREAD_BITS).bitwise_right_shift_(7).bitwise_and_(_LOW_BIT_OF_EVERY_BYTE)
        return self.as_multiplier(spread.view(torch.uint8))

    def kept_weights(self, weights: Tensor, bits: Tensor) -> Tensor:
        """`weights` ``(rows, L)`` with the dropped ones 0, as `bits` (`_pack_bits`) say."""
        return torch.mul(weights, self.unpack_kept(bits), out=self.dropped_weights[:len(weights)])

    def product(self, left: Tensor, right: Tensor) -> Tensor:
        """``left @ right``, ``(rows, L)``, in the block's gradient buffer."""
        return torch.mm(left, right, out=self.grad_scores[:len(left)])


class HiddenDropout(torch.autograd.Function):
    """`nn.functional.dropout` in training: each element zeroed with probability `p` (rounded to a multiple of 2**-16,
    as `draw_dropout_mask` draws it), the others scaled by ``1 / (1 - p)``; the mask kept as bool for the backward
    pass, which draws nothing."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        words = torch.empty(-(-x.numel() // 4), dtype=torch.int64, device=x.device)
        kept = (_random_int16(words).view(-1)[:x.numel()] >= _drop_threshold(p)).view(x.shape)
        ctx.save_for_backward(kept)
        ctx.scale = 1 / (1 - p)
        return x.mul(kept).mul_(ctx.scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (kept,) = ctx.saved_tensors
        return grad.mul(kept).mul_(ctx.scale), None


def dropout(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` for a dropout module: through `HiddenDropout` where it is a plain `nn.Dropout` in training, on
    CPU, with ``0 < p < 1`` and no hooks, out of `torch.compile` (whose own dropout kernel draws fast); else the
    module's own call."""
    if (type(module) is nn.Dropout and module.training and 0 < module.p < 1 and not module.inplace
            and x.device.type == "cpu" and not _hooked(module) and not torch.compiler.is_compiling()):
        return HiddenDropout.apply(x, module.p)
    return module(x)


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` would run more than its forward: hooks of its own or global ones, or a replaced
    `forward`."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
             nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
             nn.modules.module._global_backward_hooks, nn.modules.module._global_backward_pre_hooks)
    return any(hooks) or "forward" in vars(module)


def draw_dropout_mask(rows: int, columns: int, dropout: float, device: torch.device | None = None) -> Tensor:
    """Which attention weights to drop: ``(rows, columns)`` rounded up to a multiple of 8 columns, bool, each True
    with probability `dropout` rounded to a multiple of 2**-16 (0.1: 0.100006).

    Each 64-bit draw of the generator gives four 16-bit numbers: the cost of `Tensor.bernoulli_` (one draw per
    weight, and on CPU about 4x slower) matters when every one of the ``L x L`` weights needs one.
    """
    words = torch.empty(rows, _packed_length(columns) * 2, dtype=torch.int64, device=device)
    return _random_int16(words) < _drop_threshold(dropout)  # (rows, columns)


def _random_int16(words: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """`words` ``(rows, n)`` int64 filled with random bits, seen as ``(rows, 4 n)`` uniform int16."""
    return words.random_(torch.iinfo(torch.int64).min, None, generator=generator).view(torch.int16)  # all 64 bits


def _drop_threshold(dropout: float) -> int:
    """A uniform int16 below this is dropped: probability `dropout` to 2**-16."""
    return round(dropout * 65536) - 32768


# One multiplication, without carries, moves bit 0 of byte i of an int64 to bit 63 - i (packing: 8 flags to a
# byte, flag i in bit 7 - i) and, shifted right by 7, bit 7 - i of the lowest byte to bit 0 of byte i (unpacking).
_SPREAD_BITS = 0x8040201008040201 - (1 << 64)  # as a signed int64
_LOW_BIT_OF_EVERY_BYTE = 0x0101010101010101


def _packed_length(columns: int) -> int:
    return -(-columns // 8)


def _pack_bits(flags: Tensor, out: Tensor) -> Tensor:
    """``(rows, 8 n)`` 0 / 1 (bool or uint8) -> ``(rows, n)`` bytes, bit 7 - i of byte j = flag ``8 j + i``, each the
    lowest byte of an int64 of `out` (a copy to uint8 keeps just that byte)."""
    return torch.mul(flags.view(torch.int64), _SPREAD_BITS, out=out).bitwise_right_shift_(56)


def _row_blocks(length: int, block_rows: int) -> list[slice]:
    """The query rows of each block of one head."""
    return [slice(start, start + block_rows) for start in range(0, length, block_rows)]
