"""`Batcher`: the chunks of concurrent requests gathered into batches for a worker that runs one batch at a time, each
batch formed when the worker is free.

A replica has one model thread, and a batch costs a forward whatever its size, in part or in whole (a small model's
forward is Python's work; a GPU's waits on launching kernels). So a batch should hold everything that arrived while
the previous one ran. Ray Serve's `@serve.batch` (Ray 2.60) forms the next batch as soon as its wait ends, while the
previous one still runs, and queues it behind it: under load its batches held what arrived in one wait (a few
milliseconds), and a replica answered about as many requests a second as it ran forwards. Here a batch is formed when
the worker is free: the pending chunks of the oldest chunk's kind, in arrival order, up to the token budget.

A chunk may wait for others to join (`wait_s`, from its arrival): its batch goes when the wait ends or the budget is
met, whichever is first. Chunks that waited longer while the worker was busy go at once when it is free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Sized(Protocol):
    tokens: int  # what the chunk costs a batch: at most the budget (a chunk over it goes alone)


@dataclass
class _Pending:
    kind: str
    chunk: Sized
    future: asyncio.Future
    deadline: float  # the event loop's time at which its batch goes, full or not


class Batcher:
    """Batches of chunks, each batch of one kind and at most `budget` tokens, run by `run` one at a time.

    Args:
        run: ``await run(kind, chunks)`` runs one batch and returns one result per chunk, in order.
        budget: the most tokens a batch holds (`Sized.tokens` summed); a chunk of more goes alone.

    Example:

    ```python
    >>> import asyncio
    >>> from types import SimpleNamespace
    >>> batches = []
    >>> async def run(kind, chunks):
    ...     batches.append([chunk.text for chunk in chunks])
    ...     await asyncio.sleep(0.01)
    ...     return [chunk.text.upper() for chunk in chunks]
    >>> async def main():
    ...     batcher = Batcher(run, budget=100)
    ...     chunk = lambda text: SimpleNamespace(text=text, tokens=len(text))
    ...     first = asyncio.ensure_future(batcher.submit("embed", chunk("a")))
    ...     await asyncio.sleep(0)  # the first batch starts, alone
    ...     rest = [batcher.submit("embed", chunk(text)) for text in ("b", "c", "d")]
    ...     return await asyncio.gather(first, *rest)
    >>> asyncio.run(main()), batches
    (['A', 'B', 'C', 'D'], [['a'], ['b', 'c', 'd']])
    ```
    """

    def __init__(self, run: Callable[[str, list[Any]], Awaitable[Sequence[Any]]], budget: int):
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget={budget!r}: expected a positive number of tokens")
        self.run, self.budget = run, budget
        self.pending: list[_Pending] = []  # in arrival order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, kind: str, chunk: Sized, wait_s: float = 0.0) -> Any:
        """`chunk`'s result from the batch it joins, of `kind`; it waits at most `wait_s` after now for others to
        join it (less if the budget fills first). Raises what `run` raised for its batch."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._arrived = loop, asyncio.Event()
        elif loop is not self._loop:
            raise RuntimeError("Batcher.submit: called from another event loop than the first call's; a Batcher "
                               "serves one event loop")
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._serve(), name="roformer_hf batcher")
        future = loop.create_future()
        self.pending.append(_Pending(kind, chunk, future, loop.time() + max(wait_s, 0.0)))
        self._arrived.set()
        return await future

    async def _serve(self) -> None:
        while True:
            await self._next_arrival()
            first = self.pending[0]
            while self._pending_tokens(first.kind) < self.budget and not first.future.done():
                remaining = first.deadline - self._loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = self._take(first.kind)
            if batch:
                await self._run(first.kind, batch)

    async def _next_arrival(self) -> None:
        """Until a chunk is pending whose request still waits for it (a cancelled request's chunks are dropped)."""
        while True:
            self.pending = [entry for entry in self.pending if not entry.future.done()]
            if self.pending:
                return
            self._arrived.clear()
            await self._arrived.wait()

    def _pending_tokens(self, kind: str) -> int:
        return sum(entry.chunk.tokens for entry in self.pending if entry.kind == kind and not entry.future.done())

    def _take(self, kind: str) -> list[_Pending]:
        """The pending chunks of `kind` in arrival order up to the budget (the first one whatever its cost), taken out
        of `pending`; it stops at the first that does not fit, so that no chunk is passed over twice."""
        batch, tokens, rest = [], 0, []
        full = False
        for entry in self.pending:
            if entry.future.done():
                continue
            if entry.kind == kind and not full and (not batch or tokens + entry.chunk.tokens <= self.budget):
                batch.append(entry)
                tokens += entry.chunk.tokens
            else:
                full = full or entry.kind == kind
                rest.append(entry)
        self.pending = rest
        return batch

    async def _run(self, kind: str, batch: list[_Pending]) -> None:
        try:
            results = await self.run(kind, [entry.chunk for entry in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"Batcher: run returned {len(results)} results for a batch of {len(batch)} "
                                   "chunks: expected one per chunk")
        except Exception as error:  # noqa: BLE001 - each request of the batch gets the failure
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(error)
            return
        for entry, result in zip(batch, results):
            if not entry.future.done():
                entry.future.set_result(result)


__all__ = ["Batcher"]
