"""The cache (roformer_hf/cache.py): `GrowingCache` against transformers' `DynamicCache`, and the caches refused."""

import pytest
import torch
import transformers
from helpers import padded_batch, tiny_config
from transformers.cache_utils import DynamicCache

from roformer_hf import RoFormerForCausalLM


def test_a_cache_of_another_batch_or_model_is_refused():
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, _ = padded_batch([4, 4])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"past_key_values holds keys of shape \(2, 4, 4, 8\); expected \(3, 4, 4, "
                                             r"8\)"):
            model(torch.ones(3, 1, dtype=torch.long), past_key_values=cache)
        other = RoFormerForCausalLM(tiny_config(is_decoder=True, num_key_value_heads=2)).eval()
        with pytest.raises(ValueError, match=r"expected \(2, 2, 4, 8\)"):
            other(ids[:, :1], past_key_values=cache)
        with pytest.raises(ValueError, match="expected a transformers Cache"):
            model(ids[:, :1], past_key_values=((torch.zeros(1),),))


def test_a_static_cache_is_refused_by_name():
    """A fixed-length cache returns keys for every slot, filled or not; attention over them would be wrong, so
    `generate(cache_implementation="static")` and a `StaticCache` passed by hand stop with the reason."""
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, mask = padded_batch([4, 2])
    with torch.no_grad(), pytest.raises(ValueError, match=r"past_key_values \(StaticCache\) has a fixed length"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, cache_implementation="static")
    with torch.no_grad(), pytest.raises(ValueError, match=r"\(StaticCache\) has a fixed length"):
        model(ids, past_key_values=transformers.StaticCache(config=model.config, max_cache_len=16))


def test_attention_mask_must_cover_the_cache():
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, _ = padded_batch([4, 4])
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 1\); expected \(2, 5\)"):
            model(ids[:, :1], attention_mask=torch.ones(2, 1), past_key_values=cache)


def test_generation_appends_to_the_cache_without_copying_it():
    """`generate()` gets a `GrowingCache`: each step's keys land in a buffer with room to spare (no copy of the whole
    cache per token), and the tokens are those of transformers' `DynamicCache`."""
    from roformer_hf.cache import GrowingCache

    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    prompts, mask = padded_batch([6, 4], left=True)
    settings = {"attention_mask": mask, "max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False,
                "pad_token_id": 0, "return_dict_in_generate": True}
    growing = model.generate(prompts, **settings)
    assert type(growing.past_key_values) is GrowingCache
    layer = growing.past_key_values.layers[0]
    assert layer.keys.data_ptr() == layer.key_buffer.data_ptr() and layer.key_buffer.shape[2] > layer.keys.shape[2]
    dynamic = model.generate(prompts, past_key_values=DynamicCache(), **settings)
    assert type(dynamic.past_key_values) is DynamicCache
    assert torch.equal(growing.sequences, dynamic.sequences)
    torch.testing.assert_close(layer.keys, dynamic.past_key_values.layers[0].keys, atol=0, rtol=0)


def test_growing_cache_survives_what_replaces_its_tensors():
    """Beam search reorders, cropping shortens: the next append still gives the concatenation."""
    from roformer_hf.cache import GrowingCache

    cache, reference = GrowingCache(), DynamicCache()
    generator = torch.Generator().manual_seed(0)
    for step in range(70):  # past the first buffer's 64 tokens
        keys, values = (torch.randn(3, 2, 1 + step % 2, 4, generator=generator) for _ in range(2))
        got, expected = cache.update(keys, values, 0), reference.update(keys, values, 0)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        if step == 30:
            for c in (cache, reference):
                c.reorder_cache(torch.tensor([2, 0, 1]))
        if step == 50:
            for c in (cache, reference):
                c.crop(-5)
    assert cache.get_seq_length() == reference.get_seq_length()


def foreign_cache(**overrides):
    """The cache of another tiny decoder (`overrides` of its config) after a 4-token forward of 2 rows."""
    torch.manual_seed(1)
    other = RoFormerForCausalLM(tiny_config(is_decoder=True, **overrides)).eval()
    ids, _ = padded_batch([4, 4])
    with torch.no_grad():
        return other(ids, use_cache=True).past_key_values


@pytest.mark.parametrize("overrides, message", [
    ({"num_hidden_layers": 1}, r"holds 1 layer\(s\) of self-attention keys; expected 2 \(num_hidden_layers\)"),
    ({"num_hidden_layers": 3}, r"holds 3 layer\(s\) of self-attention keys; expected 2 \(num_hidden_layers\)"),
    ({"num_key_value_heads": 2}, r"keys of shape \(2, 2, 4, 8\); expected \(2, 4, 4, 8\)"),
    ({"hidden_size": 64, "num_attention_heads": 4}, r"keys of shape \(2, 4, 4, 16\); expected \(2, 4, 4, 8\)"),
    ({"dtype": torch.float64}, r"keys of dtype torch.float64; expected torch.float32"),
])
@pytest.mark.parametrize("call", ["forward", "generate"])
def test_a_cache_of_another_model_is_refused_naming_the_mismatch(overrides, message, call):
    """Fewer layers would fail deep inside attention, more would be ignored, other heads or dtypes would be
    concatenated to the model's own: each is refused by name, by the forward and by `generate()`."""
    overrides = dict(overrides)  # the parameters are shared by both calls
    dtype = overrides.pop("dtype", None)
    cache = foreign_cache(**overrides)
    if dtype is not None:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    model = RoFormerForCausalLM(tiny_config(is_decoder=True)).eval()
    ids, _ = padded_batch([5, 5])
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        if call == "forward":
            model(ids[:, 4:], past_key_values=cache)
        else:
            model.generate(ids, past_key_values=cache, max_new_tokens=2, pad_token_id=0)
