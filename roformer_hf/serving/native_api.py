"""This server's own routes, for what neither OpenAI nor text-embeddings-inference has: `POST /fill-mask` (the
fill-mask pipeline's answer) on a masked LM and `POST /similar` (`roformer_hf.similarity.generate_similar`) on
RoFormer-Sim; and `GET /health` (also at text-embeddings-inference's `GET /` and `GET /ping`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .errors import RequestError
from .protocol import Body, Parsed, route, token_rows
from .tasks import Item

if TYPE_CHECKING:
    from .served import ServedModel

Number = StrictInt | StrictFloat


class FillMaskRequest(Body):
    inputs: StrictStr | list[StrictStr]
    top_k: StrictInt = Field(5, ge=1)
    truncate: StrictBool | None = None  # None: the server's --auto-truncate


@route("POST", "/fill-mask", FillMaskRequest, "roformer_hf", lambda loaded: loaded.is_masked_lm)
def fill_mask(served: ServedModel, body: FillMaskRequest, _) -> Parsed:
    vocabulary = served.loaded.config.vocab_size
    if body.top_k > vocabulary:
        raise RequestError(422, "top_k", f"top_k={body.top_k}: expected at most the vocabulary's {vocabulary}")
    ids, single = token_rows(served, body.inputs, "inputs", truncate=body.truncate)
    tokenizer = served.loaded.tokenizer
    for i, row in enumerate(ids):
        if tokenizer.mask_token_id not in row:
            raise RequestError(422, "inputs", f"inputs[{i}] holds no {tokenizer.mask_token}: expected at least one")
    return Parsed([Item("fill_mask", (body.top_k,), row, len(row)) for row in ids],
                  lambda results: results[0] if single else results)


class SimilarRequest(Body):
    sentences: StrictStr | list[StrictStr]
    n: StrictInt = Field(8, ge=1, le=64)
    seed: StrictInt = Field(0, ge=0, le=2**32 - 1)
    top_p: Number = Field(0.95, gt=0, le=1)
    temperature: Number = Field(1.0, ge=1e-6, le=2)
    max_new_tokens: StrictInt = Field(32, ge=1)


@route("POST", "/similar", SimilarRequest, "roformer_hf", lambda loaded: loaded.is_sim)
def similar(served: ServedModel, body: SimilarRequest, _) -> Parsed:
    ids, _ = token_rows(served, body.sentences, "sentences")
    sentences = [body.sentences] if isinstance(body.sentences, str) else body.sentences
    if body.max_new_tokens > served.loaded.max_length:
        raise RequestError(422, "max_new_tokens", f"max_new_tokens={body.max_new_tokens}: expected at most "
                           f"{served.loaded.max_length}")
    key = (body.n, body.seed, float(body.top_p), float(body.temperature), body.max_new_tokens)
    # A sentence's cost: its n candidates, each its prompt and what it may generate.
    items = [Item("similar", key, sentence, body.n * (len(row) + body.max_new_tokens))
             for sentence, row in zip(sentences, ids)]
    return Parsed(items, lambda results: {"data": [
        {"index": i, "similar": [{"text": s.text, "score": s.score} for s in ranked]}
        for i, ranked in enumerate(results)]})


# Also at text-embeddings-inference's health routes, the probes of Inference Endpoints and SageMaker.
@route("GET", "/health", None, "roformer_hf")
@route("GET", "/", None, "tei")
@route("GET", "/ping", None, "tei")
def health(served: ServedModel, _, __) -> Parsed:
    return Parsed([], lambda _: {"status": "ok", "model": served.loaded.name, "routes": served.routes})


__all__ = ["FillMaskRequest", "SimilarRequest"]
