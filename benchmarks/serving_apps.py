"""The applications `bench_serving.py` measures Ray Serve against, importable by Ray's workers and by uvicorn
(`uvicorn serving_apps:plain`, run from this folder):

- `Noop`, `BatchedNoop`: Ray Serve deployments behind FastAPI that answer a constant, without and with batching
  across requests as the server batches (`roformer_hf.serving.batching.Batcher`): the engine's own cost per request.
- `plain`: the same constant from a FastAPI app alone, for uvicorn.
- `sentence_transformers_app`: FastAPI calling `SentenceTransformer(folder).encode` once per request, the folder read
  from the `SERVING_FOLDER` environment variable (`SERVING_THREADS` torch threads).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from fastapi import FastAPI
from ray import serve

ANSWER = {"ok": True}
ONE_TOKEN = SimpleNamespace(tokens=1)  # what a no-op request costs a batch

plain = FastAPI()


@plain.post("/")
async def plain_answer() -> dict:
    return ANSWER


@plain.get("/health")
async def plain_health() -> dict:
    return ANSWER


noop_app, batched_app = FastAPI(), FastAPI()


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(noop_app)
class Noop:
    @noop_app.post("/")
    async def answer(self) -> dict:
        return ANSWER

    @noop_app.get("/health")
    async def health(self) -> dict:
        return ANSWER


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(batched_app)
class BatchedNoop:
    def __init__(self):
        from roformer_hf.serving.batching import Batcher

        self.batcher = Batcher(self.run, budget=64)

    async def run(self, kind: str, chunks: list) -> list[dict]:
        return [ANSWER] * len(chunks)

    @batched_app.post("/")
    async def answer(self) -> dict:
        return await self.batcher.submit("noop", ONE_TOKEN, wait_s=0.001)

    @batched_app.get("/health")
    async def health(self) -> dict:
        return ANSWER


def sentence_transformers_app() -> FastAPI:
    """`uvicorn serving_apps:sentence_transformers_app --factory`: one `encode` per request, on FastAPI's threads."""
    import torch
    from sentence_transformers import SentenceTransformer

    import roformer_hf  # noqa: F401  (registers the RoFormer classes the folder names)

    torch.set_num_threads(int(os.environ.get("SERVING_THREADS", "1")))
    model = SentenceTransformer(os.environ["SERVING_FOLDER"], device=os.environ.get("SERVING_DEVICE", "cpu"))
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return ANSWER

    @app.post("/v1/embeddings")
    def embeddings(body: dict) -> dict:
        vectors = model.encode(body["input"] if isinstance(body["input"], list) else [body["input"]])
        return {"data": [{"embedding": vector.tolist(), "index": i} for i, vector in enumerate(vectors)]}

    return app
