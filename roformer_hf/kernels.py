"""Which attention functions a forward calls: `Kernel`, chosen once per forward by `choose_kernel`.

A leaf: the plan chooses here, `masks` renders the mask in the form the choice takes, `attention` holds the functions
(registered under the names below in transformers' `ALL_ATTENTION_FUNCTIONS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from transformers.utils.generic import is_flash_attention_requested
except ImportError:  # transformers releases before it: the same test

    def is_flash_attention_requested(requested_attention_implementation: str | None = None) -> bool:
        return "flash" in (requested_attention_implementation or "")

SDPA_VARLEN = "roformer_sdpa_varlen"
SDPA_DROPOUT = "roformer_sdpa_dropout"
CUDA_VARLEN = "roformer_cuda_varlen"


@dataclass(frozen=True)
class Kernel:
    """The attention functions of one forward, by name in transformers' `ALL_ATTENTION_FUNCTIONS`.

    Attributes:
        padded: the function on the padded layout ``(B, nh, L, d)``, with the mask's tensor.
        varlen: the function on the real tokens, sequence by sequence (flash-attn's varlen kernel; `SDPA_VARLEN` on
            CPU; `CUDA_VARLEN` for packed rows on CUDA); ``None`` where the implementation has none.
        takes_key_padding: the padded function takes the keys' padding ``(B, Lk)`` (flash-attn), not a dense mask.
        masks_causality: the varlen function applies causality as a mask it is given (attention dropout on CPU,
            whose blocked and math kernels have no ``is_causal``), not by itself.
    """

    padded: str
    varlen: str | None = None
    takes_key_padding: bool = False
    masks_causality: bool = False


def choose_kernel(implementation: str, device: torch.device | str | None = None, dropout: bool = False,
                  packed_rows: bool = False) -> Kernel:
    """The attention functions for ``config._attn_implementation`` (``"eager"`` when weights are returned) on
    `device`; `dropout`: attention dropout is on (training with ``attention_probs_dropout_prob > 0``), which SDPA's
    fused CPU kernel cannot apply (`SDPA_DROPOUT` applies it in blocks); `packed_rows`: rows hold several sequences.

    On CUDA, SDPA attends packed rows through `CUDA_VARLEN` (PyTorch's flash-attention varlen kernel), where its
    padded function would need a block-diagonal mask: on an H200 (bf16, base size, 32 sequences of 128 to 512 tokens
    in one row) that took the training step from 113k to 249k real tokens per second. Padded batches keep the padded
    function, whose eager training step there took 36 ms against 49 ms through `CUDA_VARLEN` on the same sequences
    (benchmarks/RESULTS.md)."""
    if is_flash_attention_requested(requested_attention_implementation=implementation):
        return Kernel(implementation, implementation, takes_key_padding=True)
    device_type = torch.device(device or "cpu").type
    if implementation == "sdpa" and device_type == "cpu":
        return Kernel(SDPA_DROPOUT if dropout else "sdpa", SDPA_VARLEN, masks_causality=dropout)
    if implementation == "sdpa" and device_type == "cuda" and packed_rows:
        return Kernel("sdpa", CUDA_VARLEN)
    return Kernel(implementation)
