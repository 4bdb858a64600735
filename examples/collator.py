"""A masked-LM collator whose masks survive an interrupted and resumed training run."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from transformers import DataCollatorForLanguageModeling


class ResumableMLMCollator(DataCollatorForLanguageModeling):
    """`DataCollatorForLanguageModeling` whose random masks are a function of the seed and the batch content.

    The stock collator draws masks from the global RNG, which accelerate's dataloader advances one batch ahead of
    the training step; a run resumed from a checkpoint therefore masks differently from the uninterrupted run and
    ends at a different loss. Seeding each batch from (seed, its token ids) keeps masking dynamic (a text gets new
    masks whenever it lands in a different batch) and makes resumed runs reproduce uninterrupted ones exactly.

    Example:

    ```python
    >>> collator = ResumableMLMCollator(tokenizer, mlm_probability=0.15, seed=42)  # doctest: +SKIP
    ```
    """

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, seed=seed, **kwargs)

    def torch_call(self, examples):
        digest = hashlib.sha256(str(self.seed).encode())
        for example in examples:
            ids = example["input_ids"] if isinstance(example, Mapping) else example
            digest.update(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes())
            digest.update(b"|")
        self.generator = torch.Generator().manual_seed(int.from_bytes(digest.digest()[:8], "little") >> 1)
        return super().torch_call(examples)
