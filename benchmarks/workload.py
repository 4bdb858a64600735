"""The benchmark workload shared by `bench_cpu.py`, `bench_gpu.py`, `profile_cpu.py` and the other timing scripts:
their command line (`timing_parser`, `parse_args`), model size, the padded batch, the two RoFormers loaded from one
checkpoint and the two steps timed, and the analytic FLOP count on real tokens.

Defaults are the CPU targets: base width (hidden 768, 12 heads, intermediate 3072), 4 layers, a vocabulary of
12000 (roformer_chinese_char_small's size), and 8 sequences of 512/480/400/350/300/256/200/128 tokens right-padded
to 512 (2626 real tokens of 4096, 64%).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# Benchmark the checkout this file sits in, not whatever roformer_hf happens to be installed.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --dtype of the CPU scripts
TARGET_LENGTHS = (512, 480, 400, 350, 300, 256, 200, 128)
QUICK = {"layers": 2, "hidden": 64, "heads": 4, "intermediate": 256, "vocab": 1000,
         "lengths": (64, 60, 50, 40, 32, 16), "memory_length": 256, "repeats": 3, "warmup": 1}


@dataclass
class Size:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The model-size and batch flags every timing script takes (defaults: the CPU targets)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=12000,
                        help="vocabulary size (default 12000, as roformer_chinese_char_small)")
    parser.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=TARGET_LENGTHS,
                        help="comma-separated sequence lengths of the padded batch")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke configuration (seconds); flags given explicitly still apply")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="make glibc keep freed memory for reuse, as jemalloc/tcmalloc do (see keep_freed_memory)")


def timing_parser(description: str, *, repeats: int, warmup: int, timed: str | None = None) -> argparse.ArgumentParser:
    """A timing script's parser: its `description` as written, the size flags (`add_size_arguments`), then
    `--repeats` timed and `--warmup` untimed runs of each thing it times, which `timed` names in the help
    ("forwards per path")."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.add_argument("--repeats", type=int, default=repeats, help=timed and f"timed {timed}")
    parser.add_argument("--warmup", type=int, default=warmup, help=timed and f"untimed {timed} first")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None, **quick_defaults) -> argparse.Namespace:
    """Parses the command line; with `--quick` the QUICK values, updated by `quick_defaults` (a script's own flags),
    become the defaults (flags given still win)."""
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**{name: value for name, value in {**QUICK, **quick_defaults}.items()
                               if any(action.dest == name for action in parser._actions)})
    return parser.parse_args(argv)


def size_of(args: argparse.Namespace) -> Size:
    return Size(args.layers, args.hidden, args.heads, args.intermediate, args.vocab)


def transformers_config(size: Size, max_positions: int):
    """transformers' RoFormerConfig with dropout off (outputs must match) and eager attention (its only kernel).

    transformers' RoFormer looks positions up in a sinusoidal table of `max_position_embeddings` rows, so it cannot
    run longer sequences than that; the table is computed, not learned, so its size changes no output.
    """
    from transformers import RoFormerConfig

    return RoFormerConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.intermediate, max_position_embeddings=max_positions,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )


def padded_batch(lengths: tuple[int, ...], vocab: int, seed: int, mlm_fraction: float = 0.15):
    """Random ids right-padded to the longest length, the attention mask, and MLM labels on ~15% of the real
    tokens (-100 elsewhere, padding included). Returns `(input_ids, attention_mask, labels)`, each `(B, L)`."""
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = len(lengths), max(lengths)
    attention_mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    input_ids = torch.randint(5, vocab, (batch, seq_len), generator=generator) * attention_mask  # pad id 0
    labelled = (torch.rand(batch, seq_len, generator=generator) < mlm_fraction) & attention_mask.bool()
    labels = torch.where(labelled, input_ids, torch.full_like(input_ids, -100))
    return input_ids, attention_mask, labels


def load_model(side: str, folder: str, attn: str = "sdpa", sparse_prediction: bool = True, **load_kwargs):
    """One of the two models from the same checkpoint folder (written by transformers' RoFormer); `load_kwargs`
    go to `from_pretrained` (e.g. `dtype`).

    roformer_hf runs its MLM head only on the labelled tokens during training (`sparse_prediction`, as
    ModernBERT does) unless told otherwise; the loss and gradients are the same (bench_cpu.py checks it)."""
    if side == "transformers":
        from transformers import RoFormerForMaskedLM
        return RoFormerForMaskedLM.from_pretrained(folder, attn_implementation="eager", **load_kwargs)
    import roformer_hf
    model, info = roformer_hf.RoFormerForMaskedLM.from_pretrained(folder, attn_implementation=attn,
                                                                  sparse_prediction=sparse_prediction,
                                                                  output_loading_info=True, **load_kwargs)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"roformer_hf did not load every weight of the checkpoint: {info}")
    return model


def infer(model, batch) -> torch.Tensor:
    input_ids, attention_mask, _ = batch
    with torch.inference_mode():
        return model(input_ids, attention_mask=attention_mask).logits


def train_step(model, batch) -> torch.Tensor:
    input_ids, attention_mask, labels = batch
    loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    return loss.detach()


def forward_flops(size: Size, lengths: tuple[int, ...]) -> dict[str, float]:
    """Multiply-add FLOPs (2 per MAC) of one forward on the real tokens only, by part.

    Counted: the q/k/v/output projections, the feed-forward, attention scores and weighted values over each
    sequence's own length, and the MLM head (transform dense and the vocabulary decoder) on every real token,
    since the forward returns logits for every token (training could stop at the labelled ~15%, see the
    "decoder" line). Not counted: embeddings, LayerNorm, GELU, softmax, rotary and the biases (all O(N*H), a
    few percent of the total at base width).
    """
    tokens = sum(lengths)
    h, i, v = size.hidden, size.intermediate, size.vocab
    per_layer_linear = 2 * tokens * (4 * h * h + 2 * h * i)
    per_layer_attention = sum(4 * n * n * h for n in lengths)  # QK^T and PV
    return {
        "linear": size.layers * per_layer_linear,
        "attention": size.layers * per_layer_attention,
        "head transform": 2 * tokens * h * h,
        "decoder": 2 * tokens * h * v,
    }


def sparse_head_forward_flops(flops: dict[str, float], tokens: int, labelled: int, size: Size | None = None) -> float:
    """Total of `forward_flops` when the MLM head (transform and decoder) runs on the `labelled` tokens only, of
    `tokens` real ones: what a training forward with sparse prediction computes (roformer_hf, ModernBERT).

    With `size`, the last layer's queries are the labelled tokens only as well, as roformer_hf's last layer computes
    when its attention kernel has a varlen form (SDPA on CPU, flash-attn): its query projection, attention, output
    projection and feed-forward run on those tokens, its key and value projections on all. The labelled tokens are
    taken as spread evenly over the sequences (the attention part)."""
    head = flops["head transform"] + flops["decoder"]
    total = sum(flops.values()) - head + head * labelled / tokens
    if size is not None:
        unread = tokens - labelled
        total -= 2 * unread * (2 * size.hidden * size.hidden + 2 * size.hidden * size.intermediate)
        total -= flops["attention"] / size.layers * unread / tokens
    return total


def keep_freed_memory() -> None:
    """Makes glibc's malloc keep freed memory for the next allocation instead of handing it back to the OS.

    By default glibc serves allocations above 32 MiB (here: the logits, the feed-forward activations) with fresh
    `mmap`s and trims freed heap memory, so every forward page-faults its large tensors in again, 4 KiB at a
    time; in a VM that costs about 1 us per page. Allocators such as jemalloc or tcmalloc (which PyTorch's CPU
    tuning guides recommend) keep that memory instead. Raising the mmap and trim thresholds does the same for
    this whole process, for both models alike. Linux with glibc only.
    """
    import ctypes

    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1)):
        raise RuntimeError("glibc refused mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD)")


def allocator_line(args: argparse.Namespace) -> str:
    if args.keep_freed_memory:
        return "glibc malloc keeping freed memory (--keep-freed-memory): large tensors reuse pages, few page faults"
    return "glibc malloc, default settings: large tensors get fresh pages and page-fault them in on every call"
