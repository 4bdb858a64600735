"""The work a server runs on token ids, a list of inputs at a time: embed (sentences, or each token), classify (and
rerank, a classifier of one label on pairs), fill-mask, complete, similar. Each protocol turns its requests into
`Item`s; `Tasks.run` runs a list of items of one kind in as few forwards as their parameters allow, and a failing
input fails alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer

from .. import fused
from ..similarity import SeededSampling, embedder, generate_similar
from .errors import RowError
from .loaded import LoadedModel

KINDS = ("embed", "embed_tokens", "classify", "fill_mask", "complete", "similar")
# Real tokens per forward of an embedding batch. On one thread and on two (Intel Xeon), forwards of 1.5-2 thousand real
# tokens embedded 3-5% more sentences per second than `similarity.encode`'s 32 rows (~400 tokens of short sentences,
# ~4000 of passages) (benchmarks/RESULTS.md).
EMBED_TOKENS = 2048


@dataclass(frozen=True)
class Item:
    """One input of a request, as the task of its kind takes it: `key` holds the parameters the rows of one model
    call must share; `data` what differs per row (token ids, a seed); `tokens` what it costs a batch's token budget
    (for a completion, its prompt and the tokens it may generate)."""

    kind: str
    key: tuple
    data: Any
    tokens: int


@dataclass(frozen=True)
class Completion:
    """The `data` of a completion item: its prompt's ids, its sampling stream's seed, and where its tokens go as they
    are made (called on the model's thread), if anywhere."""

    prompt: list[int]
    seed: int
    sink: Callable[[int], None] | None = None


class Tasks:
    """The tasks of a `LoadedModel`, each on a list of rows; `beat` is when the model last made progress (a forward or
    a generation step ended), which a health check reads."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model, self.tokenizer, self.config = loaded.model, loaded.tokenizer, loaded.config
        self.embed_batch = embedder(self.model, loaded.pooling)
        # One input alone (a quiet server's request of one sentence) runs the compiled encoder, or a classifier's
        # compiled classifier, where the folder was loaded with `compile`: faster than the eager model for one row up
        # to the length this CPU kind's rule names (`_compiled_takes`), where batches are faster eager, which skips
        # their padding (benchmarks/RESULTS.md).
        self.embed_alone = self.classify_alone = None
        if loaded.compiled is not None and loaded.is_classifier:
            self.classify_alone = loaded.compiled
        elif loaded.compiled is not None:
            self.embed_alone = embedder(self.model, loaded.pooling, _one_input(loaded.compiled))
        self.beat = time.monotonic()

    def run(self, items: list[Item]) -> list:
        """The results of items of one kind, in order; items run together only where their `key` is equal. Where a
        group fails, its rows run alone, so that an input that breaks the model fails alone: its result is the
        `RowError`."""
        results: list = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(item.key, []).append(i)
        for key, rows in groups.items():
            task = getattr(self, items[rows[0]].kind)
            try:
                outputs = task([items[i].data for i in rows], *key)
            except Exception as error:  # noqa: BLE001 - each row again alone, below
                if len(rows) == 1:
                    outputs = [_row_error(error)]
                else:
                    outputs = [self._alone(task, items[i].data, key) for i in rows]
            for row, output in zip(rows, outputs):
                results[row] = output
            self.beat = time.monotonic()
        return results

    @staticmethod
    def _alone(task, data, key):
        try:
            return task([data], *key)[0]
        except Exception as error:  # noqa: BLE001 - the row's own failure, answered to its request
            return _row_error(error)

    def _pad(self, rows: list[dict[str, list[int]]] | list[list[int]], side: str) -> dict[str, torch.Tensor]:
        features = [row if isinstance(row, dict) else {"input_ids": row} for row in rows]
        return self.tokenizer.pad(features, return_tensors="pt", padding_side=side).to(self.loaded.device).data

    def _compiled_takes(self, ids: list[int], token_types: list[int] | None = None) -> bool:
        """Whether the compiled graph takes this one input: a length it was compiled for, no longer than this CPU
        kind's rule sends to it (`fused.DenseRule.compiled_max_tokens`: beyond, the eager model is the faster), and ids
        and token types the model has embeddings for (the eager model refuses others by name; the compiled one stops at
        its bounds check with inductor's message)."""
        longest = min(self.loaded.max_length, fused.RULE.compiled_max_tokens)
        return (2 <= len(ids) <= longest and min(ids) >= 0 and max(ids) < self.config.vocab_size
                and (not token_types or min(token_types) >= 0 and max(token_types) < self.config.type_vocab_size))

    @torch.no_grad()
    def embed(self, ids: list[list[int]]) -> list[torch.Tensor | RowError]:
        """The sentence embeddings `(H,)` of token-id rows, not normalized: sorted by length, as `encode` does (rows of
        one length need no per-sequence attention), and run about `EMBED_TOKENS` real tokens at a time."""
        vectors: list = [None] * len(ids)
        for rows, padded in self._embedding_batches(ids):
            if len(rows) == 1 and self.embed_alone is not None and self._compiled_takes(ids[rows[0]]):
                batch = self.embed_alone(padded)  # one input the compiled encoder takes
            else:
                batch = self.embed_batch(padded)
            batch = batch.float().cpu()
            for row, vector in zip(rows, batch):
                vectors[row] = _finite(vector, "embedding")
        return vectors

    @torch.no_grad()
    def embed_tokens(self, ids: list[list[int]]) -> list[torch.Tensor | RowError]:
        """Each token's embedding, `(L, H)` for a row of `L` ids, special tokens included: the encoder's last hidden
        state (`model.base_model`), batched as `embed` batches."""
        states: list = [None] * len(ids)
        for rows, padded in self._embedding_batches(ids):
            batch = self.model.base_model(**padded, use_cache=False).last_hidden_state.float().cpu()
            for row, state in zip(rows, batch):
                states[row] = _finite(state[:len(ids[row])], "token embeddings")
        return states

    def _embedding_batches(self, ids: list[list[int]]):
        """The rows' indices, longest first, in runs of about `EMBED_TOKENS` real tokens, each with its padded batch."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        for rows in by_tokens(order, [len(row) for row in ids], EMBED_TOKENS):
            yield rows, self._pad([ids[i] for i in rows], "right")

    @torch.no_grad()
    def classify(self, rows: list[dict[str, list[int]]]) -> list[torch.Tensor | RowError]:
        """The logits `(num_labels,)` of each row (`input_ids`, and `token_type_ids` for a pair)."""
        if len(rows) == 1 and self.classify_alone is not None and \
                self._compiled_takes(rows[0]["input_ids"], rows[0].get("token_type_ids")):
            row = {name: torch.tensor([values], device=self.loaded.device) for name, values in rows[0].items()}
            logits = self.classify_alone(row["input_ids"], row.get("token_type_ids")).logits.float().cpu()
        else:
            logits = self.model(**self._pad(rows, "right")).logits.float().cpu()
        return [_finite(row, "logits") for row in logits]

    @torch.no_grad()
    def fill_mask(self, ids: list[list[int]], top_k: int) -> list[list | RowError]:
        """The fill-mask pipeline's answer for each row: `top_k` predictions, per mask where it holds several."""
        logits = self.model(**self._pad(ids, "right")).logits.float().cpu()
        mask = self.tokenizer.mask_token_id
        results = []
        for row, row_logits in zip(ids, logits):
            where = [i for i, token in enumerate(row) if token == mask]
            if not torch.isfinite(row_logits[where]).all():
                results.append(_finite(row_logits[where], "logits"))
                continue
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
    def complete(self, rows: list[Completion], max_tokens: int, temperature: float, top_p: float) -> list[list[int]]:
        """The generated tokens of each row, up to the end-of-sequence token (excluded): greedy at temperature 0, else
        sampled from the row's own seeded stream, so a row gives what it gives alone. A row's `sink` gets each of its
        tokens as it is made."""
        batch = self._pad([row.prompt for row in rows], "left")
        processors = LogitsProcessorList()
        if temperature > 0:
            generators = [torch.Generator(self.loaded.device).manual_seed(row.seed) for row in rows]
            processors += [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p),
                           SeededSampling(generators, 1)]
        eos = self.loaded.eos_token_id
        ends = {eos} if isinstance(eos, int) else set(eos)
        streamer = _Sinks(rows, ends, self)
        output = self.model.generate(**batch, logits_processor=processors, do_sample=False, num_beams=1,
                                     max_new_tokens=max_tokens, eos_token_id=eos, streamer=streamer,
                                     pad_token_id=self.tokenizer.pad_token_id)
        generated = []
        for row in output[:, batch["input_ids"].shape[1]:].tolist():
            stop = next((i for i, token in enumerate(row) if token in ends), len(row))
            generated.append(row[:stop])
        return generated

    def similar(self, sentences: list[str], n: int, seed: int, top_p: float, temperature: float,
                max_new_tokens: int) -> list:
        """`generate_similar` of the sentences: seeded per sentence, so a batch gives what each gives alone."""
        return generate_similar(self.model, self.tokenizer, sentences, n, seed=seed, top_p=top_p,
                                temperature=temperature, max_new_tokens=max_new_tokens, pooling=self.loaded.pooling)


class _Sinks(BaseStreamer):
    """transformers' streamer hook of `generate`, for a batch: hands each row's new token to the row's sink until the
    row ends, and marks the model's progress at every step."""

    def __init__(self, rows: list[Completion], ends: set[int], tasks: Tasks):
        self.sinks = [row.sink for row in rows]
        self.ends, self.tasks = ends, tasks
        self.done = [False] * len(rows)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands over the prompt first
            self.prompt_seen = True
            return
        self.tasks.beat = time.monotonic()
        for i, token in enumerate(value.reshape(-1).tolist()):
            if self.done[i]:
                continue
            if token in self.ends:
                self.done[i] = True
            elif self.sinks[i] is not None:
                self.sinks[i](token)

    def end(self) -> None:
        pass


def _one_input(encoder: Callable[..., Any]) -> Callable[..., Any]:
    """`encoder` (`LoadedModel.compiled`: the ids of one input, no mask) as `embedder` calls the encoder: one input has
    no padding, so its mask is all ones and the compiled graph depends on no mask's values."""

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, use_cache: bool = False):
        return encoder(input_ids=input_ids)

    return run


def by_tokens(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`order` cut into consecutive runs of at most `budget` tokens (`lengths[i]` each); a row longer than the budget
    goes alone."""
    runs, run, tokens = [], [], 0
    for i in order:
        if run and tokens + lengths[i] > budget:
            runs.append(run)
            run, tokens = [], 0
        run.append(i)
        tokens += lengths[i]
    return runs + [run] if run else runs


def _finite(values: torch.Tensor, what: str) -> torch.Tensor | RowError:
    """`values`, or the row's error where the model gave NaN or infinity: JSON has no such numbers, and orjson would
    write them as null."""
    if not torch.isfinite(values).all():
        return RowError(f"the model's {what} for this input hold NaN or infinite values: the weights or the dtype are "
                        "broken")
    return values


def _row_error(error: Exception) -> RowError:
    return error if isinstance(error, RowError) else RowError(f"{type(error).__name__}: {error}")


__all__ = ["Completion", "EMBED_TOKENS", "Item", "KINDS", "Tasks", "by_tokens"]
