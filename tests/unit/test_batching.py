"""`serving.batching.Batcher`: a batch is formed when the worker is free, of one kind, up to the budget, in arrival
order; a chunk waits for others only as long as it was told; cancelled requests drop out; a failure reaches every
request of its batch and no other."""

import asyncio
import doctest
import re
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="serving needs Ray Serve: pip install roformer_hf[serve]")

from roformer_hf.serving.batching import Batcher  # noqa: E402


def chunk(name: str, tokens: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=name, tokens=tokens)


class Worker:
    """A `run` that records each batch as (kind, names) and holds it until `release`: the model thread, busy."""

    def __init__(self, fail_on: str | None = None):
        self.batches: list[tuple[str, list[str]]] = []
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.fail_on = fail_on

    async def __call__(self, kind, chunks):
        self.batches.append((kind, [c.name for c in chunks]))
        self.started.set()
        await self.gate.wait()
        if self.fail_on in (c.name for c in chunks):
            raise ValueError(f"{self.fail_on} broke the model")
        return [f"{kind}:{c.name}" for c in chunks]

    async def busy_with(self, batcher: Batcher, first) -> asyncio.Future:
        """Submits `first` and returns once its batch runs (held)."""
        request = asyncio.ensure_future(batcher.submit("embed", first))
        await self.started.wait()
        self.gate.clear()
        return request


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_chunks_arriving_while_a_batch_runs_all_join_the_next_batch():
    # Ray Serve's @serve.batch cut these into batches of what arrived within each 5 ms wait, queued behind the one
    # running; here they wait for the worker and go together.
    async def main():
        worker = Worker()
        batcher = Batcher(worker, budget=100)
        first = await worker.busy_with(batcher, chunk("a"))
        later = []
        for name in "bcdefgh":
            later.append(asyncio.ensure_future(batcher.submit("embed", chunk(name), wait_s=0.005)))
            await asyncio.sleep(0.01)  # two waits' worth apart
        worker.gate.set()
        return await asyncio.gather(first, *later), worker.batches

    results, batches = run(main())
    assert batches == [("embed", ["a"]), ("embed", list("bcdefgh"))]
    assert results == [f"embed:{name}" for name in "abcdefgh"]


def test_a_batch_holds_one_kind_up_to_the_budget_in_arrival_order():
    async def main():
        worker = Worker()
        batcher = Batcher(worker, budget=100)
        first = await worker.busy_with(batcher, chunk("x", 5))
        waiting = [("embed", chunk("e30", 30)), ("classify", chunk("c10", 10)), ("embed", chunk("e50", 50)),
                   ("embed", chunk("e30b", 30)), ("embed", chunk("e10", 10)), ("embed", chunk("e150", 150)),
                   ("classify", chunk("c20", 20))]
        requests = [asyncio.ensure_future(batcher.submit(kind, c)) for kind, c in waiting]
        await asyncio.sleep(0)
        worker.gate.set()
        results = await asyncio.gather(first, *requests)
        return results, worker.batches

    results, batches = run(main())
    assert batches == [
        ("embed", ["x"]),
        ("embed", ["e30", "e50"]),  # e30b would pass the budget: it and every embed chunk after it wait their turn
        ("classify", ["c10", "c20"]),  # now the oldest chunk is c10
        ("embed", ["e30b", "e10"]),
        ("embed", ["e150"]),  # over the budget: alone
    ]
    assert results == ["embed:x", "embed:e30", "classify:c10", "embed:e50", "embed:e30b", "embed:e10", "embed:e150",
                       "classify:c20"]


def test_a_chunk_waits_for_others_as_long_as_it_was_told_or_until_the_budget_fills():
    async def main():
        worker = Worker()
        worker.gate.set()  # the worker answers at once
        batcher = Batcher(worker, budget=10)
        # Told to wait: the one submitted 20 ms later joins it.
        waiting = asyncio.ensure_future(batcher.submit("embed", chunk("a"), wait_s=5.0))
        await asyncio.sleep(0.02)
        start = time.monotonic()
        joined = asyncio.ensure_future(batcher.submit("embed", chunk("b", 9)))  # the budget is met: both go now
        await asyncio.gather(waiting, joined)
        filled_after = time.monotonic() - start
        # Not told to wait: it goes alone, and one submitted after it makes a batch of its own.
        alone = asyncio.ensure_future(batcher.submit("embed", chunk("c")))
        await asyncio.sleep(0.02)
        await asyncio.gather(alone, batcher.submit("embed", chunk("d")))
        return worker.batches, filled_after

    batches, filled_after = run(main())
    assert batches == [("embed", ["a", "b"]), ("embed", ["c"]), ("embed", ["d"])]
    assert filled_after < 2.5  # not the 5 s wait


def test_a_cancelled_request_drops_out_of_the_batch_it_waited_for():
    async def main():
        worker = Worker()
        batcher = Batcher(worker, budget=100)
        first = await worker.busy_with(batcher, chunk("a"))
        gone = asyncio.ensure_future(batcher.submit("embed", chunk("gone")))
        kept = asyncio.ensure_future(batcher.submit("embed", chunk("kept")))
        await asyncio.sleep(0)
        gone.cancel()
        worker.gate.set()
        return await asyncio.gather(first, kept), gone.cancelled(), worker.batches

    results, cancelled, batches = run(main())
    assert cancelled and results == ["embed:a", "embed:kept"]
    assert batches == [("embed", ["a"]), ("embed", ["kept"])]


def test_a_failed_batch_fails_its_requests_and_the_next_batch_runs():
    async def main():
        worker = Worker(fail_on="bad")
        batcher = Batcher(worker, budget=100)
        first = await worker.busy_with(batcher, chunk("a"))
        together = [asyncio.ensure_future(batcher.submit("embed", chunk(name))) for name in ("bad", "beside")]
        await asyncio.sleep(0)
        worker.gate.set()
        outcomes = await asyncio.gather(first, *together, return_exceptions=True)
        after = await batcher.submit("embed", chunk("after"))
        return outcomes, after

    outcomes, after = run(main())
    assert outcomes[0] == "embed:a"
    assert all(isinstance(error, ValueError) and "bad broke the model" in str(error) for error in outcomes[1:])
    assert after == "embed:after"


def test_a_run_that_answers_another_number_of_chunks_fails_the_batch():
    async def short(kind, chunks):
        return ["one"]

    async def main():
        batcher = Batcher(short, budget=10)
        return await asyncio.gather(*(batcher.submit("embed", chunk(name), wait_s=0.2) for name in "ab"),
                                    return_exceptions=True)

    outcomes = run(main())
    assert all(isinstance(error, RuntimeError) and "1 results for a batch of 2" in str(error) for error in outcomes)


def test_the_budget_and_the_event_loop_are_checked():
    with pytest.raises(ValueError, match="budget=0"):
        Batcher(Worker(), budget=0)
    batcher = Batcher(Worker(), budget=10)

    async def one():
        request = asyncio.ensure_future(batcher.submit("embed", chunk("a")))
        await asyncio.sleep(0)
        request.cancel()

    asyncio.run(one())
    with pytest.raises(RuntimeError, match="another event loop"):
        asyncio.run(batcher.submit("embed", chunk("b")))


def test_docstring_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", Batcher.__doc__, flags=re.DOTALL)
    test = doctest.DocTestParser().get_doctest("".join(blocks), {"Batcher": Batcher}, "Batcher", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert blocks and runner.summarize(verbose=False).failed == 0
