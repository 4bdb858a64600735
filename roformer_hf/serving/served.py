"""`ServedModel`: a loaded folder, its tasks and the routes it answers, as plain Python (no Ray): what each replica
of the server holds, and what a test or a script can call directly."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import time
from typing import Any

from pydantic import ValidationError
from starlette.routing import compile_path

from . import native_api, openai_api, rerank_api, tei_api  # noqa: F401 - each fills `protocol.ROUTES`
from .errors import RequestError, RowError
from .loaded import LoadedModel
from .protocol import ROUTES, Parsed, Route, validation_error
from .tasks import Tasks

# Inputs one request may carry by default: OpenAI's limit for an embeddings request. LangChain's `OpenAIEmbeddings`
# sends 1000 texts a request by default.
MAX_INPUTS = 2048


class ServedModel(Tasks):
    """A saved folder, loaded once, and the routes it answers.

    Every model answers OpenAI's `/v1/embeddings` and `/v1/models`, text-embeddings-inference's `/embed`,
    `/embed_all`, `/similarity`, `/tokenize`, `/decode`, `/info` and `POST /` (as the folder's own route), and
    `/health`. A sequence classifier answers `/predict` too, one of a single label (a cross-encoder) `/rerank`; a
    masked LM `/fill-mask`; a causal LM `/v1/completions`; RoFormer-Sim `/similar`.

    Args:
        folder: written by `save_pretrained`, the converter or sentence-transformers; it must hold a tokenizer.
        int8: quantize the linear layers (`roformer_hf.quantization.quantize_int8`); as saved otherwise.
        max_inputs: the most inputs one request may carry.
        device: where the model runs (`"cpu"`, `"cuda"`).
        name: the name clients give as `model` (default: the folder's name).
        compile: embed one input at a time with the encoder compiled ahead of time (AOTInductor, on CPU; a sequence
            classifier: classify one input with the classifier compiled; with `int8` quantized statically, from
            `calibration`): compiled here (seconds to a minute, by the model's size)
            or loaded from `compile_cache` (about a second), and never while serving (an input of one token runs
            eagerly); batches of several inputs stay eager.
        calibration: with `int8` and `compile`: a text file of inputs like those the server will embed or classify,
            one per line, that fix the compiled int8 graph's activation scales (`LoadedModel`).
        compile_cache: with `compile`: the folder that keeps compiled packages between starts (default
            `compiled.default_compile_cache()`; `LoadedModel`).
        settings: the server's settings that `/info` reports (`max_batch_tokens`, `max_ongoing_requests`).
        auto_truncate: cut an input longer than the model takes, where its request does not say `truncate` (as
            text-embeddings-inference's `--auto-truncate` does); otherwise such an input is refused (413).

    Example:

    ```python
    >>> import tempfile
    >>> from roformer_hf import RoFormerConfig, RoFormerModel, RoFormerHFTokenizer
    >>> from roformer_hf.serving import ServedModel
    >>> words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "be", "or", "not"]
    >>> folder = tempfile.mkdtemp()
    >>> tokenizer = RoFormerHFTokenizer(vocab={w: i for i, w in enumerate(words)}, model_max_length=32)
    >>> files = tokenizer.save_pretrained(folder)
    >>> RoFormerModel(RoFormerConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, intermediate_size=64)).save_pretrained(folder)
    >>> served = ServedModel(folder, name="tiny")
    >>> "/v1/embeddings" in served.routes and "/predict" not in served.routes
    True
    >>> len(served.answer("/embed", {"inputs": ["to be", "or not"]})[0])
    32
    >>> served.answer("/v1/models")["data"][0]["id"]
    'tiny'
    ```
    """

    def __init__(self, folder: str | os.PathLike, *, int8: bool = False, max_inputs: int = MAX_INPUTS, device: str = "cpu",
                 name: str | None = None, compile: bool = False, calibration: str | os.PathLike | None = None,
                 compile_cache: str | os.PathLike | None = None, settings: dict[str, Any] | None = None,
                 auto_truncate: bool = False):
        if not isinstance(max_inputs, int) or max_inputs < 1:
            raise ValueError(f"max_inputs={max_inputs!r}: expected a positive integer")
        if not isinstance(auto_truncate, bool):
            raise ValueError(f"auto_truncate={auto_truncate!r}: expected True or False")
        super().__init__(LoadedModel(folder, int8=int8, device=device, name=name, compile=compile,
                                     calibration=calibration, compile_cache=compile_cache))
        self.max_inputs, self.settings, self.created = max_inputs, dict(settings or {}), int(time.time())
        self.auto_truncate = auto_truncate
        self.served_routes = [entry for entry in ROUTES if entry.serves(self.loaded)]
        self.routes = sorted({entry.path for entry in self.served_routes})
        self.paths = {(entry.method, entry.path) for entry in self.served_routes}

    def find(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        """The route answering `method` on `path`, and the path's parameters; a 404 naming the routes served."""
        for entry in self.served_routes:
            match = _pattern(entry.path).fullmatch(path)
            if entry.method == method and match is not None:
                return entry, match.groupdict()
        raise RequestError(404, "path", f"{method} {path} is not a route of this model ({type(self.model).__name__}): "
                           f"expected one of {self.routes}", routes=self.routes)

    def parse(self, path: str, body: Any = None, *, method: str | None = None) -> Parsed:
        """The request as items and how to answer it (`method`: POST where there is a body, else GET); raises
        `RequestError` for what cannot be served."""
        entry, params = self.find(method or ("GET" if body is None else "POST"), path)
        return self.parse_for(entry, body, params)

    def parse_for(self, entry: Route, body: Any, params: dict[str, str]) -> Parsed:
        if entry.body is not None:
            if not isinstance(body, (dict, entry.body)):
                raise RequestError(422, None, f"body={body!r:.60}: expected a JSON object")
            if isinstance(body, dict) and entry.body is not dict:
                try:
                    body = entry.body.model_validate(body)
                except ValidationError as error:
                    raise validation_error(error, entry) from None
        return entry.handler(self, body, params)

    def answer(self, path: str, body: Any = None, *, method: str | None = None):
        """The answer to one request (`method` as `parse` reads it), its items run here without batching across
        requests: what the server writes as JSON (embeddings as float32 numpy arrays); a streamed answer is the list of
        its chunks."""

        async def run():
            parsed = self.parse(path, body, method=method)

            async def results():
                return raise_row_errors(self.run(parsed.items))

            if parsed.stream is not None:
                return [chunk async for chunk in parsed.stream(results())]
            return parsed.respond(await results())

        # Not `asyncio.run`: on Python 3.11 its SIGINT check formats the finished task's repr, every array of the
        # answer in full (a 32 x 768 answer took 25 ms more).
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(run())
        finally:
            loop.close()


@functools.cache
def _pattern(path: str) -> re.Pattern:
    return compile_path(path)[0]


def raise_row_errors(results: list) -> list:
    """`results`, or the first input's failure among them: the request's answer is then a 500."""
    for result in results:
        if isinstance(result, RowError):
            raise result
    return results


__all__ = ["MAX_INPUTS", "ServedModel", "raise_row_errors"]
