"""A saved folder, loaded once for serving: the head its config names, the tokenizer, and what the folder says about
its sentence embedding (pooling, normalization, Matryoshka sizes, prompts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..configuration import RoFormerConfig
from ..modeling import HEADS, RoFormerForCausalLM, RoFormerForMaskedLM, RoFormerForSequenceClassification
from ..quantization import quantize_int8
from ..sentence import (
    MODULES_FILE,
    folder_pooling,
    is_roformer_sim,
    sentence_dimensions,
    sentence_normalize,
    sentence_pooling,
    sentence_prompts,
)

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


class LoadedModel:
    """The model of a saved folder and the facts the protocols read about it.

    Args:
        folder: written by `save_pretrained`, the converter or sentence-transformers; it must hold a tokenizer.
        int8: quantize the linear layers (`roformer_hf.quantization.quantize_int8`; CPU only); as saved otherwise.
        device: where the model runs, `"cpu"` or a CUDA device (`"cuda"`, `"cuda:1"`).
        name: the name clients give as `model` (default: the folder's name).
        compile: also hold the encoder compiled for one input at a time (`compiled`; see `compile_refusal` for where
            it applies); it compiles on its first call, which `tasks.Tasks` makes at once.
    """

    def __init__(self, folder: str | os.PathLike, *, int8: bool = False, device: str = "cpu",
                 name: str | None = None, compile: bool = False):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise ValueError(f"folder={str(folder)!r}: expected a saved model folder (with config.json)")
        if not any((self.folder / file).is_file() for file in TOKENIZER_FILES):
            raise ValueError(f"folder={str(folder)!r} holds no tokenizer (expected one of {TOKENIZER_FILES}): save it "
                             "beside the model with tokenizer.save_pretrained(folder)")
        self.device = _device(device)
        if int8 and self.device.type != "cpu":
            raise ValueError(f"int8=True with device={device!r}: the int8 layers run on the CPU only")
        refusal = compile_refusal(compile, int8, device)
        if refusal is not None:
            raise ValueError(refusal)
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ValueError(f"name={name!r}: expected a non-empty string")
        self.name = name or self.folder.resolve().name
        config = RoFormerConfig.from_pretrained(self.folder)
        heads = {head.model_class.__name__: head.model_class for head in HEADS}
        names = config.architectures or ["RoFormerModel"]
        if names[0] not in heads:
            raise ValueError(f"{self.folder / 'config.json'}: architectures={names!r}, expected one of "
                             f"{sorted(heads)}")
        self.model = heads[names[0]].from_pretrained(self.folder).eval().to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.dtype = "int8" if int8 else str(self.model.dtype).removeprefix("torch.")
        if int8:
            quantize_int8(self.model)
        # Dynamic shapes: a new length compiles nothing new. One input has no padding, so the graph runs without a
        # mask and nothing in it depends on the mask's values (one graph, no host sync).
        self.compiled = torch.compile(self.model.base_model, dynamic=True) if compile else None
        self.config = self.model.config
        limit = self.tokenizer.model_max_length
        self.max_length = limit if limit < 10**9 else self.config.max_position_embeddings

        found = folder_pooling(self.folder)
        if found is not None and not isinstance(found[0], str):
            raise ValueError(f"{self.folder / MODULES_FILE}: its Pooling module concatenates {found[0]}: expected one "
                             "pooling")
        self.pooling = found[0] if found is not None else sentence_pooling(self.config)
        self.normalize = self._folder_normalizes() if found is not None else sentence_normalize(self.config)
        self.dimensions = sentence_dimensions(self.config)
        self.prompts, self.default_prompt_name = sentence_prompts(self.folder)
        generation = getattr(self.model, "generation_config", None)
        eos = generation.eos_token_id if generation is not None else None
        self.eos_token_id = eos if eos is not None else self.tokenizer.sep_token_id  # [SEP] ends a sentence

    def _folder_normalizes(self) -> bool:
        modules = json.loads((self.folder / MODULES_FILE).read_text(encoding="utf-8"))
        return any(str(module.get("type", "")).endswith("Normalize") for module in modules)

    @property
    def is_classifier(self) -> bool:
        return isinstance(self.model, RoFormerForSequenceClassification)

    @property
    def is_reranker(self) -> bool:
        """A cross-encoder: a sequence classifier of one label, scoring a (query, text) pair."""
        return self.is_classifier and self.config.num_labels == 1

    @property
    def is_masked_lm(self) -> bool:
        return isinstance(self.model, RoFormerForMaskedLM)

    @property
    def is_causal_lm(self) -> bool:
        return isinstance(self.model, RoFormerForCausalLM)

    @property
    def is_sim(self) -> bool:
        return self.is_causal_lm and is_roformer_sim(self.config)

    def describe(self) -> str:
        compiled = ", one input at a time compiled" if self.compiled is not None else ""
        return f"{self.folder} as {self.name!r} ({type(self.model).__name__}, {self.dtype}, {self.device}{compiled})"


def compile_refusal(compile: bool, int8: bool, device: str) -> str | None:
    """Why `compile` cannot apply with these settings, or None: the compiled encoder is inductor's CPU graph with
    frozen weights and its C++ wrapper (fp32 or bf16 as saved); `quantize_int8`'s layers do not compile into one
    graph (for compiled int8, quantize statically: docs/quantization.md)."""
    if not compile:
        return None
    if str(device).split(":")[0] != "cpu":
        return (f"compile=True with device={device!r}: the compiled encoder is inductor's CPU graph; expected "
                "device='cpu'")
    if int8:
        return ("compile=True with int8=True: quantize_int8's layers do not compile into one graph; expected one of "
                "them (for a compiled int8 model, quantize statically: docs/quantization.md)")
    if not hasattr(torch.compiler, "set_stance"):  # what keeps a request from compiling
        return f"compile=True with torch {torch.__version__}: expected torch 2.6 or later (torch.compiler.set_stance)"
    return None


def _device(device: str) -> torch.device:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r}: expected 'cpu' or a CUDA device such as 'cuda' or 'cuda:0'") from error
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0 or (parsed.index or 0) >= count:
            raise ValueError(f"device={device!r}: this machine has {count} CUDA devices: expected 'cpu' or one of them")
    elif parsed.type != "cpu":
        raise ValueError(f"device={device!r}: expected 'cpu' or a CUDA device such as 'cuda' or 'cuda:0'")
    return parsed


__all__ = ["LoadedModel", "TOKENIZER_FILES", "compile_refusal"]
