"""text-embeddings-inference's API: `POST /embed`, `/embed_all` (each token's embedding), `/rerank` (a cross-encoder:
a sequence classifier of one label), `/predict` (sentences or sentence pairs), `/similarity`, `/tokenize`, `/decode`,
`GET /info`, and `POST /` (also `/invocations`, SageMaker's path), which answers as the folder's own route does. The
answers have TEI's shapes; errors have OpenAI's, as every route of this server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field, StrictBool, StrictInt, StrictStr

from .. import __version__
from .errors import RequestError
from .openai_api import check_dimensions, cut
from .protocol import Body, Direction, Parsed, TextsOrIds, check_count, route, token_rows, truncation_side, with_prompt
from .tasks import Item

if TYPE_CHECKING:
    from .served import ServedModel


class EmbedRequest(Body):
    inputs: TextsOrIds
    normalize: StrictBool = True
    truncate: StrictBool | None = None  # None: the server's --auto-truncate
    truncation_direction: Direction = "Right"
    prompt_name: StrictStr | None = None
    dimensions: StrictInt | None = Field(None, ge=1)


@route("POST", "/embed", EmbedRequest, "tei")
def embed(served: ServedModel, body: EmbedRequest, _) -> Parsed:
    check_dimensions(served, body.dimensions)
    ids, _ = token_rows(served, body.inputs, "inputs", truncate=body.truncate, direction=body.truncation_direction,
                        prompt_name=body.prompt_name)
    return Parsed([Item("embed", (), row, len(row)) for row in ids],
                  lambda vectors: torch.stack(cut(vectors, body.dimensions, body.normalize)).numpy())


class EmbedAllRequest(Body):
    inputs: TextsOrIds
    truncate: StrictBool | None = None  # None: the server's --auto-truncate
    truncation_direction: Direction = "Right"
    prompt_name: StrictStr | None = None


@route("POST", "/embed_all", EmbedAllRequest, "tei")
def embed_all(served: ServedModel, body: EmbedAllRequest, _) -> Parsed:
    """Each token's embedding (the encoder's last hidden state, special tokens included) for each input."""
    ids, _ = token_rows(served, body.inputs, "inputs", truncate=body.truncate, direction=body.truncation_direction,
                        prompt_name=body.prompt_name)
    return Parsed([Item("embed_tokens", (), row, len(row)) for row in ids],
                  lambda states: [state.numpy() for state in states])


class SimilarityInput(Body):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(Body):
    truncate: StrictBool | None = None  # None: the server's --auto-truncate
    truncation_direction: Direction = "Right"
    prompt_name: StrictStr | None = None


class SimilarityRequest(Body):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


@route("POST", "/similarity", SimilarityRequest, "tei")
def similarity(served: ServedModel, body: SimilarityRequest, _) -> Parsed:
    """The cosine similarity of `source_sentence`'s embedding with each of `sentences`' (the huggingface_hub client's
    `sentence_similarity`)."""
    options = body.parameters or SimilarityParameters()
    read = {"truncate": options.truncate, "direction": options.truncation_direction,
            "prompt_name": options.prompt_name}
    source, _ = token_rows(served, body.inputs.source_sentence, "inputs.source_sentence", **read)
    others, _ = token_rows(served, body.inputs.sentences, "inputs.sentences", **read)

    def respond(vectors):
        return torch.nn.functional.cosine_similarity(vectors[0][None], torch.stack(vectors[1:])).tolist()

    return Parsed([Item("embed", (), row, len(row)) for row in source + others], respond)


Sequence = StrictStr | list[StrictStr]


class PredictParameters(Body):
    """The text-classification task's parameters, as the huggingface_hub client sends them."""

    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    top_k: StrictInt | None = Field(None, ge=1)


class PredictRequest(Body):
    inputs: Sequence | list[Sequence]
    raw_scores: StrictBool = False
    truncate: StrictBool | None = None  # None: the server's --auto-truncate
    truncation_direction: Direction = "Right"
    parameters: PredictParameters | None = None


class RerankRequest(Body):
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool | None = None  # None: the server's --auto-truncate
    truncation_direction: Direction = "Right"


def encode_pairs(served: ServedModel, firsts: list[str], seconds: list[str | None], name: str, truncate: bool | None,
                  direction: str) -> list[dict[str, list[int]]]:
    """Rows of `input_ids` and `token_type_ids` for sentences (second None) or pairs, as the classifier reads them;
    `truncate` None: the server's `auto_truncate`."""
    truncate = served.auto_truncate if truncate is None else truncate
    for i, (first, second) in enumerate(zip(firsts, seconds)):
        if not first.strip() or (second is not None and not second.strip()):
            raise RequestError(422, name, f"{name}[{i}]: expected non-empty strings")
    limit, rows = served.loaded.max_length, []
    with truncation_side(served.loaded.tokenizer, direction) as tokenizer:
        for first, second in zip(firsts, seconds):
            encoded = tokenizer(first, second, truncation=truncate, max_length=limit)
            rows.append({"input_ids": encoded["input_ids"],
                         "token_type_ids": encoded.get("token_type_ids", [0] * len(encoded["input_ids"]))})
    for i, row in enumerate(rows):
        if len(row["input_ids"]) > limit:
            raise RequestError(413, name, f"{name}[{i}] is {len(row['input_ids'])} tokens long: expected at most "
                               f"{limit} (set truncate to cut it)")
    return rows


def label_scores(served: ServedModel, logits: torch.Tensor, raw: bool, function: str | None = None) -> torch.Tensor:
    """Scores as TEI gives them: the logits where `raw`, else a sigmoid for one label or several independent ones,
    a softmax otherwise; `function` ("sigmoid", "softmax", "none") in place of that choice where given."""
    if function is None:
        config = served.loaded.config
        multi = config.problem_type == "multi_label_classification" or config.num_labels == 1
        function = "none" if raw else "sigmoid" if multi else "softmax"
    return {"none": logits, "sigmoid": logits.sigmoid(), "softmax": logits.softmax(-1)}[function]


def _classifier(loaded) -> bool:
    return loaded.is_classifier


@route("POST", "/predict", PredictRequest, "tei", _classifier)
def predict(served: ServedModel, body: PredictRequest, _) -> Parsed:
    # As TEI reads `inputs`: a string, or a list of two strings, is one input (a sentence, a pair); a list of more
    # strings, or of strings and pairs, is a batch.
    options = body.parameters or PredictParameters()
    if body.raw_scores and options.function_to_apply not in (None, "none"):
        raise RequestError(422, "parameters", f"raw_scores=true with parameters.function_to_apply="
                           f"{options.function_to_apply!r}: expected one of the two (raw scores are function 'none')")
    value = body.inputs
    single = isinstance(value, str) or (len(value) == 2 and all(isinstance(v, str) for v in value))
    inputs = [value] if single else value
    check_count(served, "inputs", len(inputs))
    pairs = []
    for i, item in enumerate(inputs):
        if isinstance(item, list) and len(item) != 2:
            raise RequestError(422, "inputs", f"inputs[{i}] holds {len(item)} strings: expected a string or a pair")
        pairs.append((item, None) if isinstance(item, str) else tuple(item))
    rows = encode_pairs(served, [p[0] for p in pairs], [p[1] for p in pairs], "inputs", body.truncate,
                         body.truncation_direction)
    labels = served.loaded.config.id2label

    def respond(logits):
        answers = [sorted(({"score": s, "label": labels[k]} for k, s in enumerate(
                    label_scores(served, row, body.raw_scores, options.function_to_apply).tolist())),
                          key=lambda e: -e["score"])[:options.top_k]
                   for row in logits]
        return answers[0] if single else answers

    return Parsed([Item("classify", (), row, len(row["input_ids"])) for row in rows], respond)


def rerank(served: ServedModel, body: RerankRequest, _) -> Parsed:
    """`POST /rerank` as text-embeddings-inference reads it (`rerank_api.rerank` routes a body here)."""
    check_count(served, "texts", len(body.texts))
    if not body.query.strip():
        raise RequestError(422, "query", "query='': expected a non-empty string")
    rows = encode_pairs(served, [body.query] * len(body.texts), body.texts, "texts", body.truncate,
                         body.truncation_direction)

    def respond(logits):
        scores = [label_scores(served, row, body.raw_scores)[0].item() for row in logits]
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        return [{"index": i, "score": scores[i], **({"text": body.texts[i]} if body.return_text else {})}
                for i in ranked]

    return Parsed([Item("classify", (), row, len(row["input_ids"])) for row in rows], respond)


class TokenizeRequest(Body):
    inputs: StrictStr | list[StrictStr]
    add_special_tokens: StrictBool = True
    prompt_name: StrictStr | None = None


@route("POST", "/tokenize", TokenizeRequest, "tei")
def tokenize(served: ServedModel, body: TokenizeRequest, _) -> Parsed:
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    check_count(served, "inputs", len(texts))
    texts = with_prompt(served, texts, body.prompt_name)
    tokenizer = served.loaded.tokenizer
    encoded = tokenizer(texts, add_special_tokens=body.add_special_tokens, return_offsets_mapping=True,
                        return_special_tokens_mask=True)
    answer = []
    for text, ids, offsets, special in zip(texts, encoded["input_ids"], encoded["offset_mapping"],
                                           encoded["special_tokens_mask"]):
        tokens = tokenizer.convert_ids_to_tokens(ids)
        answer.append([{"id": token_id, "text": token if is_special else text[start:stop], "special": bool(is_special),
                        "start": None if is_special else start, "stop": None if is_special else stop}
                       for token_id, token, (start, stop), is_special in zip(ids, tokens, offsets, special)])
    return Parsed([], lambda _: answer)


class DecodeRequest(Body):
    ids: list[StrictInt] | list[list[StrictInt]]
    skip_special_tokens: StrictBool = True


@route("POST", "/decode", DecodeRequest, "tei")
def decode(served: ServedModel, body: DecodeRequest, _) -> Parsed:
    rows = [body.ids] if body.ids and isinstance(body.ids[0], int) else body.ids
    check_count(served, "ids", len(rows))
    vocabulary = served.loaded.config.vocab_size
    for i, row in enumerate(rows):
        if any(not 0 <= token < vocabulary for token in row):
            raise RequestError(400, "ids", f"ids[{i}] holds an id outside 0 to {vocabulary - 1}: expected ids of this "
                               "model's tokenizer")
    texts = served.loaded.tokenizer.batch_decode(rows, skip_special_tokens=body.skip_special_tokens)
    return Parsed([], lambda _: texts)


def default_path(loaded) -> str:
    """The route `POST /` answers as, text-embeddings-inference's choice by the model: `/rerank` for a cross-encoder,
    `/predict` for another classifier, `/embed` otherwise."""
    return "/rerank" if loaded.is_reranker else "/predict" if loaded.is_classifier else "/embed"


@route("POST", "/", dict, "tei")
@route("POST", "/invocations", dict, "tei")
def default(served: ServedModel, body: dict, params: dict[str, str]) -> Parsed:
    entry, _ = served.find("POST", default_path(served.loaded))
    try:
        return served.parse_for(entry, body, params)
    except RequestError as error:  # say which route's body was expected
        error.message = f"{error.message} (POST / and /invocations answer as POST {entry.path} for this model)"
        raise


def model_type(served: ServedModel) -> dict:
    loaded = served.loaded
    if loaded.is_reranker:
        return {"reranker": {"id2label": _labels(loaded), "label2id": loaded.config.label2id}}
    if loaded.is_classifier:
        return {"classifier": {"id2label": _labels(loaded), "label2id": loaded.config.label2id}}
    return {"embedding": {"pooling": loaded.pooling}}


def _labels(loaded) -> dict[str, str]:
    return {str(k): v for k, v in loaded.config.id2label.items()}


@route("GET", "/info", None, "tei")
def info(served: ServedModel, _, __) -> Parsed:
    loaded = served.loaded
    answer = {"model_id": loaded.name, "model_sha": None, "model_dtype": loaded.dtype, "model_type": model_type(served),
              "max_concurrent_requests": served.settings.get("max_ongoing_requests"),
              "max_input_length": loaded.max_length, "max_batch_tokens": served.settings.get("max_batch_tokens"),
              "max_batch_requests": None, "max_client_batch_size": served.max_inputs,
              "auto_truncate": served.auto_truncate,
              "tokenization_workers": 1, "version": __version__, "sha": None, "docker_label": None,
              "routes": served.routes}
    return Parsed([], lambda _: answer)


__all__ = ["DecodeRequest", "EmbedAllRequest", "EmbedRequest", "PredictParameters", "PredictRequest", "RerankRequest",
           "SimilarityRequest", "TokenizeRequest", "default_path", "encode_pairs", "label_scores", "rerank"]
