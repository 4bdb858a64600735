"""roformer_hf.similarity: embeddings equal the model's own pooling and sentence-transformers' on the same folder,
cosine scores are those of the embeddings, and RoFormer-Sim's generate-then-rank gives, in a batch, what each
sentence gives alone; its sampling draws from the filtered softmax."""

import doctest
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import WORDS, tiny_config
from sentence_transformers import SentenceTransformer

import roformer_hf.similarity
from roformer_hf import RoFormerForCausalLM, RoFormerHFTokenizer, RoFormerModel
from roformer_hf.similarity import SeededSampling, encode, generate_similar, similarity

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SENTENCES = ["the king dies", "a queen loves the crown and the sword at night", "day", "the sword speaks"]


@pytest.fixture(scope="module")
def tokenizer():
    return RoFormerHFTokenizer(vocab={token: i for i, token in enumerate(SPECIALS + WORDS)})


@pytest.fixture(scope="module")
def sim(tokenizer):
    """A RoFormer-Sim (prefix-LM decoder with a linear pooler); weights spread wide so that similarities differ."""
    torch.manual_seed(0)
    return RoFormerForCausalLM(tiny_config(vocab_size=len(tokenizer), is_decoder=True, prefix_lm=True,
                                           add_pooling_layer=True, pooler_activation="linear",
                                           initializer_range=0.3)).eval()


def test_encode_is_the_pooler_output_and_what_sentence_transformers_gives(sim, tokenizer, tmp_path):
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = sim(**batch).pooler_output
    actual = encode(sim, tokenizer, SENTENCES, batch_size=3)  # sorted by length: other batches than `batch`
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    sim.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    sentence_model = SentenceTransformer(str(tmp_path), device="cpu")
    torch.testing.assert_close(sentence_model.encode(SENTENCES, convert_to_tensor=True), actual, atol=1e-5, rtol=0)
    torch.testing.assert_close(encode(sim, tokenizer, SENTENCES, normalize=True), F.normalize(expected, dim=-1),
                               atol=1e-5, rtol=0)


def test_encode_with_a_token_pooling(tokenizer):
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config(vocab_size=len(tokenizer))).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    torch.testing.assert_close(encode(model, tokenizer, SENTENCES), (hidden * mask).sum(1) / mask.sum(1),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(encode(model, tokenizer, SENTENCES, pooling="cls"), hidden[:, 0], atol=1e-5, rtol=0)


def test_similarity_is_the_cosine_of_the_pooler_outputs(sim, tokenizer):
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        pooled = sim(**batch).pooler_output
    scores = similarity(sim, tokenizer, SENTENCES[:2], SENTENCES[2:])
    expected = torch.stack([F.cosine_similarity(pooled[0], pooled[2], dim=0),
                            F.cosine_similarity(pooled[1], pooled[3], dim=0)])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert similarity(sim, tokenizer, ["the king dies"], ["the king dies"]).item() == pytest.approx(1.0, abs=1e-6)


def test_bad_input_is_refused(sim, tokenizer):
    with pytest.raises(ValueError, match=r"sentences=\[\]: expected at least one sentence"):
        encode(sim, tokenizer, [])
    with pytest.raises(ValueError, match=r"sentences='the king': expected a list of strings"):
        encode(sim, tokenizer, "the king")
    with pytest.raises(ValueError, match="sentences1 has 2 sentences and sentences2 1"):
        similarity(sim, tokenizer, SENTENCES[:2], SENTENCES[:1])
    with pytest.raises(ValueError, match=r"sentences=\[\]: expected at least one sentence"):
        generate_similar(sim, tokenizer, [])
    with pytest.raises(ValueError, match="pooling='pooler', but this model has no pooler"):
        encode(RoFormerModel(tiny_config(vocab_size=len(tokenizer))), tokenizer, SENTENCES, pooling="pooler")
    with pytest.raises(ValueError, match="model=RoFormerModel: expected a decoder that generates"):
        generate_similar(RoFormerModel(tiny_config(vocab_size=len(tokenizer))), tokenizer, SENTENCES)
    with pytest.raises(ValueError, match="top_p=0: expected a probability"):
        generate_similar(sim, tokenizer, SENTENCES, top_p=0)


def test_generate_similar_batched_equals_one_sentence_at_a_time(sim, tokenizer):
    """Each sentence's candidates, their ranking and scores are the same in a batch (left-padded prompts) as alone;
    the scores are `similarity` to the source, in falling order; the seed decides the samples."""
    settings = {"n": 6, "seed": 7, "max_new_tokens": 8}
    batched = generate_similar(sim, tokenizer, SENTENCES, **settings)
    alone = [generate_similar(sim, tokenizer, [sentence], **settings)[0] for sentence in SENTENCES]
    assert [[c.text for c in ranked] for ranked in batched] == [[c.text for c in ranked] for ranked in alone]
    for ranked, single in zip(batched, alone):
        assert [c.score for c in ranked] == pytest.approx([c.score for c in single], abs=1e-5)
    assert sum(len(ranked) for ranked in batched) >= 2 * len(SENTENCES)  # sampling gives several distinct candidates
    for sentence, ranked in zip(SENTENCES, batched):
        assert all(a.score >= b.score for a, b in zip(ranked, ranked[1:]))
        assert sentence not in [c.text for c in ranked] and len({c.text for c in ranked}) == len(ranked)
        if ranked:
            expected = similarity(sim, tokenizer, [sentence] * len(ranked), [c.text for c in ranked])
            assert [c.score for c in ranked] == pytest.approx(expected.tolist(), abs=1e-5)
    assert generate_similar(sim, tokenizer, SENTENCES, **settings) == batched
    assert generate_similar(sim, tokenizer, SENTENCES, **{**settings, "seed": 8}) != batched


def test_seeded_sampling_draws_from_the_softmax():
    """Greedy decoding after `SeededSampling` (the Gumbel-max trick) picks token v with probability softmax(v)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    generators = [torch.Generator().manual_seed(0)]
    draws = 20000
    picks = torch.stack([SeededSampling(generators, 1)(None, logits.clone()).argmax(-1) for _ in range(draws)])
    frequencies = torch.bincount(picks.flatten(), minlength=5).double() / draws
    expected = logits.softmax(-1)[0].double()
    assert frequencies[4] == 0
    assert torch.allclose(frequencies, expected, atol=4 * (expected * (1 - expected) / draws).sqrt().max().item())


def test_docstring_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", roformer_hf.similarity.__doc__, flags=re.DOTALL)
    assert blocks, "roformer_hf.similarity has no runnable example"
    test = doctest.DocTestParser().get_doctest("".join(blocks), {}, "roformer_hf.similarity", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
