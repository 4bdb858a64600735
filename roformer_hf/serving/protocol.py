"""What the protocol modules (`openai_api`, `tei_api`, `native_api`) share: the table of routes they fill, the typed
request bodies, a request as items plus how to answer it, and the reading of inputs (texts or token ids) into rows
of token ids."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from .errors import RequestError
from .tasks import Item

if TYPE_CHECKING:
    from .served import ServedModel

TextsOrIds = Annotated[StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]], Field(
    description="a string, a list of strings, a list of token ids, or a list of lists of token ids")]
Direction = Literal["Right", "Left", "right", "left"]


class Body(BaseModel):
    """A request body: every field typed, and a field the route does not know refused (422 naming it), never
    ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass
class Parsed:
    """A request as items for the tasks, and how to answer it from their results (in the items' order); a streamed
    answer is `stream(results)`, the chunks it sends while the items run."""

    items: list[Item]
    respond: Callable[[list], Any]
    stream: Callable[[Awaitable[list]], AsyncIterator[dict]] | None = None


@dataclass(frozen=True)
class Route:
    """One route: its method and path, its body's type (a `Body`; `dict` for any JSON object, which the handler reads
    itself; None for a GET), the protocol it belongs to, whether a folder serves it, and the handler from `(served,
    body, path parameters)` to the parsed request."""

    method: str
    path: str
    body: type[Body] | type[dict] | None
    protocol: str
    serves: Callable[[Any], bool]
    handler: Callable[[ServedModel, Any, dict[str, str]], Parsed]


ROUTES: list[Route] = []


def route(method: str, path: str, body: type[Body] | None, protocol: str, serves: Callable[[Any], bool] = bool):
    """Adds the decorated handler to `ROUTES`; `serves(loaded)` says whether a `LoadedModel` answers it."""

    def add(handler):
        ROUTES.append(Route(method, path, body, protocol, serves, handler))
        return handler

    return add


def validation_error(error: ValidationError, entry: Route) -> RequestError:
    """A body that does not match the route's type, as a 422 naming the first field at fault and what it takes."""
    first = error.errors()[0]
    location = [str(part) for part in first["loc"] if part != "body"]
    param = location[0] if location else None
    if first["type"] == "extra_forbidden":
        return RequestError(422, param, f"{'.'.join(location)}: not a field of {entry.path}: expected only the fields "
                            "of its schema (/docs lists them)")
    if first["type"] == "missing":
        return RequestError(422, param, f"{'.'.join(location)}: missing: expected the field (/docs lists the fields "
                            f"of {entry.path})")
    described = entry.body.model_fields.get(param) if param is not None else None
    if described is not None and described.description is not None:  # a union: say what it takes, not each try
        return RequestError(422, param, f"{param}={first.get('input')!r:.60}: expected {described.description}")
    where = ".".join(location) or "the body"
    message = first["msg"][0].lower() + first["msg"][1:] if first["msg"] else "a value of the field's type"
    return RequestError(422, param, f"{where}={first.get('input')!r:.60}: expected {message}")


def check_model(served: ServedModel, model: str | None) -> None:
    """`model`, where a client names one, must be the served name."""
    if model is not None and model != served.loaded.name:
        raise RequestError(404, "model", f"model={model!r}: expected {served.loaded.name!r}, the model this server "
                           "serves (GET /v1/models)", code="model_not_found")


def check_count(served: ServedModel, name: str, count: int) -> None:
    if count == 0:
        raise RequestError(422, name, f"{name}=[]: expected at least one input")
    if count > served.max_inputs:
        raise RequestError(413, name, f"{name} holds {count} inputs: expected at most {served.max_inputs} per request")


def with_prompt(served: ServedModel, texts: list[str], prompt_name: str | None, name: str = "prompt_name") -> list[str]:
    """`texts` with the folder's prompt `prompt_name` (else its default prompt, if any) put before each."""
    prompts = served.loaded.prompts
    if prompt_name is not None and prompt_name not in prompts:
        raise RequestError(400, name, f"{name}={prompt_name!r}: expected one of this folder's prompts, "
                           f"{sorted(prompts)} (config_sentence_transformers.json)")
    prompt_name = prompt_name if prompt_name is not None else served.loaded.default_prompt_name
    return texts if prompt_name is None else [prompts[prompt_name] + text for text in texts]


@contextmanager
def truncation_side(tokenizer, direction: str):
    """`tokenizer`, cutting long inputs on `direction`'s side ("left" or "right") inside the block."""
    saved, tokenizer.truncation_side = tokenizer.truncation_side, direction.lower()
    try:
        yield tokenizer
    finally:
        tokenizer.truncation_side = saved


def token_rows(served: ServedModel, value: Any, name: str, *, truncate: bool | None = None,
               direction: str = "right", prompt_name: str | None = None) -> tuple[list[list[int]], bool]:
    """The rows of token ids of `value` (a string, strings, token ids or lists of token ids) and whether it was one
    input. Texts are tokenized with the special tokens and the folder's prompt; token ids run as given (the folder's
    tokenizer's ids, no special token added). A row longer than the model takes is refused (413), or cut on
    `direction`'s side where `truncate` (None: where the server truncates by default, `served.auto_truncate`)."""
    direction, truncate = direction.lower(), served.auto_truncate if truncate is None else truncate
    single = isinstance(value, str) or (isinstance(value, list) and bool(value) and isinstance(value[0], int))
    rows = [value] if single else value
    check_count(served, name, len(rows))
    if isinstance(rows[0], str):
        for i, text in enumerate(rows):
            if not text.strip():
                raise RequestError(422, name, f"{name}[{i}]={text!r}: expected a non-empty string")
        texts = with_prompt(served, rows, prompt_name)
        with truncation_side(served.loaded.tokenizer, direction) as tokenizer:
            ids = tokenizer(texts, truncation=truncate, max_length=served.loaded.max_length)["input_ids"]
    else:
        if prompt_name is not None:
            raise RequestError(400, "prompt_name", f"prompt_name={prompt_name!r} with token ids: expected texts (a "
                               "prompt is text put before each input)")
        vocabulary = served.loaded.config.vocab_size
        for i, row in enumerate(rows):
            if not row:
                raise RequestError(422, name, f"{name}[{i}]=[]: expected at least one token id")
            bad = next((token for token in row if not 0 <= token < vocabulary), None)
            if bad is not None:
                raise RequestError(400, name, f"{name}[{i}] holds the token id {bad}: expected ids of this model's "
                                   f"tokenizer, 0 to {vocabulary - 1}")
        limit = served.loaded.max_length
        ids = [(row[-limit:] if direction == "left" else row[:limit]) if truncate else list(row) for row in rows]
    for i, row in enumerate(ids):
        if len(row) > served.loaded.max_length:
            raise RequestError(413, name, f"{name}[{i}] is {len(row)} tokens long: expected at most "
                               f"{served.loaded.max_length} (set truncate to cut it)")
    return ids, single


__all__ = ["Body", "Direction", "Parsed", "ROUTES", "Route", "TextsOrIds", "check_count", "check_model", "route",
           "token_rows", "truncation_side", "validation_error", "with_prompt"]
