"""Property-based tests over random small configs and inputs: shapes, finiteness, padding invariance, rotary."""

import torch
from helpers import apply_rotary, rotary_cos_sin
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


@st.composite
def decoder_configs(draw):
    heads = draw(st.sampled_from([2, 4]))
    rope = draw(st.sampled_from([{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
                                 {"rope_type": "yarn", "factor": 4.0}]))
    family = draw(st.sampled_from([{}, {"use_bias": False, "norm_type": "rms_norm", "hidden_act": "relu"}]))
    return RoFormerConfig(
        vocab_size=40, hidden_size=heads * 4, num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([heads, heads // 2, 1])), num_hidden_layers=2,
        intermediate_size=16, rotary_value=draw(st.booleans()),
        rotary_layout=draw(st.sampled_from(["interleaved", "half"])),
        norm_position=draw(st.sampled_from(["post", "pre"])), rope_parameters={**rope, "rope_theta": 1e4},
        max_position_embeddings=8, unpad_inputs=draw(st.booleans()), is_decoder=True,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=draw(st.sampled_from(["sdpa", "eager"])), **family,
    )


@SETTINGS
@given(config=decoder_configs(), lengths=st.lists(st.integers(2, 9), min_size=1, max_size=3), left=st.booleans(),
       packed=st.booleans(), seed=st.integers(0, 2**16))
def test_decoder_states_depend_only_on_the_tokens_up_to_them(config, lengths, left, packed, seed):
    """Causality by its definition, across random configurations, padding sides and packed rows: the state of
    token t of a sequence is the last state of that sequence cut after t, run alone; and feeding the batch through
    the cache in two pieces gives the states of one forward."""
    torch.manual_seed(seed)
    model = RoFormerModel(config).eval()
    sequences = [torch.randint(1, config.vocab_size, (n,)) for n in lengths]
    with torch.no_grad():
        if packed:  # one row, the sequences back to back (DataCollatorWithFlattening)
            offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            positions = torch.cat([torch.arange(n) for n in lengths])[None]  # as the collator gives them
            states = model(torch.cat(sequences)[None], position_ids=positions, cu_seq_lens_q=offsets,
                           cu_seq_lens_k=offsets, use_cache=False).last_hidden_state[0].split(lengths)
        else:
            seq_len = max(lengths)
            ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, tokens in enumerate(sequences):
                where = slice(seq_len - len(tokens), None) if left else slice(0, len(tokens))
                ids[row, where], mask[row, where] = tokens, 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(ids, attention_mask=mask, position_ids=positions).last_hidden_state
            states = [out[row][mask[row].bool()] for row in range(len(lengths))]
            cut = (seq_len + 1) // 2
            first = model(ids[:, :cut], attention_mask=mask[:, :cut], position_ids=positions[:, :cut], use_cache=True)
            rest = model(ids[:, cut:], attention_mask=mask, position_ids=positions[:, cut:],
                         past_key_values=first.past_key_values, use_cache=True)
            pieces = torch.cat([first.last_hidden_state, rest.last_hidden_state], dim=1)
            torch.testing.assert_close(pieces[mask.bool()], out[mask.bool()], atol=1e-4, rtol=1e-4)
        for tokens, state in zip(sequences, states):
            for t in range(len(tokens)):
                alone = model(tokens[None, :t + 1], use_cache=False).last_hidden_state[0, -1]
                torch.testing.assert_close(state[t], alone, atol=1e-4, rtol=1e-4)
