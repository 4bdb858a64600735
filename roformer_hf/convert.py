"""Turn a checkpoint folder of transformers' RoFormer into a roformer_hf folder, in one step.

`AutoModel*` on a folder of transformers' RoFormer (`model_type: "roformer"`) builds transformers' own classes, also
in a process that imported roformer_hf: importing the package never changes what transformers builds. The converted
folder names roformer_hf everywhere, so Auto classes, pipelines, sentence-transformers (which loads through the Auto
classes) and `trust_remote_code=True` users without the package all get roformer_hf:

- the weights, read by roformer_hf's own `from_pretrained` of the head class that the source config's
  `architectures` names (V1, RoFormer-V2 and RoFormer-Sim alike: the config says which), and written by its
  `save_pretrained`: safetensors, config.json with `model_type: "roformer_hf"` and an `auto_map` for every Auto
  class, and the code files next to the weights. A source with pickled weights only (`pytorch_model.bin`, as older
  Hub repositories of RoFormer-V2 and RoFormer-Sim hold them) is read here, and only here, with torch's restricted
  loader (`torch.load(weights_only=True)`: tensors and plain containers, never code), and refused when it holds
  anything else;
- the tokenizer, as roformer_hf's `RoFormerHFTokenizer` (a tokenizer of transformers' RoFormer keeps its jieba
  segmentation);
- every other file of the source (model card, sentence-transformers' modules.json and pooling folders), except
  weights in other formats.

Command line: `python -m roformer_hf.convert SRC DST [--overwrite]`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from .configuration import TRANSFORMERS_MODEL_TYPE, RoFormerConfig
from .modeling import HEADS
from .tokenization import RoFormerHFTokenizer

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt", "special_tokens_map.json",
                   "added_tokens.json")
# Tokenizers whose folders RoFormerHFTokenizer reads faithfully: BERT's WordPiece, with or without jieba.
WORDPIECE_TOKENIZERS = ("RoFormerTokenizer", "BertTokenizer", RoFormerHFTokenizer.__name__)
# Not copied from the source: weights (the converted ones replace them; other formats would be stale or pickled),
# code files (the current ones are written) and hidden files (.git).
SKIPPED_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.h5", "*.msgpack",
                    "*.pt", "*.pth", "*.ckpt", "*.onnx", "*.gguf", "*.py", ".*")


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a roformer_hf version of the checkpoint folder `src` (transformers' RoFormer) to the folder `dst`.

    Nothing is written unless the whole conversion succeeds. A `dst` that exists and is not empty is replaced only
    with `overwrite=True`.

    Args:
        src: A local checkpoint folder of transformers' RoFormer (or of roformer_hf, to refresh its code files).
        dst: The folder to write; created with its parents.
        overwrite: Replace a non-empty `dst`.

    Returns:
        The path of `dst`.

    Example:

    ```python
    >>> import tempfile, transformers
    >>> from roformer_hf.convert import convert_checkpoint
    >>> config = transformers.RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
    ...                                      num_attention_heads=2, intermediate_size=64)
    >>> src, dst = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> transformers.RoFormerForMaskedLM(config).save_pretrained(src)
    >>> type(transformers.AutoModelForMaskedLM.from_pretrained(convert_checkpoint(src, dst))).__module__
    'roformer_hf.modeling'
    ```
    """
    src, dst = Path(src), Path(dst)
    head = _head_class(src)
    _check_destination(src, dst, overwrite)
    state_dict = _pickled_state_dict(src)
    if state_dict is None:
        model = head.from_pretrained(src)
    else:
        model = head.from_pretrained(None, config=RoFormerConfig.from_pretrained(src), state_dict=state_dict)
    tokenizer = _tokenizer(src)
    if tokenizer is not None and tokenizer.model_max_length > model.config.max_position_embeddings:
        # Pipelines truncate at the tokenizer's limit: the length the model was trained at, not "no limit".
        tokenizer.model_max_length = model.config.max_position_embeddings

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))  # same file system: renamed at the end
    try:
        # The source's other files first: its model card (README.md) is kept, as save_pretrained keeps one it finds.
        # copytree also gives the staging folder the source folder's permissions (mkdtemp made it private).
        shutil.copytree(src, staging, ignore=_not_copied(src), dirs_exist_ok=True)
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("converted %s (%s) to %s", src, head.__name__, dst)
    return dst


def _head_class(src: Path) -> type:
    """The roformer_hf class of the head that the source config's `architectures` names."""
    if not (src / CONFIG_FILE).is_file():
        raise ValueError(f"src={os.fspath(src)!r}: expected a local checkpoint folder with a {CONFIG_FILE} (download "
                         "a Hub repository first, e.g. `hf download REPO --local-dir SRC`)")
    config = json.loads((src / CONFIG_FILE).read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type not in (TRANSFORMERS_MODEL_TYPE, RoFormerConfig.model_type):
        raise ValueError(f"{src / CONFIG_FILE} has model_type={model_type!r}: expected "
                         f"{TRANSFORMERS_MODEL_TYPE!r} (transformers' RoFormer) or {RoFormerConfig.model_type!r}")
    heads = {head.model_class.__name__: head.model_class for head in HEADS}
    architectures = config.get("architectures") or [None]
    if architectures[0] not in heads:
        raise ValueError(f"{src / CONFIG_FILE} has architectures={config.get('architectures')!r}: expected one of "
                         f"{sorted(heads)} (roformer_hf implements the encoder and its heads)")
    return heads[architectures[0]]


def _pickled_state_dict(src: Path) -> dict[str, torch.Tensor] | None:
    """The weights of a source that holds them only as a pickle (`pytorch_model.bin`, or its shards), read with
    torch's restricted loader; None for a source with safetensors weights."""
    if (src / SAFE_WEIGHTS_NAME).is_file() or (src / SAFE_WEIGHTS_INDEX_NAME).is_file():
        return None
    if (src / WEIGHTS_INDEX_NAME).is_file():
        index = json.loads((src / WEIGHTS_INDEX_NAME).read_text(encoding="utf-8"))
        files = sorted(set(index.get("weight_map", {}).values()))
    elif (src / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    else:
        return None
    state_dict = {}
    for name in files:
        try:  # unpickles tensors, numbers, strings and plain containers only: nothing that runs code
            loaded = torch.load(src / name, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise ValueError(f"{src / name} holds more than tensors ({str(error).splitlines()[0]}): refused, as "
                             "torch.load(weights_only=True) refuses it; expected a state dict of tensors") from error
        if not isinstance(loaded, dict) or not all(isinstance(key, str) and isinstance(value, torch.Tensor)
                                                   for key, value in loaded.items()):
            raise ValueError(f"{src / name} holds a {type(loaded).__name__}: expected a state dict, names to tensors")
        state_dict.update(loaded)
    logger.info("%s holds pickled weights (%s): read with torch.load(weights_only=True)", src, ", ".join(files))
    return state_dict


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    source, target = src.resolve(), dst.resolve()
    if source == target or source in target.parents or target in source.parents:
        raise ValueError(f"dst={os.fspath(dst)!r}: expected a folder outside src={os.fspath(src)!r} and not "
                         "containing it")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"dst={os.fspath(dst)!r} is a file: expected a folder")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"dst={os.fspath(dst)!r} is not empty: pass --overwrite (overwrite=True) to replace it")


def _tokenizer(src: Path) -> RoFormerHFTokenizer | None:
    """The source's tokenizer as roformer_hf's, or None when it has none."""
    if not any((src / name).is_file() for name in TOKENIZER_FILES):
        logger.info("%s has no tokenizer files: converting the model only", src)
        return None
    config_file = src / TOKENIZER_FILES[0]
    saved = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    tokenizer_class = saved.get("tokenizer_class")
    if tokenizer_class is not None and tokenizer_class.removesuffix("Fast") not in WORDPIECE_TOKENIZERS:
        raise ValueError(f"{config_file} has tokenizer_class={tokenizer_class!r}: expected one of "
                         f"{list(WORDPIECE_TOKENIZERS)} (WordPiece, which roformer_hf's tokenizer reads)")
    return RoFormerHFTokenizer.from_pretrained(src)


def _not_copied(src: Path):
    """shutil.copytree's `ignore`: weights, code and hidden files anywhere; at the top, the files written anew."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = {name for name in names if any(fnmatch.fnmatch(name, p) for p in SKIPPED_PATTERNS)}
        if Path(folder) == src:
            skipped.update(name for name in names if name in (CONFIG_FILE, *TOKENIZER_FILES))
        return skipped
    return ignore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roformer_hf.convert",
        description="Convert a checkpoint folder of transformers' RoFormer into a roformer_hf folder (weights, "
                    "config with auto_map, code files, tokenizer), loaded as roformer_hf by the Auto classes.")
    parser.add_argument("src", help="checkpoint folder of transformers' RoFormer, JunnYu's RoFormer-V2 or RoFormer-Sim "
                                    "(safetensors weights, or pytorch_model.bin read with weights_only=True)")
    parser.add_argument("dst", help="folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it is not empty")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        convert_checkpoint(args.src, args.dst, overwrite=args.overwrite)
    except (ValueError, OSError, ImportError) as error:
        parser.exit(1, f"error: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
