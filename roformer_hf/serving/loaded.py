"""A saved folder, loaded once for serving: the head its config names, the tokenizer, and what the folder says about
its sentence embedding (pooling, normalization, Matryoshka sizes, prompts)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from packaging.version import Version
from torch import nn
from transformers import AutoTokenizer

from .. import fused
from ..configuration import RoFormerConfig
from ..modeling import HEADS, RoFormerForCausalLM, RoFormerForMaskedLM, RoFormerForSequenceClassification
from ..quantization import _cpu_has_vnni, quantize_int8, static_int8
from ..sentence import (
    MODULES_FILE,
    folder_pooling,
    is_roformer_sim,
    sentence_dimensions,
    sentence_normalize,
    sentence_pooling,
    sentence_prompts,
)
from .compiled import (
    PROBE_TEXT,
    CompiledClassifier,
    CompiledEncoder,
    CompiledPackage,
    OneClassifierInput,
    OneInput,
    cache_key,
    compiled_package,
    default_compile_cache,
)

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
# How close the compiled encoder must answer the probe input to the eager model, for each token (and the pooler's
# output): in fp32 within rounding; in bf16 and int8 within their rounding and quantization, where another model's
# package lands far off.
PROBE_COSINE_FP32, PROBE_COSINE = 0.9999, 0.95
PROBE_NORM = 0.1  # bf16 and int8: each vector's length within this fraction of the eager one's
# A classifier's logits, each within this fraction of the largest (or of 1): fp32, then bf16 and int8, whose static
# quantization moved a small random model's logits by up to 0.1 on a scale of 1.3
PROBE_LOGITS_FP32, PROBE_LOGITS = 1e-3, 0.25


logger = logging.getLogger(__name__)


class LoadedModel:
    """The model of a saved folder and the facts the protocols read about it.

    Args:
        folder: written by `save_pretrained`, the converter or sentence-transformers; it must hold a tokenizer.
        int8: quantize the linear layers (`roformer_hf.quantization.quantize_int8`; CPU only); as saved otherwise.
        device: where the model runs, `"cpu"` or a CUDA device (`"cuda"`, `"cuda:1"`).
        name: the name clients give as `model` (default: the folder's name).
        compile: also hold the encoder compiled ahead of time for one input at a time (`compiled`, a
            `compiled.CompiledEncoder` called with the ids ``(1, L)`` of one input, ``2 <= L <= max_length``; see
            `compile_refusal` for where it applies), compiled here or loaded from `compile_cache`; for a sequence
            classifier, the classifier itself (a `compiled.CompiledClassifier`, called with the ids and the token
            types of one input or pair), since its routes return logits. With `int8`, the compiled graph is quantized
            statically (`quantization.static_int8`), the eager model by `quantize_int8`.
        calibration: with `int8` and `compile`, and only then: a UTF-8 text file of inputs like those the server
            will embed or classify, one per line (`read_calibration`; `calibration_rows`: a classifier's also in
            pairs), run through the encoder (or classifier) to fix the compiled int8 graph's activation scales.
        compile_cache: with `compile`: the folder where compiled packages are kept between starts (default
            `compiled.default_compile_cache()`), each under a key of all it depends on (`compiled.cache_key`).
    """

    def __init__(self, folder: str | os.PathLike, *, int8: bool = False, device: str = "cpu",
                 name: str | None = None, compile: bool = False, calibration: str | os.PathLike | None = None,
                 compile_cache: str | os.PathLike | None = None):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise ValueError(f"folder={str(folder)!r}: expected a saved model folder (with config.json)")
        if not any((self.folder / file).is_file() for file in TOKENIZER_FILES):
            raise ValueError(f"folder={str(folder)!r} holds no tokenizer (expected one of {TOKENIZER_FILES}): save it "
                             "beside the model with tokenizer.save_pretrained(folder)")
        self.device = _device(device)
        if int8 and self.device.type != "cpu":
            raise ValueError(f"int8=True with device={device!r}: the int8 layers run on the CPU only")
        refusal = compile_refusal(compile, int8, device, calibration, compile_cache)
        if refusal is not None:
            raise ValueError(refusal)
        texts = read_calibration(calibration) if calibration is not None else None
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

        self.compiled, self.calibrated_on = None, 0
        if (caution := compile_caution(compile, int8)) is not None:
            logger.warning("%s", caution)
        if compile:  # from the model as saved, before the eager model's layers are swapped for int8 ones
            cache = default_compile_cache() if compile_cache is None else Path(compile_cache).expanduser()
            self.compiled = self._compiled(texts, cache)
        if int8:
            quantize_int8(self.model)

    def _compiled(self, texts: list[str] | None, cache: Path | None) -> CompiledPackage:
        """The encoder for one input (a sequence classifier: the classifier), compiled (`compiled.compiled_package`):
        as saved, or with calibration `texts` quantized statically (`calibration_rows`). It must answer a probe input
        as the eager model does (`probe_agrees`; a classifier's logits: `logits_agree`)."""
        classifier = self.is_classifier
        module = (OneClassifierInput(self.model) if classifier else OneInput(self.model.base_model)).eval()
        kind = CompiledClassifier if classifier else CompiledEncoder
        what = kind.what
        calibration = []
        if texts is not None:  # an embedding's default prompt before each, as a request without `prompt_name` gets it
            prompt = self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name and not classifier \
                else ""
            rows = calibration_rows(self.tokenizer, [prompt + text for text in texts], self.max_length, classifier)
            calibration = calibration_batches(rows, CALIBRATION_TOKENS)
            if not calibration:
                raise ValueError(f"calibration: none of its {len(texts)} inputs is 2 tokens long or more, the "
                                 f"shortest input the compiled {what} takes; expected inputs like those the server "
                                 f"will {'classify' if classifier else 'embed'}")
            self.calibrated_on = sum(len(batch["input_ids"]) for batch in calibration)
        # The probe: one input like those served (int8: a calibration input, within the range it calibrated); a
        # classifier's, a pair (both token types).
        if calibration:
            row = calibration_probe(calibration)
            probe = tuple(row[name] for name in kind.inputs)
        else:
            encoded = self.tokenizer([PROBE_TEXT], *([[PROBE_TEXT]] if classifier else []), truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
            encoded.setdefault("token_type_ids", torch.zeros_like(encoded["input_ids"]))
            probe = tuple(encoded[name] for name in kind.inputs)
        probe = tuple(tensor.to(self.device) for tensor in probe)
        with torch.no_grad():
            expected = [output.float() for output in module(*probe)]
        names = ("logits",) if classifier else ("last hidden states", "pooler output")
        fp32 = self.dtype == "float32"

        def check(compiled: CompiledPackage) -> None:
            with torch.no_grad():
                got = [output.float() for output in compiled.outputs(*probe)]
            where = compiled.path if compiled.loaded else "compiled now"
            shapes = [tuple(output.shape) for output in got]
            if shapes != [tuple(output.shape) for output in expected]:
                raise RuntimeError(f"compile=True: the compiled {what} ({where}) answers a probe input with outputs "
                                   f"of shapes {shapes}; expected the eager model's "
                                   f"{[tuple(output.shape) for output in expected]}")
            for name, have, want in zip(names, got, expected):
                if logits_agree(have, want, fp32) if classifier else probe_agrees(have, want, fp32):
                    continue
                cosine = torch.cosine_similarity(have, want, dim=-1).min().item()
                raise RuntimeError(
                    f"compile=True: the compiled {what} ({where}) answers a probe input unlike the eager model: its "
                    f"{name} differ by up to {(have - want).abs().max().item():.3g}"
                    + ("" if classifier else f", lowest cosine {cosine:.6f}") + "; expected "
                    + (_LOGITS_EXPECTED[fp32] if classifier else _PROBE_EXPECTED[fp32])
                    + ("" if fp32 else f" ({self.dtype})")
                    + ("; with int8, a calibration file of inputs like those served, or int8 without compile"
                       if calibration else ""))

        def build() -> nn.Module:
            return static_int8_encoder(module, calibration, self.max_length) if calibration else module

        factors = cache_key(self.model if classifier else self.model.base_model, self.dtype, self.max_length,
                            calibration)
        return compiled_package(build, probe, self.max_length, factors, check, cache, kind)

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
        longest = min(self.max_length, fused.RULE.compiled_max_tokens)
        compiled = f", one input of at most {longest:.0f} tokens at a time compiled" if self.compiled is not None else ""
        if self.calibrated_on:
            compiled += f" (int8 static, calibrated on {self.calibrated_on} inputs)"
        if self.compiled is not None and self.compiled.path is None:
            compiled += ", not saved"
        elif self.compiled is not None:
            compiled += f", {'loaded from' if self.compiled.loaded else 'saved to'} {self.compiled.path}"
        return f"{self.folder} as {self.name!r} ({type(self.model).__name__}, {self.dtype}, {self.device}{compiled})"


def compile_refusal(compile: bool, int8: bool, device: str, calibration: str | os.PathLike | None = None,
                    compile_cache: str | os.PathLike | None = None) -> str | None:
    """Why `compile` (and `calibration`, `compile_cache`) cannot apply with these settings, or None: the compiled
    encoder (or classifier) is AOTInductor's CPU package with frozen weights, as saved (fp32 or bf16) or, with `int8`,
    quantized statically with torchao, its activations' scales from the `calibration` file (`quantize_int8`'s layers
    do not compile into one graph)."""
    if calibration is not None and not (compile and int8):
        return (f"calibration={str(calibration)!r} with compile={compile} and int8={int8}: the calibration fixes the "
                "activation scales of the compiled int8 graph; expected it with compile=True and int8=True only")
    if compile_cache is not None and not compile:
        return (f"compile_cache={str(compile_cache)!r} with compile=False: the folder keeps compiled packages; "
                "expected it with compile=True only")
    if not compile:
        return None
    if str(device).split(":")[0] != "cpu":
        return (f"compile=True with device={device!r}: the compiled graph is inductor's CPU code; expected "
                "device='cpu'")
    if Version(torch.__version__).release < (2, 6):  # 2.5's aoti_compile_and_package takes other arguments
        return f"compile=True with torch {torch.__version__}: expected torch 2.6 or later (AOTInductor's packages)"
    if int8 and calibration is None:
        return ("compile=True with int8=True and no calibration: the compiled int8 graph is quantized statically, "
                "its activations' scales fixed ahead of time; expected calibration=FILE, a text file of inputs like "
                "those the server will embed or classify, one per line")
    if int8 and importlib.util.find_spec("torchao") is None:
        return ("compile=True with int8=True: the static quantization is torchao's, which is not installed; expected "
                "pip install roformer_hf[quantization]")
    return None


def compile_caution(compile: bool, int8: bool) -> str | None:
    """Why `compile` with `int8` runs, but slower than the eager int8 layers, on this CPU; None elsewhere. Without VNNI
    (an AMD EPYC with AVX2 only, or oneDNN held below it) the static graph's int8 GEMMs take oneDNN's kernel without
    VNNI, where the eager layers take fbgemm's: one 16-token sentence, 4 layers of base width, took 1.16-1.17x the
    eager int8 time compiled on an AVX2 EPYC (benchmarks/RESULTS.md)."""
    if not (compile and int8) or _cpu_has_vnni():
        return None
    return ("compile=True with int8=True on a CPU without VNNI: the compiled int8 graph runs oneDNN's int8 GEMMs "
            "without VNNI, slower here than the eager int8 layers (fbgemm's kernel): one sentence took about 1.16x the "
            "eager int8 time on an AVX2 EPYC. Expected int8 without compile on this CPU (docs/serving.md)")


def read_calibration(path: str | os.PathLike) -> list[str]:
    """The inputs of a calibration file: its non-blank lines, stripped; a clear error for a file that is missing,
    not UTF-8 text or holds none."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"calibration={str(path)!r}: expected a readable UTF-8 text file, one input per line "
                         f"({type(error).__name__}: {error})") from error
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"calibration={str(path)!r} holds no input: expected inputs like those the server will "
                         "embed, one per line")
    return lines


# Tokens per calibration forward at most: a forward's activations stay small, however many lines the file holds.
CALIBRATION_TOKENS = 2048


def calibration_rows(tokenizer, texts: list[str], max_length: int, pairs: bool) -> list[dict[str, list[int]]]:
    """The calibration file's `texts` tokenized as the server tokenizes requests (cut at `max_length`): each text
    alone, and where the model scores `pairs` (a sequence classifier, a cross-encoder), with token types, and the
    first and second texts, the third and fourth, and so on, as pairs too (the second of token type 1, where the
    tokenizer gives token types), so that the scales cover what pairs bring."""
    encoded = tokenizer(texts, truncation=True, max_length=max_length)
    if not pairs:
        return [{"input_ids": ids} for ids in encoded["input_ids"]]
    firsts, seconds = texts[0:len(texts) - 1:2], texts[1::2]
    joined = tokenizer(firsts, seconds, truncation=True, max_length=max_length) if seconds else {"input_ids": []}
    rows = []
    for batch in (encoded, joined):
        types = batch.get("token_type_ids") or [[0] * len(ids) for ids in batch["input_ids"]]
        rows += [{"input_ids": ids, "token_type_ids": kinds} for ids, kinds in zip(batch["input_ids"], types)]
    return rows


def calibration_probe(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The calibration row ``(1, L)`` that probes a compiled int8 graph: a pair (a row with token type 1) where the
    batches hold one, else the first batch's first row."""
    for batch in batches:
        types = batch.get("token_type_ids")
        pairs = [] if types is None else types.any(dim=1).nonzero().flatten().tolist()
        if pairs:
            return {name: tensor[pairs[0]:pairs[0] + 1] for name, tensor in batch.items()}
    return {name: tensor[:1] for name, tensor in batches[0].items()}


def calibration_batches(rows: list[dict[str, list[int]]], budget: int) -> list[dict[str, torch.Tensor]]:
    """Tokenized rows (`calibration_rows`) as the batches the calibration runs: rows of one length together, with no
    padding, at most `budget` tokens a batch (one forward for each length, not for each row), the largest batch first
    (the one the export traces); rows shorter than 2 tokens, which the compiled graph never gets, left out."""
    groups: dict[int, list[dict[str, list[int]]]] = {}
    for row in rows:
        if len(row["input_ids"]) >= 2:
            groups.setdefault(len(row["input_ids"]), []).append(row)
    batches = []
    for length, group in groups.items():
        per_batch = max(1, budget // length)
        batches += [{name: torch.tensor([row[name] for row in group[i:i + per_batch]]) for name in group[0]}
                    for i in range(0, len(group), per_batch)]
    return sorted(batches, key=lambda batch: len(batch["input_ids"]), reverse=True)


_PROBE_EXPECTED = {True: f"a cosine of at least {PROBE_COSINE_FP32} and differences within 1e-3 of the largest value",
                   False: f"a cosine of at least {PROBE_COSINE} and lengths within {PROBE_NORM:.0%}"}
_LOGITS_EXPECTED = {True: f"each logit within {PROBE_LOGITS_FP32:.1%} of the largest one's magnitude (or of 1)",
                    False: f"each logit within {PROBE_LOGITS:.0%} of the largest one's magnitude (or of 1)"}


def logits_agree(got: torch.Tensor, expected: torch.Tensor, fp32: bool) -> bool:
    """Whether the compiled classifier's logits `got` for the probe input agree with the eager model's `expected`: each
    within `PROBE_LOGITS_FP32` (fp32) or `PROBE_LOGITS` (bf16, int8) of the largest logit's magnitude, or of 1 where
    that is smaller (a cosine says little of one label's logit, and nothing of logits near zero)."""
    scale = max(expected.abs().max().item(), 1.0)
    return (got - expected).abs().max().item() <= (PROBE_LOGITS_FP32 if fp32 else PROBE_LOGITS) * scale


def probe_agrees(got: torch.Tensor, expected: torch.Tensor, fp32: bool) -> bool:
    """Whether the compiled encoder's output `got` for the probe input agrees with the eager model's `expected`
    (vectors along the last dimension): in fp32, each at a cosine of `PROBE_COSINE_FP32` and no value off by more than
    1e-3 of the largest; else each at a cosine of `PROBE_COSINE` and its length within `PROBE_NORM` of the eager
    one's."""
    cosine = torch.cosine_similarity(got, expected, dim=-1).min().item()
    if fp32:
        return cosine >= PROBE_COSINE_FP32 and (got - expected).abs().max().item() <= 1e-3 * expected.abs().max().item()
    ratio = got.norm(dim=-1) / expected.norm(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    return cosine >= PROBE_COSINE and bool(((ratio - 1).abs() <= PROBE_NORM).all())


def static_int8_encoder(module: OneInput | OneClassifierInput, calibration: list[dict[str, torch.Tensor]],
                        max_length: int) -> nn.Module:
    """`module` exported for any length from 2 to `max_length` (and any number of rows, where the first calibration
    batch has several) and quantized statically (`quantization.static_int8`) on the `calibration` batches
    (`calibration_batches`: ids, and a classifier's token types)."""
    dims = {1: torch.export.Dim("length", min=2, max=max_length)}
    rows = [len(batch["input_ids"]) for batch in calibration]
    if rows[0] > 1:  # else every batch is one row (a traced 1 is a constant)
        dims[0] = torch.export.Dim("rows", min=1, max=max(rows))
    classifier = isinstance(module, OneClassifierInput)
    names = ("input_ids", "token_type_ids") if classifier else ("input_ids",)
    device = next(module.parameters()).device
    try:
        return static_int8(module, [{name: batch[name].to(device) for name in names} for batch in calibration],
                           dict.fromkeys(names, dims))
    except Exception as error:  # torch.export's and torchao's errors have no common base class
        raise RuntimeError(f"compile=True with int8=True: the {'classifier' if classifier else 'encoder'} could not "
                           f"be exported and quantized statically on the calibration inputs ({type(error).__name__}: "
                           f"{error}); expected a calibration file of inputs like those the server will "
                           f"{'classify' if classifier else 'embed'}, or int8 without compile") from error


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


__all__ = ["CALIBRATION_TOKENS", "LoadedModel", "PROBE_COSINE", "PROBE_COSINE_FP32", "PROBE_LOGITS",
           "PROBE_LOGITS_FP32", "PROBE_NORM", "TOKENIZER_FILES", "calibration_batches", "calibration_probe",
           "calibration_rows", "compile_caution", "compile_refusal", "logits_agree", "probe_agrees", "read_calibration",
           "static_int8_encoder"]
