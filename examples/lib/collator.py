"""Masked-LM collators whose masks survive an interrupted and resumed training run, padded or packed."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening


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


class PackedMLMCollator:
    """Padding-free masked-LM batches: the examples of a batch back to back in one row.

    Each example is masked as `ResumableMLMCollator` masks it (a function of the seed and the batch, so resumed runs
    reproduce uninterrupted ones); transformers' `DataCollatorWithFlattening` then concatenates the examples, with
    position ids that restart at every example and their offsets as `cu_seq_lens_q`/`cu_seq_lens_k`, which
    roformer_hf reads to keep attention inside each example.
    """

    def __init__(self, tokenizer, mlm_probability: float = 0.15, seed: int = 0):
        self.masking = ResumableMLMCollator(tokenizer, mlm_probability=mlm_probability, seed=seed)
        self.flattening = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def __call__(self, examples):
        masked = self.masking(examples)  # padded (B, L): input_ids, attention_mask, labels
        real = masked["attention_mask"].bool()
        per_example = [{"input_ids": ids[keep].tolist(), "labels": labels[keep].tolist()}
                       for ids, labels, keep in zip(masked["input_ids"], masked["labels"], real)]
        # The flattening collator sets each example's first label to -100: the [CLS] token, never masked anyway.
        return self.flattening(per_example)
