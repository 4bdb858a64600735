"""The key/value cache of a decoder: made here (`create_cache`, for a forward with `use_cache`; `generation_cache`,
for `generate()`), checked and read once per forward here (`check_cache`, which returns the `CacheState` the forward
needs), and updated by each attention module through `update_layer` (its layer's keys and values, cross-attention's
computed once per generation).

The cache the model makes is a `GrowingCache`: transformers' `DynamicCache` with room to spare in each layer's buffers,
whose cost per generated token does not grow with the prefix.

`DynamicCache` appends each step's keys and values with `torch.cat`, which copies the whole cache: at 1024 cached tokens
per row (8 rows, 4 layers of base width) the copies took over half of a decoding step on CPU. `GrowingCache` keeps each
layer's keys and values in a buffer that grows geometrically and returns views of its filled part, so appending copies
only the new tokens. It is a `DynamicCache` (everything that takes one takes it); what replaces a layer's tensors
(beam search's reordering, cropping, batch selection) simply leaves the buffer, and the next append starts a new one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache

MIN_CAPACITY = 64  # tokens per row of a layer's first buffer


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` whose `keys`/`values` ``(B, nkv, length, d)`` are views of buffers with room for more tokens."""

    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            # Which buffer a tensor is a view of (data pointers, strides) is no part of a graph: a compiled step
            # concatenates as `DynamicCache` does, and the next eager append starts a new buffer.
            return super().update(key_states, value_states, *args, **kwargs)
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


def create_cache(cross_attention: bool = False) -> Cache:
    """The cache a decoder makes when given none: a `GrowingCache`, in an `EncoderDecoderCache` beside an empty
    `DynamicCache` for cross-attention's keys when `cross_attention`."""
    return EncoderDecoderCache(GrowingCache(), DynamicCache()) if cross_attention else GrowingCache()


class CacheState(NamedTuple):
    """What a forward needs to know of its cache, read once (`check_cache`)."""

    past_length: int = 0  # tokens per row of the self-attention keys from earlier forwards
    cross_attention_filled: bool = False  # cross-attention's keys were projected by an earlier step of a generation


def generation_cache(model_kwargs: dict, given: bool, cache_implementation: str | None,
                     cross_attention: bool) -> None:
    """`generate()`'s cache (``model_kwargs["past_key_values"]``, as transformers prepared it): its default
    `DynamicCache` becomes `create_cache`'s, whose appends do not copy the whole cache at every step. A cache the
    caller gave, or another implementation asked for, is left as it is."""
    cache = model_kwargs.get("past_key_values")
    if given or cache_implementation not in (None, "dynamic"):
        return
    if type(cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache) is DynamicCache:
        model_kwargs["past_key_values"] = create_cache(cross_attention)


def past_length(past_key_values: Cache | None) -> int:
    """How many tokens per row the cache holds (0 without one)."""
    return 0 if past_key_values is None else past_key_values.get_seq_length()


def check_cache(config, past_key_values: Cache | None, use_cache: bool | None, batch_size: int | None = None,
                dtype: torch.dtype | None = None) -> CacheState:
    """Checks a cache and returns its `CacheState` (the empty state without one): read once per forward, for every
    check, mask and layer that needs it.

    A cache is taken only by a decoder, only of a kind the model can extend (one that grows), and only if it holds
    what this model would have put there: one layer per layer of the model, keys and values ``(B, nkv, length, d)``
    for a batch of `batch_size` rows, in `dtype` (the model's; ``None``: not checked, as under autocast).
    """
    if (past_key_values is not None or use_cache) and not config.is_decoder:
        raise ValueError("past_key_values / use_cache=True need a decoder (RoFormerConfig.is_decoder=True): an encoder "
                         "reads the whole sequence at once and keeps no cache")
    if past_key_values is None:
        return CacheState()
    if not isinstance(past_key_values, Cache):
        raise ValueError(f"past_key_values is a {type(past_key_values).__name__}; expected a transformers Cache "
                         "(DynamicCache, or EncoderDecoderCache with cross-attention), as the model returns it")
    if getattr(past_key_values, "is_compileable", False):
        raise ValueError(f"past_key_values ({type(past_key_values).__name__}) has a fixed length (what "
                         "generate(cache_implementation='static') builds); roformer_hf attends over the cache's filled "
                         "length only and takes caches that grow: DynamicCache, or none (generate's default)")
    state = CacheState(past_key_values.get_seq_length(), _cross_attention_filled(past_key_values))
    for cross_attention, filled in ((False, state.past_length > 0), (True, state.cross_attention_filled)):
        if filled and batch_size is not None:
            _check_layers(config, layer_cache(past_key_values, cross_attention),
                          "cross-attention" if cross_attention else "self-attention", batch_size, dtype)
    return state


def _cross_attention_filled(past_key_values: Cache) -> bool:
    cache = layer_cache(past_key_values, cross_attention=True)
    return cache is not None and cache.get_seq_length() > 0


def _check_layers(config, cache: Cache, part: str, batch_size: int, dtype: torch.dtype | None) -> None:
    """Every layer of a filled cache (or of its `part`) holds keys and values of this model's shape and dtype."""
    name = "past_key_values" if part == "self-attention" else "past_key_values.cross_attention_cache"
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(f"{name} holds {len(cache.layers)} layer(s) of {part} keys; expected "
                         f"{config.num_hidden_layers} (num_hidden_layers): a cache of another model")
    for index, layer in enumerate(cache.layers):
        for kind, tensor in (("keys", layer.keys), ("values", layer.values)):
            length = tensor.shape[2] if tensor is not None and tensor.dim() == 4 else None
            expected = (batch_size, config.num_key_value_heads, length, config.head_dim)
            if tensor is None or tuple(tensor.shape) != expected:
                shape = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"{name} holds {kind} of shape {shape}; expected {expected} (batch size, key/value "
                                 f"heads, cached length, head size) in layer {index} of its {part} part: a cache of "
                                 "another batch or model")
            if dtype is not None and tensor.dtype != dtype:
                raise ValueError(f"{name} holds {kind} of dtype {tensor.dtype}; expected {dtype}, the model's, in "
                                 f"layer {index} of its {part} part: a cache of another model")


def layer_cache(past_key_values: Cache | None, cross_attention: bool) -> Cache | None:
    """The part of a cache an attention module updates: an `EncoderDecoderCache` holds one for self-attention and one
    for cross-attention; any other cache is self-attention's."""
    if isinstance(past_key_values, EncoderDecoderCache):
        return past_key_values.cross_attention_cache if cross_attention else past_key_values.self_attention_cache
    return None if cross_attention else past_key_values


def cached_cross_attention(past_key_values: Cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention's keys and values ``(B, Lk, nkv, d)`` of layer `layer_idx`, projected from the encoder's states
    by an earlier step of this generation (``CacheState.cross_attention_filled``)."""
    layer = layer_cache(past_key_values, cross_attention=True).layers[layer_idx]
    return layer.keys.transpose(1, 2), layer.values.transpose(1, 2)


def update_layer(past_key_values: Cache | None, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
                 cross_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """This forward's keys and values ``(B, L, nkv, d)`` appended to layer `layer_idx` of the cache: returns all of the
    layer's, ``(B, past + L, nkv, d)`` (unchanged without a cache). Cross-attention's are stored once."""
    cache = layer_cache(past_key_values, cross_attention)
    if cache is None:
        return key, value
    key, value = cache.update(key.transpose(1, 2), value.transpose(1, 2), layer_idx)  # (B, nkv, past + L, d)
    if cross_attention:
        past_key_values.is_updated[layer_idx] = True
    return key.transpose(1, 2), value.transpose(1, 2)
