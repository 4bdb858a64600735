"""Sentence embeddings, cosine similarity and RoFormer-Sim's similar-sentence generation, on a model and its tokenizer.

- `encode`: one embedding per sentence, the one the model was made for (`sentence.sentence_pooling`: RoFormer-Sim's
  `pooler_output`, mean pooling for other models, or the pooling asked for): the embedding that
  `SentenceTransformer(folder)` gives for a folder the model was saved to.
- `similarity`: the cosine similarity of sentence pairs.
- `generate_similar`: RoFormer-Sim's own workflow in one call: for each sentence, sample `n` sentences with the
  sentence as the prompt (its prefix, read bidirectionally), then rank them by the same model's similarity to it.
  Sampling is seeded per sentence, so a batch gives what each sentence gives alone.

Token poolings other than the pooler are sentence-transformers' `Pooling` module
(`pip install roformer_hf[embeddings]`).

Example, a RoFormer-Sim with random weights (a trained one gives paraphrases); its embedding is its pooler output:

```python
>>> import torch
>>> from roformer_hf import RoFormerConfig, RoFormerForCausalLM, RoFormerHFTokenizer
>>> from roformer_hf.similarity import encode, generate_similar, similarity
>>> words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "be", "or", "not"]
>>> tokenizer = RoFormerHFTokenizer(vocab={word: i for i, word in enumerate(words)})
>>> model = RoFormerForCausalLM(RoFormerConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1,
...     num_attention_heads=2, intermediate_size=64, is_decoder=True, prefix_lm=True, add_pooling_layer=True)).eval()
>>> embeddings = encode(model, tokenizer, ["to be or not to be", "not to be"])
>>> batch = tokenizer(["to be or not to be", "not to be"], padding=True, return_tensors="pt")
>>> torch.allclose(embeddings, model(**batch).pooler_output, atol=1e-5)
True
>>> scores = similarity(model, tokenizer, ["to be", "or not"], ["to be", "to be or not"])
>>> scores.shape, round(scores[0].item(), 4)
(torch.Size([2]), 1.0)
>>> ranked = generate_similar(model, tokenizer, ["to be or not to be", "not to be"], n=4, seed=1, max_new_tokens=6)
>>> len(ranked), all(a.score >= b.score for a, b in zip(ranked[0], ranked[0][1:]))
(2, True)
```
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from .sentence import POOLER, sentence_pooling


def _check_sentences(name: str, sentences) -> list[str]:
    if isinstance(sentences, str) or not isinstance(sentences, Sequence) or \
            not all(isinstance(sentence, str) for sentence in sentences):
        raise ValueError(f"{name}={sentences!r:.80}: expected a list of strings")
    if not sentences:
        raise ValueError(f"{name}=[]: expected at least one sentence")
    return list(sentences)


def _token_pooling(pooling: str, hidden_size: int):
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling
    except ImportError as error:
        raise ImportError(f"pooling={pooling!r} pools the last hidden state with sentence-transformers' Pooling "
                          "module: pip install roformer_hf[embeddings]") from error
    return Pooling(hidden_size, pooling)


def embedder(model, pooling: str | None = None,
             encoder: Callable[..., Any] | None = None) -> Callable[[Mapping[str, torch.Tensor]], torch.Tensor]:
    """The function from a tokenized batch (`input_ids`, `attention_mask`, ...) to its sentence embeddings `(B, H)`,
    not normalized: what `encode` applies to each batch, with `pooling` as `encode` reads it. `encoder`: what runs
    `model.base_model` on the batch (default: the module itself; a compiled copy of it, say)."""
    config = model.base_model.config
    encoder = model.base_model if encoder is None else encoder
    pooling = sentence_pooling(config, pooling)
    pool = None if pooling == POOLER else _token_pooling(pooling, config.hidden_size)

    @torch.no_grad()
    def embed(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        out = encoder(**batch, use_cache=False)
        if pool is None:
            return out.pooler_output
        return pool({"token_embeddings": out.last_hidden_state,
                     "attention_mask": batch["attention_mask"]})["sentence_embedding"]

    return embed


@torch.no_grad()
def encode(model, tokenizer, sentences: Sequence[str], *, pooling: str | None = None, normalize: bool = False,
           batch_size: int = 32, max_length: int | None = None) -> torch.Tensor:
    """The sentence embeddings of `sentences`, `(N, H)`, in their order.

    Sentences are encoded `batch_size` at a time, sorted by length (as sentence-transformers does, so that a batch
    holds little padding), and truncated at `max_length` tokens (default: the tokenizer's `model_max_length`).

    Args:
        model: a RoFormer model, any head (its encoder, `model.base_model`, runs).
        tokenizer: its tokenizer.
        sentences: the sentences, at least one.
        pooling: `"pooler"` or a sentence-transformers pooling mode (`"mean"`, `"cls"`, ...); default
            `sentence_pooling(model.config)`: the pooler for RoFormer-Sim, else `config.sentence_pooling` or mean.
        normalize: scale each embedding to unit length.

    Example: the module's.
    """
    sentences = _check_sentences("sentences", sentences)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive integer")
    embed = embedder(model, pooling)
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(sentences)), key=lambda i: -lengths[i])
    embeddings = [None] * len(sentences)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = tokenizer([sentences[i] for i in rows], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt", padding_side="right").to(device)
        for row, vector in zip(rows, embed(batch)):
            embeddings[row] = vector
    embeddings = torch.stack(embeddings)
    return F.normalize(embeddings, dim=-1) if normalize else embeddings


def similarity(model, tokenizer, sentences1: Sequence[str], sentences2: Sequence[str], *, pooling: str | None = None,
               batch_size: int = 32) -> torch.Tensor:
    """The cosine similarity of each pair `(sentences1[i], sentences2[i])`, `(N,)`, of the embeddings `encode` gives.

    Example: the module's.
    """
    sentences1, sentences2 = _check_sentences("sentences1", sentences1), _check_sentences("sentences2", sentences2)
    if len(sentences1) != len(sentences2):
        raise ValueError(f"sentences1 has {len(sentences1)} sentences and sentences2 {len(sentences2)}: expected "
                         "pairs, as many in each")
    embeddings = encode(model, tokenizer, sentences1 + sentences2, pooling=pooling, batch_size=batch_size)
    return F.cosine_similarity(embeddings[:len(sentences1)], embeddings[len(sentences1):], dim=-1)


class SeededSampling(LogitsProcessor):
    """Sampling as a logits processor, one random stream per group of `rows_per_stream` rows: adding Gumbel noise
    to the (temperature-scaled, top-p-filtered) logits and taking the argmax draws a token from their softmax
    (the Gumbel-max trick), so greedy decoding with this processor samples. Each group's noise comes from its own
    generator, so a group's tokens do not depend on the other rows of the batch."""

    def __init__(self, generators: list[torch.Generator], rows_per_stream: int):
        self.generators = generators
        self.rows_per_stream = rows_per_stream

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # (B * n, V)
        shape = (self.rows_per_stream, scores.shape[-1])
        uniform = torch.cat([torch.rand(shape, generator=generator, dtype=torch.float64)
                             for generator in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))  # (B * n, V)
        return scores + gumbel.to(scores.device, scores.dtype)


@dataclass(frozen=True)
class SimilarSentence:
    """A generated sentence and its cosine similarity to the sentence it was generated from."""

    text: str
    score: float


def _stream_seed(seed: int, sentence: str) -> int:
    """The seed of a sentence's random stream: the same wherever the sentence sits in a batch."""
    return zlib.crc32(sentence.encode("utf-8"), seed & 0xFFFFFFFF)


@torch.no_grad()
def generate_similar(model, tokenizer, sentences: Sequence[str], n: int = 8, *, seed: int = 0, top_p: float = 0.95,
                     temperature: float = 1.0, max_new_tokens: int = 32, pooling: str | None = None,
                     batch_size: int = 32) -> list[list[SimilarSentence]]:
    """For each sentence, `n` sampled similar sentences ranked by their similarity to it, most similar first:
    RoFormer-Sim's generate-then-rank workflow.

    Each sentence is the prompt (segment 0, read bidirectionally by a prefix-LM); `n` continuations are sampled
    with `temperature` and nucleus filtering (`top_p`) until the tokenizer's [SEP] or `max_new_tokens`, decoded,
    and scored by `similarity` to the sentence (the model's own embedding, `encode`). Empty continuations, repeats and
    the sentence itself are dropped, so a list may hold fewer than `n`.

    Sampling is seeded: `seed` and the sentence's text seed its own random stream, so the result for a sentence is
    the same alone or in any batch (up to ties in float rounding). `batch_size` sentences generate at a time.

    Args:
        model: a decoder with a language-model head, RoFormer-Sim (`RoFormerForCausalLM` with `config.prefix_lm` and
            `config.add_pooling_layer`) or any other whose `pooling` it can rank by.
        tokenizer: its tokenizer (its [SEP] ends a sentence, its [PAD] pads).

    Example: the module's.
    """
    sentences = _check_sentences("sentences", sentences)
    if not getattr(model.config, "is_decoder", False) or not hasattr(model, "generate"):
        raise ValueError(f"model={type(model).__name__}: expected a decoder that generates (RoFormerForCausalLM, "
                         "config.is_decoder=True), such as RoFormer-Sim")
    for name, value in (("n", n), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: expected a probability in (0, 1]")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: expected a positive number")
    if tokenizer.sep_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("tokenizer: expected a [SEP] token (it ends a sentence) and a [PAD] token")
    sentence_pooling(model.config, pooling)  # a pooling the model lacks fails before generating

    candidates = []
    for start in range(0, len(sentences), batch_size):
        candidates += _sample(model, tokenizer, sentences[start:start + batch_size], n, seed, top_p, temperature,
                              max_new_tokens)
    kept = [list(dict.fromkeys(text for text in texts if text and text != sentence))
            for sentence, texts in zip(sentences, candidates)]
    pairs = [(sentence, text) for sentence, texts in zip(sentences, kept) for text in texts]
    scores = iter(similarity(model, tokenizer, [s for s, _ in pairs], [t for _, t in pairs], pooling=pooling,
                             batch_size=batch_size).tolist() if pairs else [])
    ranked = []
    for texts in kept:
        scored = [SimilarSentence(text, next(scores)) for text in texts]
        ranked.append(sorted(scored, key=lambda candidate: -candidate.score))
    return ranked


def _sample(model, tokenizer, sentences: list[str], n: int, seed: int, top_p: float, temperature: float,
            max_new_tokens: int) -> list[list[str]]:
    """`n` continuations of each sentence (left-padded prompts, each repeated `n` times), decoded."""
    device = next(model.parameters()).device
    prompts = tokenizer(sentences, padding=True, return_tensors="pt", padding_side="left").to(device)
    prompts = {name: tensor.repeat_interleave(n, dim=0) for name, tensor in prompts.items()}
    generators = [torch.Generator().manual_seed(_stream_seed(seed, sentence)) for sentence in sentences]
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p),
                                      SeededSampling(generators, n)])
    output = model.generate(**prompts, logits_processor=processors, do_sample=False, num_beams=1,
                            max_new_tokens=max_new_tokens, eos_token_id=tokenizer.sep_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(output[:, prompts["input_ids"].shape[1]:], skip_special_tokens=True)
    return [texts[i * n:(i + 1) * n] for i in range(len(sentences))]


__all__ = ["SeededSampling", "SimilarSentence", "embedder", "encode", "generate_similar", "similarity"]
