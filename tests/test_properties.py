"""Property-based tests over random small configs and inputs: shapes, finiteness, padding invariance, rotary."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import apply_rotary, rotary_cos_sin

from roformer_hf import RoFormerConfig, RoFormerModel

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return RoFormerConfig(
        vocab_size=draw(st.integers(8, 60)), hidden_size=heads * head_dim, num_attention_heads=heads,
        num_hidden_layers=draw(st.integers(1, 2)), intermediate_size=draw(st.integers(4, 24)),
        embedding_size=draw(st.sampled_from([None, 6])), rotary_value=draw(st.booleans()),
        rotary_layout=draw(st.sampled_from(["interleaved", "half"])),
        norm_position=draw(st.sampled_from(["post", "pre"])), rope_theta=draw(st.sampled_from([100.0, 1e4, 1e6])),
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=draw(st.sampled_from(["sdpa", "eager"])),
    )


@SETTINGS
@given(config=configs(), lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_shapes_finiteness_and_padding_invariance(config, lengths, seed):
    torch.manual_seed(seed)
    model = RoFormerModel(config).eval()
    seq_len = max(max(lengths), 1)
    ids = torch.randint(1, config.vocab_size, (len(lengths), seq_len))
    mask = (torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        out = model(ids, attention_mask=mask).last_hidden_state
        assert out.shape == (len(lengths), seq_len, config.hidden_size)
        assert torch.isfinite(out).all()
        for row, n in enumerate(lengths):
            if n:
                alone = model(ids[row:row + 1, :n]).last_hidden_state[0]
                torch.testing.assert_close(out[row, :n], alone, atol=1e-4, rtol=1e-4)


@SETTINGS
@given(head_dim=st.sampled_from([2, 4, 8, 32]), layout=st.sampled_from(["interleaved", "half"]),
       m=st.integers(0, 5000), n=st.integers(0, 5000), shift=st.integers(0, 5000),
       base=st.sampled_from([10.0, 1e4, 1e6]), seed=st.integers(0, 2**16))
def test_rotary_relative_and_norm_preserving(head_dim, layout, m, n, shift, base, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, head_dim, generator=gen, dtype=torch.float64)
    cos, sin = rotary_cos_sin(torch.tensor([m, n, m + shift, n + shift]), head_dim, base, layout)
    rotated = [apply_rotary(x, cos[i], sin[i], layout) for i, x in enumerate((q, k, q, k))]
    torch.testing.assert_close(rotated[0].norm(), q.norm(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotated[0] @ rotated[1], rotated[2] @ rotated[3], atol=1e-4, rtol=1e-4)
