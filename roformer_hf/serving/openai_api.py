"""OpenAI's API as its clients use it: `POST /v1/embeddings`, `POST /v1/completions` (streamed as server-sent events
where asked), `GET /v1/models` and `GET /v1/models/{model}`. A field OpenAI defines that this server does not do is
refused naming it, never ignored."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Literal

import torch.nn.functional as F
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .errors import RequestError, RowError
from .protocol import Body, Parsed, TextsOrIds, check_model, route, token_rows
from .tasks import Completion, Item

if TYPE_CHECKING:
    from .served import ServedModel

Number = StrictInt | StrictFloat
MAX_CHOICES = 16


class EmbeddingsRequest(Body):
    input: TextsOrIds
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None  # the caller's end user, for OpenAI's abuse monitoring: accepted, not used
    # Not OpenAI's: cut inputs longer than the model takes instead of refusing them (None: the server's --auto-truncate)
    truncate: StrictBool | None = None


class StreamOptions(Body):
    include_usage: StrictBool = False


class CompletionsRequest(Body):
    prompt: TextsOrIds
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    echo: StrictBool = False
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    user: StrictStr | None = None
    # OpenAI's fields this server does not do: refused unless they ask for what it does anyway.
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    logit_bias: dict[StrictStr, Number] | None = None
    suffix: StrictStr | None = None


def cut(vectors: list, dimensions: int | None, normalize: bool) -> list:
    """The embeddings cut to their first `dimensions` values, then scaled to unit length where `normalize`."""
    out = []
    for vector in vectors:
        vector = vector[:dimensions] if dimensions is not None else vector
        out.append(F.normalize(vector, dim=-1) if normalize else vector)
    return out


def check_dimensions(served: ServedModel, dimensions: int | None) -> None:
    """`dimensions` only where the folder names the sizes its embedding was trained to be cut to."""
    if dimensions is None:
        return
    sizes = served.loaded.dimensions
    if not sizes:
        raise RequestError(400, "dimensions", f"dimensions={dimensions}: this model's embedding was not trained to be "
                           f"cut (its config names no sentence_dimensions): expected no dimensions, for all "
                           f"{served.loaded.config.hidden_size}")
    if dimensions not in sizes:
        raise RequestError(400, "dimensions", f"dimensions={dimensions}: expected one of the sizes this model's "
                           f"embedding was trained at, {list(sizes)}")


@route("POST", "/v1/embeddings", EmbeddingsRequest, "openai")
@route("POST", "/embeddings", EmbeddingsRequest, "openai")  # the path of clients given the server's root as base URL
def embeddings(served: ServedModel, body: EmbeddingsRequest, _) -> Parsed:
    check_model(served, body.model)
    check_dimensions(served, body.dimensions)
    ids, _ = token_rows(served, body.input, "input", truncate=body.truncate)

    def respond(vectors):
        data = []
        for i, vector in enumerate(cut(vectors, body.dimensions, served.loaded.normalize)):
            embedding = (base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
                         if body.encoding_format == "base64" else vector.numpy())
            data.append({"object": "embedding", "embedding": embedding, "index": i})
        tokens = sum(len(row) for row in ids)
        return {"object": "list", "data": data, "model": served.loaded.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return Parsed([Item("embed", (), row, len(row)) for row in ids], respond)


def _refuse_unsupported(body: CompletionsRequest) -> None:
    if body.logprobs is not None:
        raise RequestError(400, "logprobs", f"logprobs={body.logprobs}: this server does not return log "
                           "probabilities: expected no logprobs")
    if body.best_of is not None and body.best_of != body.n:
        raise RequestError(400, "best_of", f"best_of={body.best_of}: this server does not rank candidates: expected "
                           f"no best_of, or best_of equal to n ({body.n})")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise RequestError(400, name, f"{name}={getattr(body, name)}: this server does not penalize tokens: "
                               "expected 0")
    if body.logit_bias:
        raise RequestError(400, "logit_bias", "logit_bias: this server does not bias tokens: expected none")
    if body.suffix is not None:
        raise RequestError(400, "suffix", "suffix: this server does not insert text: expected none")
    if body.stream_options is not None and not body.stream:
        raise RequestError(400, "stream_options", "stream_options without stream: expected stream=true")
    stops = _stops(body.stop)
    if len(stops) > 4 or not all(stops):
        raise RequestError(422, "stop", f"stop={body.stop!r:.60}: expected a string or up to 4 non-empty strings")


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


@route("POST", "/v1/completions", CompletionsRequest, "openai", lambda loaded: loaded.is_causal_lm)
def completions(served: ServedModel, body: CompletionsRequest, _) -> Parsed:
    check_model(served, body.model)
    _refuse_unsupported(body)
    ids, _ = token_rows(served, body.prompt, "prompt")
    limit = served.loaded.max_length
    longest = max(len(row) for row in ids)
    left = limit - longest
    if left < 1:
        raise RequestError(400, "prompt", f"the prompt is {longest} tokens long: expected at most {limit - 1}, to "
                           f"leave room for a completion in the model's {limit} tokens")
    if body.max_tokens is not None and body.max_tokens > left:
        raise RequestError(400, "max_tokens", f"max_tokens={body.max_tokens}: the prompt takes {longest} of the "
                           f"model's {limit} tokens: expected at most {left}")
    max_tokens = body.max_tokens if body.max_tokens is not None else min(16, left)
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    key = (max_tokens, float(body.temperature), float(body.top_p))
    stops = _stops(body.stop)
    # Choice `i * n + j` is prompt i's j-th completion, sampled from stream `seed + j`.
    choices = [(i, j) for i in range(len(ids)) for j in range(body.n)]
    prompt_texts = _prompt_texts(served, body.prompt, ids) if body.echo else None
    ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

    def envelope(choice_rows: list[dict], usage: dict | None = None) -> dict:
        answer = {"id": ident, "object": "text_completion", "created": created, "model": served.loaded.name,
                  "choices": choice_rows}
        if usage is not None:
            answer["usage"] = usage
        return answer

    def usage(outputs) -> dict:
        prompt_tokens = sum(map(len, ids))  # each prompt once, as OpenAI counts it, whatever n
        completion_tokens = sum(len(tokens) for tokens in outputs if not isinstance(tokens, RowError))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def until_stop(tokens: list[int]) -> tuple[str, bool]:
        """The text of `tokens` up to the first stop string, and whether one came."""
        text = served.loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in stops if s in text]
        return (text[:min(cuts)], True) if cuts else (text, False)

    def finished(tokens: list[int]) -> tuple[str, str]:
        """The text of a completion, and why it ended: its end-of-sequence token or a stop string, or max_tokens."""
        text, stopped = until_stop(tokens)
        return text, "stop" if stopped or len(tokens) < max_tokens else "length"

    def respond(outputs):
        rows = []
        for index, ((i, _), tokens) in enumerate(zip(choices, outputs)):
            text, finish = finished(tokens)
            text = prompt_texts[i] + text if body.echo else text
            rows.append({"text": text, "index": index, "logprobs": None, "finish_reason": finish})
        return envelope(rows, usage(outputs))

    if not body.stream:
        items = [Item("complete", key, Completion(ids[i], seed + j), len(ids[i]) + max_tokens) for i, j in choices]
        return Parsed(items, respond)

    # Streamed: each choice's tokens reach this event loop as the model makes them.
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def sink(index: int):
        return lambda token: loop.call_soon_threadsafe(events.put_nowait, (index, token))

    items = [Item("complete", key, Completion(ids[i], seed + j, sink(index)), len(ids[i]) + max_tokens)
             for index, (i, j) in enumerate(choices)]
    hold = max((len(s) for s in stops), default=1) - 1  # text that could still become a stop string waits

    async def stream(results: Awaitable[list]) -> AsyncIterator[dict]:
        task = asyncio.ensure_future(results)
        task.add_done_callback(lambda _: events.put_nowait(None))
        tokens: list[list[int]] = [[] for _ in choices]
        sent = [0] * len(choices)  # characters of each choice's text sent so far
        stopped = [False] * len(choices)
        if body.echo:
            yield envelope([{"text": prompt_texts[i], "index": index, "logprobs": None, "finish_reason": None}
                            for index, (i, _) in enumerate(choices)])
        while (event := await events.get()) is not None:
            index, token = event
            if stopped[index]:
                continue
            tokens[index].append(token)
            text, stopped[index] = until_stop(tokens[index])  # a stop string came: the choice ends
            ready = len(text) if stopped[index] else max(sent[index], len(text) - hold)
            if ready > sent[index]:
                yield envelope([{"text": text[sent[index]:ready], "index": index, "logprobs": None,
                                 "finish_reason": None}])
                sent[index] = ready
        outputs = await task  # raises where the batch failed
        for index, output in enumerate(outputs):
            if isinstance(output, RowError):
                raise output
            text, finish = finished(output)
            yield envelope([{"text": text[sent[index]:], "index": index, "logprobs": None, "finish_reason": finish}])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield envelope([], usage(outputs))

    return Parsed(items, respond, stream)


def _prompt_texts(served: ServedModel, prompt, ids: list[list[int]]) -> list[str]:
    """What `echo` puts before each completion: the prompt as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [served.loaded.tokenizer.decode(row, skip_special_tokens=True) for row in ids]


def model_card(served: ServedModel) -> dict:
    return {"id": served.loaded.name, "object": "model", "created": served.created, "owned_by": "roformer_hf"}


@route("GET", "/v1/models", None, "openai")
def models(served: ServedModel, _, __) -> Parsed:
    return Parsed([], lambda _: {"object": "list", "data": [model_card(served)]})


@route("GET", "/v1/models/{model:path}", None, "openai")
def model(served: ServedModel, _, path: dict[str, str]) -> Parsed:
    check_model(served, path["model"])
    return Parsed([], lambda _: model_card(served))


__all__ = ["CompletionsRequest", "EmbeddingsRequest", "check_dimensions", "cut"]
