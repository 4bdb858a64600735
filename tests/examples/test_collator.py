"""examples/lib/collator.py's ResumableMLMCollator: masks are a pure function of (seed, batch), and still vary across
batches."""

import torch
from helpers import WORDS
from lib.collator import ResumableMLMCollator

from roformer_hf import RoFormerHFTokenizer


def _tokenizer(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return RoFormerHFTokenizer.from_pretrained(tmp_path)


def test_masks_depend_only_on_seed_and_batch(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    texts = [" ".join(WORDS[i:] + WORDS[:i]) * 3 for i in range(6)]
    examples = [tokenizer(t) for t in texts]
    collator = ResumableMLMCollator(tokenizer, mlm_probability=0.3, seed=1)
    first = collator(examples[:3])
    torch.rand(100)  # global RNG use in between must not matter
    again = ResumableMLMCollator(tokenizer, mlm_probability=0.3, seed=1)(examples[:3])
    assert torch.equal(first["input_ids"], again["input_ids"]) and torch.equal(first["labels"], again["labels"])
    masked = first["labels"] != -100
    assert 0 < masked.float().mean() < 0.6  # really masks, at roughly the requested rate
    other_seed = ResumableMLMCollator(tokenizer, mlm_probability=0.3, seed=2)(examples[:3])
    other_batch = collator([examples[0], examples[4], examples[5]])
    assert not torch.equal(other_seed["labels"], first["labels"])
    assert not torch.equal(other_batch["labels"][0], first["labels"][0])  # same text, new batch, new masks
