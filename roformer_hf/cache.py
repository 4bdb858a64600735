"""A key/value cache whose cost per generated token does not grow with the prefix: transformers' `DynamicCache`, with
room to spare in each layer's buffers.

`DynamicCache` appends each step's keys and values with `torch.cat`, which copies the whole cache: at 1024 cached tokens
per row (8 rows, 4 layers of base width) the copies took over half of a decoding step on CPU. `GrowingCache` keeps each
layer's keys and values in a buffer that grows geometrically and returns views of its filled part, so appending copies
only the new tokens. It is a `DynamicCache` (everything that takes one takes it); what replaces a layer's tensors
(beam search's reordering, cropping, batch selection) simply leaves the buffer, and the next append starts a new one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

MIN_CAPACITY = 64  # tokens per row of a layer's first buffer


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` whose `keys`/`values` ``(B, nkv, length, d)`` are views of buffers with room for more tokens."""

    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.key_buffer = appended(self.keys, key_states, self.key_buffer)
        self.values, self.value_buffer = appended(self.values, value_states, self.value_buffer)
        return self.keys, self.values


def appended(cached: torch.Tensor, new: torch.Tensor, buffer: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cat([cached, new], dim=-2)`` as a view of `buffer` (`cached` its filled part), or of a new buffer with twice
    the room when it is full or `cached` is not a view of it; returns the view and the buffer."""
    length = cached.shape[-2] if cached.numel() else 0
    total = length + new.shape[-2]
    in_buffer = (buffer is not None and length and cached.data_ptr() == buffer.data_ptr()
                 and cached.shape[:-2] == new.shape[:-2] and cached.stride() == buffer.stride())
    if not in_buffer or buffer.shape[-2] < total:
        fresh = new.new_empty(*new.shape[:-2], max(2 * total, MIN_CAPACITY), new.shape[-1])
        if length:
            fresh[..., :length, :].copy_(cached)
        buffer = fresh
    buffer[..., length:total, :].copy_(new)
    return buffer[..., :total, :], buffer


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s, one per layer as they are first updated (see the module's docstring).

    Example:

    ```python
    >>> import torch
    >>> from roformer_hf.cache import GrowingCache
    >>> cache = GrowingCache()
    >>> for step in range(3):
    ...     keys, values = cache.update(torch.ones(1, 2, 1, 4) * step, torch.zeros(1, 2, 1, 4), layer_idx=0)
    >>> keys[0, 0, :, 0].tolist(), cache.get_seq_length()
    ([0.0, 1.0, 2.0], 3)
    ```
    """

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
