"""The Ray Serve deployment: a FastAPI ingress whose routes come from `protocol.ROUTES`, a request's items batched
with other requests' on the replica's model thread, the guards in front (API key, body size), every error in OpenAI's
shape, and a health check that runs the model.

A request's items go to the replica's `batching.Batcher` in chunks of at most `max_batch_tokens`, counted as a
chunk will cost (a completion: its prompt plus the tokens it may generate); when the model thread is free, the chunks
of concurrent requests that wait, of one kind, up to `max_batch_tokens`, make one batch: one forward (or one
`generate`), and every request gets its own rows back.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time.
import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.metrics import Counter, Histogram
from starlette.exceptions import HTTPException

from . import guards
from .batching import Batcher
from .errors import RequestError, RowError, error_body
from .guards import Guarded, json_response
from .native_api import health
from .protocol import ROUTES, Parsed, Route, validation_error
from .served import MAX_INPUTS, ServedModel, raise_row_errors
from .tasks import Item, by_tokens

logger = logging.getLogger("ray.serve")  # Ray Serve shows its logger's lines in the replica's log and the driver's

app = FastAPI(title="roformer_hf", description="OpenAI's and text-embeddings-inference's APIs for a RoFormer folder.")
app.add_middleware(Guarded)


@app.exception_handler(RequestError)
async def _refused(request: Request, error: RequestError) -> Response:
    return json_response(error.status, error.body(), error.headers)


ROUTE_OF = {(entry.method, entry.path): entry for entry in ROUTES}


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, error: RequestValidationError) -> Response:
    """FastAPI's validation, answered as `ServedModel.parse` answers it: 400 for a body that is not JSON, else a 422
    naming the field."""
    first = error.errors()[0] if error.errors() else {"type": ""}
    if first["type"] == "json_invalid":
        return json_response(400, error_body(400, "the body is not valid JSON "
                                                  f"({first.get('ctx', {}).get('error', '')}): expected a JSON object"))
    route = request.scope.get("route")
    entry = ROUTE_OF.get((request.method, getattr(route, "path", None)))
    if entry is None or entry.body is None:
        return json_response(422, error_body(422, f"{request.method} {request.url.path}: {first.get('msg')}"))
    if entry.body is dict:
        return json_response(422, error_body(422, f"body={error.body!r:.60}: expected a JSON object"))
    try:
        entry.body.model_validate(error.body if error.body is not None else {})
    except ValidationError as again:
        refusal = validation_error(again, entry)
    else:
        refusal = RequestError(422, None, f"body={error.body!r:.60}: expected a JSON object")
    return json_response(refusal.status, refusal.body())


@app.exception_handler(HTTPException)
async def _http(request: Request, error: HTTPException) -> Response:
    return json_response(error.status_code, error_body(error.status_code, f"{request.method} {request.url.path}: "
                                                                  f"{error.detail}"), getattr(error, "headers", None))


@app.exception_handler(Exception)
async def _failed(request: Request, error: Exception) -> Response:
    if not isinstance(error, RowError):
        logger.exception("%s %s failed", request.method, request.url.path)
    return json_response(500, error_body(500, f"the server failed on this request: {error}"))


class Chunk(NamedTuple):
    """Consecutive items of one request, and what they cost a batch (at most the budget)."""

    items: list[Item]
    tokens: int


def chunks(items: list[Item], budget: int) -> list[Chunk]:
    """A request's items in consecutive chunks of at most `budget` tokens; an item costing more than the budget goes
    alone (the parsers keep inputs within the model's length, and the budget is at least that)."""
    runs = by_tokens(list(range(len(items))), [item.tokens for item in items], budget) or [[]]
    return [Chunk([items[i] for i in run], min(sum(items[i].tokens for i in run), budget)) for run in runs]


class ModelThread:
    """The replica's one thread for forwards (so the event loop keeps taking requests), and whether it still makes
    progress: busy with no forward or generation step ended for `stall_s`, it is wedged; idle, it must run a tiny
    forward within `stall_s`."""

    def __init__(self, served: ServedModel, stall_s: float):
        self.served, self.stall_s = served, stall_s
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="roformer")
        self.pending, self.failure = 0, None

    async def call(self, function, *args):
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)
        finally:
            self.pending -= 1

    async def check(self) -> None:
        """Raises where the model thread is wedged or its forward fails; `failure` keeps why, until a check passes."""
        try:
            await self._check()
        except Exception as error:
            self.failure = str(error)
            raise
        self.failure = None

    async def _check(self) -> None:
        if self.pending:
            stalled = time.monotonic() - self.served.beat
            if stalled > self.stall_s:
                raise RuntimeError(f"the model thread made no progress for {stalled:.0f} s with {self.pending} batches "
                                   "waiting: wedged")
            return
        tokenizer = self.served.tokenizer
        ids = [tokenizer.cls_token_id or 0, tokenizer.sep_token_id or 0]
        probe = Item("embed", (), ids, len(ids))
        try:
            results = await asyncio.wait_for(self.call(self.served.run, [probe]), self.stall_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"a forward of 2 tokens took over {self.stall_s} s: the model thread is "
                               "wedged") from None
        raise_row_errors(results)


@dataclass
class Timing:
    """Where a request's time went, for text-embeddings-inference's headers (milliseconds)."""

    start: float = field(default_factory=time.perf_counter)
    parsed: float = 0.0
    batch_start: float = 0.0
    batch_end: float = 0.0
    batch_size: int = 0  # the inputs of the largest batch the request's inputs ran in

    def headers(self, tokens: int, device: str) -> dict[str, str]:
        now = time.perf_counter()
        queue = max(0.0, self.batch_start - self.parsed) if self.batch_start else 0.0
        inference = self.batch_end - self.batch_start if self.batch_start else 0.0
        return {"x-compute-type": "gpu" if device == "cuda" else device,
                "x-compute-time": f"{(now - self.start) * 1000:.0f}", "x-compute-tokens": str(tokens),
                "x-total-time": f"{(now - self.start) * 1000:.0f}",
                "x-tokenization-time": f"{(self.parsed - self.start) * 1000:.0f}",
                "x-queue-time": f"{queue * 1000:.0f}", "x-inference-time": f"{inference * 1000:.0f}",
                "x-batch-size": str(self.batch_size)}


class RoFormerServer:
    """The Ray Serve deployment of a `ServedModel`, one per replica, its forwards on a `ModelThread` with `threads`
    torch threads. The remaining arguments are `build_app`'s."""

    def __init__(self, folder: str, *, threads: int = 1, int8: bool = False, max_batch_tokens: int = 4096,
                 batch_wait_ms: float = 5.0, max_inputs: int = MAX_INPUTS, device: str = "cpu", name: str | None = None,
                 api_key: str | None = None, payload_limit: int = 2_000_000, request_timeout_s: float | None = None,
                 stall_s: float = 30.0, max_ongoing_requests: int | None = None, compile: bool = False,
                 calibration: str | None = None, compile_cache: str | None = None, auto_truncate: bool = False):
        torch.set_num_threads(threads)  # before compiling: inductor's kernels keep the thread count they compiled with
        self.served = ServedModel(folder, int8=int8, max_inputs=max_inputs, device=device, name=name, compile=compile,
                                  calibration=calibration, compile_cache=compile_cache, auto_truncate=auto_truncate,
                                  settings={"max_batch_tokens": max_batch_tokens,
                                            "max_ongoing_requests": max_ongoing_requests})
        if max_batch_tokens < self.served.loaded.max_length:
            raise ValueError(f"max_batch_tokens={max_batch_tokens}: expected at least the model's longest input, "
                             f"{self.served.loaded.max_length} tokens")
        guards.GUARD.api_key, guards.GUARD.payload_limit = api_key, payload_limit
        self.thread = ModelThread(self.served, stall_s)
        self.batcher = Batcher(self.run_batch, max_batch_tokens)
        self.max_batch_tokens, self.request_timeout_s = max_batch_tokens, request_timeout_s
        self.batch_wait_s, self.ongoing = batch_wait_ms / 1000, 0  # requests past parsing, not yet answered
        self.batch_tokens = Histogram("roformer_batch_tokens", description="Tokens per batch, as a batch counts them.",
                                      boundaries=[16, 64, 256, 1024, 4096, 16384], tag_keys=("kind",))
        self.batch_size = Histogram("roformer_batch_size", description="Inputs per batch.",
                                    boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256], tag_keys=("kind",))
        self.refused = Counter("roformer_refused_requests", description="Requests refused with a 4xx.",
                               tag_keys=("status",))
        self.served.run([Item("embed", (), [self.served.tokenizer.cls_token_id or 0], 1)])  # it runs, once
        logger.info("serving %s with %d threads, batches of up to %d tokens or %g ms: %s",
                    self.served.loaded.describe(), threads, max_batch_tokens, batch_wait_ms,
                    ", ".join(self.served.routes))

    async def run_batch(self, kind: str, batch: list[Chunk]) -> list[tuple[float, float, int, list]]:
        """One batch on the model thread: each chunk's results, with the batch's start, end and inputs."""
        items = [item for chunk in batch for item in chunk.items]
        self.batch_tokens.observe(sum(chunk.tokens for chunk in batch), tags={"kind": kind})
        self.batch_size.observe(len(items), tags={"kind": kind})
        start = time.perf_counter()
        results = await self.thread.call(self.served.run, items)
        end = time.perf_counter()
        out, offset = [], 0
        for chunk in batch:
            out.append((start, end, len(items), results[offset:offset + len(chunk.items)]))
            offset += len(chunk.items)
        return out

    async def check_health(self) -> None:
        """Ray Serve's health check: the model runs (or is making progress); else Ray Serve replaces the replica."""
        await self.thread.check()

    async def handle(self, entry: Route, request: Request, body: Any) -> Response:
        timing = Timing()
        if entry.handler is health and self.thread.failure is not None:
            raise RequestError(503, None, f"this replica cannot run its model ({self.thread.failure}): expected Ray "
                               "Serve to replace it", code="unhealthy", headers={"retry-after": "1"})
        try:
            if (entry.method, entry.path) not in self.served.paths:
                self.served.find(entry.method, entry.path)  # raises the 404 naming the routes
            parsed = self.served.parse_for(entry, body, request.path_params)
        except RequestError as error:
            self.refused.inc(tags={"status": str(error.status)})
            raise
        timing.parsed = time.perf_counter()
        if not parsed.items:
            return json_response(200, parsed.respond([]))
        tokens = sum(item.tokens for item in parsed.items)
        if parsed.stream is not None:
            return StreamingResponse(self._events(parsed), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        try:
            results = await asyncio.wait_for(self.run_items(parsed.items, timing), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(504, None, f"the request took over --request-timeout={self.request_timeout_s} s: "
                               "expected a smaller request, or a longer timeout", code="timeout") from None
        # orjson renders 32 embeddings of 768 floats in 1 ms where `json` takes 10 (the same numbers, shortest
        # round-trip form); FastAPI's own path would first walk every float with `jsonable_encoder`.
        return json_response(200, parsed.respond(raise_row_errors(results)),
                             timing.headers(tokens, self.served.loaded.device.type))

    async def _events(self, parsed: Parsed) -> AsyncIterator[bytes]:
        """The streamed answer as server-sent events, `data: [DONE]` last; a failure mid-stream is an error event."""
        try:
            async for chunk in parsed.stream(self.run_items(parsed.items, Timing())):
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        except Exception as error:  # noqa: BLE001 - the status is sent: the error goes in the stream
            yield b"data: " + orjson.dumps(error_body(500, f"the server failed on this request: {error}")) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def run_items(self, items: list[Item], timing: Timing) -> list:
        # The batch wait pays only where other requests can join: a request alone in the replica goes at once.
        wait_s = self.batch_wait_s if self.ongoing else 0.0
        self.ongoing += 1
        try:
            answers = await asyncio.gather(*(self.batcher.submit(items[0].kind, chunk, wait_s)
                                             for chunk in chunks(items, self.max_batch_tokens)))
        finally:
            self.ongoing -= 1
        timing.batch_start = min(start for start, _, _, _ in answers)
        timing.batch_end = max(end for _, end, _, _ in answers)
        timing.batch_size = max(size for _, _, size, _ in answers)
        return [result for _, _, _, results in answers for result in results]


def _endpoint(entry: Route):
    """The FastAPI endpoint of a route, as a method of the deployment (Ray Serve binds `self` to the replica); its
    body typed, so that /docs shows the schema."""
    if entry.body is None:
        async def endpoint(self, request: Request):
            return await self.handle(entry, request, None)
    else:
        async def endpoint(self, request: Request, body: entry.body):
            return await self.handle(entry, request, body)
    endpoint.__name__ = f"{entry.method.lower()}_{entry.protocol}_" + ("".join(
        c if c.isalnum() else "_" for c in entry.path).strip("_") or "root")
    endpoint.__qualname__ = f"RoFormerServer.{endpoint.__name__}"  # how Ray Serve tells the class's routes
    return endpoint


for _entry in ROUTES:
    _method = _endpoint(_entry)
    setattr(RoFormerServer, _method.__name__, _method)
    app.add_api_route(_entry.path, _method, methods=[_entry.method], tags=[_entry.protocol],
                      response_class=Response)


async def unknown(self, request: Request, path: str):
    self.refused.inc(tags={"status": "404"})
    raise RequestError(404, "path", f"{request.method} /{path} is not a route of this model: expected one of "
                       f"{self.served.routes}", routes=self.served.routes)


unknown.__qualname__ = "RoFormerServer.unknown"
RoFormerServer.unknown = unknown
app.add_api_route("/{path:path}", unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)

# Health checked every second (Ray Serve's default: 10 s), so that a replica that died is replaced seconds sooner.
# Overload is Ray Serve's: `max_ongoing_requests` per replica, then `max_queued_requests`, then 503 with Retry-After
# (in OpenAI's shape through `guards.proxy_middlewares`). Ray Serve routes by those limits, so they stay its own.
RoFormerServer = serve.deployment(max_ongoing_requests=64, max_queued_requests=256, health_check_period_s=1,
                                  backpressure_config={"status_code": 503, "retry_after_s": 1})(
    serve.ingress(app)(RoFormerServer))


MAX_DEFAULT_REPLICAS = 4


def default_replicas(threads: int | None = None) -> int:
    """Replicas so that the replicas together use the machine's cores: as many as the cores take of `threads`
    threads each; without `threads`, one per core up to `MAX_DEFAULT_REPLICAS` (each holds the model). On 2 cores
    (Intel Xeon and AMD EPYC), two replicas of one thread answered more sentences per second than one of two, for
    single sentences and requests of 32 alike, and one client as fast (benchmarks/RESULTS.md)."""
    cores = usable_cores()
    return max(1, cores // threads) if threads else min(cores, MAX_DEFAULT_REPLICAS)


def default_threads(replicas: int) -> int:
    """Torch threads per replica so that the replicas together use the machine's cores, no more."""
    return max(1, usable_cores() // replicas)


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS keeps one (`taskset`, a container's
    cpuset), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


__all__ = ["MAX_DEFAULT_REPLICAS", "ModelThread", "RoFormerServer", "app", "chunks", "default_replicas",
           "default_threads", "usable_cores"]
