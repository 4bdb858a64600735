"""Small shared builders for the tests: tiny configs and transformers' RoFormer as the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

import roformer_hf

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def tiny_config(**overrides) -> roformer_hf.RoFormerConfig:
    return roformer_hf.RoFormerConfig(**{**TINY, **overrides})


def padded_batch(lengths: list[int], vocab_size: int = TINY["vocab_size"], seed: int = 0, left: bool = False):
    """Random ids (never the pad id 0) and the matching attention mask, right-padded unless `left`."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    ids = torch.randint(1, vocab_size, (len(lengths), seq_len), generator=gen)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, seq_len - n:] = 1
        else:
            mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def reference_and_ours(head: str, folder, **overrides):
    """transformers' RoFormer `head` with random weights, saved to `folder`, and roformer_hf's model loaded from
    that folder: the same weights in both implementations."""
    torch.manual_seed(0)
    reference = getattr(transformers, head)(transformers.RoFormerConfig(**{**TINY, **overrides})).eval()
    reference.save_pretrained(folder)
    ours = getattr(roformer_hf, head).from_pretrained(folder).eval()
    return reference, ours


def block_imports(*names: str) -> str:
    """Python source to put at the top of a subprocess script: there, the packages `names` behave as if they were not
    installed. `import name` (or of a submodule) raises ModuleNotFoundError and `importlib.util.find_spec(name)`
    returns None, which is what transformers' availability checks ask; a `None` entry in `sys.modules` does both."""
    return f"import sys\nsys.modules.update(dict.fromkeys({sorted(names)!r}))\n"


BLOCK_ROFORMER_HF = block_imports("roformer_hf")
"""Prepend to a subprocess script to simulate a machine where roformer_hf is not installed."""

PYTHON = sys.executable

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
"""The example scripts and their support modules; conftest.py puts this folder on sys.path."""
