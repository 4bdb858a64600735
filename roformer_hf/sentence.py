"""sentence-transformers' module files in saved RoFormer folders, so that `SentenceTransformer(folder)` gives the
sentence embedding the model was made for.

A folder without `modules.json` gets sentence-transformers' default, mean pooling, whatever the model was trained
for. `save_pretrained` therefore writes the files sentence-transformers itself writes (`modules.json`,
`sentence_bert_config.json`, `config_sentence_transformers.json`, `1_Pooling/config.json`, and a `Normalize` module
when asked), describing one of these embeddings (`sentence_pooling`):

- `"pooler"`: the model's `pooler_output` (`config.add_pooling_layer`), which sentence-transformers' `Transformer`
  module reads directly (its `modality_config` names the output). The default of RoFormer-Sim
  (`config.prefix_lm` and `config.add_pooling_layer`), which ranks sentences by it.
- a pooling of the last hidden state by sentence-transformers' `Pooling` module: `"mean"` (the default of every
  other model), `"cls"`, `"max"`, `"mean_sqrt_len_tokens"`, `"weightedmean"`, `"lasttoken"`.

The pooling comes from the argument, else from `config.sentence_pooling` (an optional field saved in config.json),
else from the defaults above; `normalize` (or `config.sentence_normalize`) adds a `Normalize` module (unit vectors).

A folder that already has a `modules.json` keeps it, as a model card someone wrote is kept, but it must agree with
the config (`check_sentence_modules`): a `pooler_output` the model has no pooler for, a pooling width other than
`hidden_size`, or a pooling other than `config.sentence_pooling` raise, on saving and on loading.

It registers `write_sentence_modules` as a save hook and the check as a load hook at its import
(`loading.register_hook`; the package imports it), as `hub.py` does: the modeling code does not import it, and
sentence-transformers is needed only to read the folders, not to write them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from .loading import register_hook

logger = logging.getLogger(__name__)

MODULES_FILE = "modules.json"
TRANSFORMER_CONFIG_FILE = "sentence_bert_config.json"
SENTENCE_CONFIG_FILE = "config_sentence_transformers.json"
POOLER = "pooler"
# sentence-transformers' `Pooling` modes, of the last hidden state.
TOKEN_POOLINGS = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
POOLINGS = (POOLER, *TOKEN_POOLINGS)
# The module classes as sentence-transformers 6 records them; older folders name them `sentence_transformers.models.X`.
MODULE_TYPES = {
    "Transformer": "sentence_transformers.base.modules.transformer.Transformer",
    "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    "Normalize": "sentence_transformers.base.modules.normalize.Normalize",
}
# sentence-transformers' older `Pooling` configs: one flag per mode.
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def is_roformer_sim(config) -> bool:
    """RoFormer-Sim: a prefix-LM (UniLM) decoder with a pooler, as JunnYu's RoFormer-Sim folders load."""
    return bool(getattr(config, "prefix_lm", False) and getattr(config, "add_pooling_layer", False))


def sentence_pooling(config, pooling: str | None = None) -> str:
    """The sentence embedding of a model with `config`: `pooling` when given, else `config.sentence_pooling`, else
    `"pooler"` for RoFormer-Sim and `"mean"` for every other model. Raises for a pooling the model does not have.

    Example:

    ```python
    >>> from roformer_hf import RoFormerConfig
    >>> from roformer_hf.sentence import sentence_pooling
    >>> sentence_pooling(RoFormerConfig(is_decoder=True, prefix_lm=True, add_pooling_layer=True))
    'pooler'
    >>> sentence_pooling(RoFormerConfig()), sentence_pooling(RoFormerConfig(), "cls")
    ('mean', 'cls')
    ```
    """
    stated = getattr(config, "sentence_pooling", None)
    if pooling is None:
        pooling = stated if stated is not None else (POOLER if is_roformer_sim(config) else "mean")
        name = "pooling" if stated is None else "config.sentence_pooling"
    else:
        name = "pooling"
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise ValueError(f"{name}={pooling!r}: expected one of {POOLINGS} ({POOLER!r}: the model's pooler_output; "
                         "the others: sentence-transformers' Pooling of the last hidden state)")
    if pooling == POOLER and not getattr(config, "add_pooling_layer", False):
        raise ValueError(f"{name}={pooling!r}, but this model has no pooler (config.add_pooling_layer=False): expected "
                         f"one of {TOKEN_POOLINGS}, or a model built with add_pooling_layer=True")
    return pooling


def sentence_normalize(config, normalize: bool | None = None) -> bool:
    """Whether the embedding is scaled to unit length: `normalize`, else `config.sentence_normalize`, else False."""
    value = normalize if normalize is not None else getattr(config, "sentence_normalize", False)
    if not isinstance(value, bool):
        raise ValueError(f"normalize={value!r}: expected True or False")
    return value


def sentence_dimensions(config) -> tuple[int, ...]:
    """The sizes the sentence embedding was trained to be cut to (Matryoshka: its first `d` values are an embedding
    of their own), from `config.sentence_dimensions`, an optional field saved in config.json; () where the config
    names none, for a model whose embedding only works whole.

    Example:

    ```python
    >>> from roformer_hf import RoFormerConfig
    >>> from roformer_hf.sentence import sentence_dimensions
    >>> sentence_dimensions(RoFormerConfig(hidden_size=64, num_attention_heads=4, sentence_dimensions=[64, 32, 16]))
    (64, 32, 16)
    >>> sentence_dimensions(RoFormerConfig())
    ()
    ```
    """
    sizes = getattr(config, "sentence_dimensions", None)
    if sizes is None:
        return ()
    if (not isinstance(sizes, (list, tuple)) or not sizes
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= config.hidden_size for d in sizes)):
        raise ValueError(f"config.sentence_dimensions={sizes!r}: expected a list of sizes from 1 to hidden_size="
                         f"{config.hidden_size} that the embedding was trained to be cut to")
    return tuple(sizes)


def sentence_prompts(folder: str | os.PathLike) -> tuple[dict[str, str], str | None]:
    """The prompts a sentence-transformers folder names (`config_sentence_transformers.json`: name -> the text put
    before each input) and its default prompt's name; ({}, None) where it names none."""
    config = _read_json(Path(folder) / SENTENCE_CONFIG_FILE) or {}
    prompts = config.get("prompts") or {}
    default = config.get("default_prompt_name")
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{Path(folder) / SENTENCE_CONFIG_FILE}: prompts={prompts!r}: expected names -> strings")
    if default is not None and default not in prompts:
        raise ValueError(f"{Path(folder) / SENTENCE_CONFIG_FILE}: default_prompt_name={default!r}: expected one of "
                         f"its prompts, {sorted(prompts)}")
    return dict(prompts), default


def sentence_module_files(config, pooling: str | None = None, normalize: bool | None = None) -> dict[str, dict | list]:
    """The JSON files (relative path -> content) that make a folder holding a model with `config` a
    sentence-transformers model with `sentence_pooling(config, pooling)`, as sentence-transformers writes them."""
    pooling = sentence_pooling(config, pooling)
    output = "pooler_output" if pooling == POOLER else "last_hidden_state"
    files: dict[str, dict | list] = {TRANSFORMER_CONFIG_FILE: {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": output}},
        "module_output_name": "sentence_embedding" if pooling == POOLER else "token_embeddings",
    }}
    modules = [("Transformer", "")]
    if pooling != POOLER:
        modules.append(("Pooling", f"{len(modules)}_Pooling"))
        files[f"{modules[-1][1]}/config.json"] = {"embedding_dimension": config.hidden_size, "pooling_mode": pooling,
                                                  "include_prompt": True}
    if sentence_normalize(config, normalize):
        modules.append(("Normalize", f"{len(modules)}_Normalize"))
        files[f"{modules[-1][1]}/config.json"] = {"module_input_name": "sentence_embedding",
                                                  "module_output_name": "sentence_embedding"}
    files[MODULES_FILE] = [{"idx": idx, "name": str(idx), "path": path, "type": MODULE_TYPES[kind]}
                           for idx, (kind, path) in enumerate(modules)]
    files[SENTENCE_CONFIG_FILE] = {"model_type": "SentenceTransformer", "prompts": {}, "default_prompt_name": None,
                                   "similarity_fn_name": "cosine"}
    return files


def write_sentence_modules(model, save_directory: str | os.PathLike, *, pooling: str | None = None,
                           normalize: bool | None = None, overwrite: bool = False) -> list[Path]:
    """Write `sentence_module_files(model.config, pooling, normalize)` into `save_directory`, the folder `model` was
    saved to; `save_pretrained` calls it with the defaults.

    A folder that already has a `modules.json` keeps its files unless `overwrite=True`; they must then agree with the
    config and the pooling asked for (`check_sentence_modules`). Returns the paths written (none when kept).

    Example, the last hidden state's first token as the embedding, at unit length:

    ```python
    >>> import tempfile, json
    >>> from roformer_hf import RoFormerConfig, RoFormerModel
    >>> from roformer_hf.sentence import write_sentence_modules
    >>> model = RoFormerModel(RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
    ...                                      num_attention_heads=2, intermediate_size=64))
    >>> folder = tempfile.mkdtemp()
    >>> model.save_pretrained(folder)  # writes mean pooling, the default
    >>> paths = write_sentence_modules(model, folder, pooling="cls", normalize=True, overwrite=True)
    >>> [module["path"] for module in json.load(open(f"{folder}/modules.json"))]
    ['', '1_Pooling', '2_Normalize']
    ```
    """
    folder = Path(save_directory)
    if not folder.is_dir():
        raise ValueError(f"save_directory={os.fspath(save_directory)!r}: expected an existing folder")
    config = model.config
    files = sentence_module_files(config, pooling, normalize)  # raises for a pooling the model does not have
    if (folder / MODULES_FILE).exists() and not overwrite:
        check_sentence_modules(folder, config, pooling)
        logger.info("%s exists: keeping the folder's sentence-transformers modules", folder / MODULES_FILE)
        return []
    if overwrite:
        for module in _read_json(folder / MODULES_FILE) or []:
            path = module.get("path", "")
            if path and _kind(module) in ("Pooling", "Normalize") and (folder / path).is_dir():
                shutil.rmtree(folder / path)  # a module folder of an earlier layout (e.g. 2_Normalize)
    written = []
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        written.append(path)
    return written


def folder_pooling(folder: str | os.PathLike) -> tuple[str | tuple[str, ...], int | None] | None:
    """What a folder's sentence-transformers modules compute: `(pooling, width)`, `pooling` as `sentence_pooling`
    names it (a tuple when its `Pooling` module concatenates several), `width` that module's input width (None for
    the pooler); None when the folder has no `modules.json` or no `Transformer` module."""
    folder = Path(folder)
    modules = _read_json(folder / MODULES_FILE)
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ValueError(f"{folder / MODULES_FILE}: expected a list of modules ({{'idx', 'name', 'path', 'type'}})")
    transformers = [module for module in modules if _kind(module) == "Transformer"]
    if not transformers:
        return None
    transformer_config = _read_json(folder / transformers[0].get("path", "") / TRANSFORMER_CONFIG_FILE) or {}
    text = (transformer_config.get("modality_config") or {}).get("text") or {}
    if text.get("method_output_name") == "pooler_output":
        return POOLER, None
    for module in modules:
        if _kind(module) == "Pooling":
            pooling_file = folder / module.get("path", "") / "config.json"
            pooling_config = _read_json(pooling_file) or {}
            mode = pooling_config.get("pooling_mode")
            if mode is None:
                modes = tuple(name for key, name in LEGACY_POOLING_KEYS.items() if pooling_config.get(key))
                mode = modes[0] if len(modes) == 1 else (modes or "mean")
            width = pooling_config.get("embedding_dimension", pooling_config.get("word_embedding_dimension"))
            return (tuple(mode) if isinstance(mode, list) else mode), width
    return "mean", None  # sentence-transformers' default when a folder names no pooling


def check_sentence_modules(folder: str | os.PathLike, config, pooling: str | None = None) -> None:
    """Raises unless the sentence-transformers modules in `folder` agree with `config` (and with `pooling`, or
    `config.sentence_pooling`, when either states one): the pooler's output only for a model with a pooler, a
    `Pooling` module as wide as `hidden_size`. A folder without modules passes."""
    found = folder_pooling(folder)
    if found is None:
        return
    mode, width = found
    where = Path(folder) / MODULES_FILE
    if mode == POOLER and not getattr(config, "add_pooling_layer", False):
        raise ValueError(f"{where} and {TRANSFORMER_CONFIG_FILE} read the model's pooler_output, but its config says "
                         "add_pooling_layer=False (no pooler): expected a Pooling module, or a model with a pooler. "
                         "Rewrite them with roformer_hf.sentence.write_sentence_modules(model, folder, overwrite=True)")
    if width is not None and width != config.hidden_size:
        raise ValueError(f"{where}: its Pooling module expects embedding_dimension={width}, but the model's "
                         f"hidden_size is {config.hidden_size}: expected them equal. Rewrite the modules with "
                         "roformer_hf.sentence.write_sentence_modules(model, folder, overwrite=True)")
    stated = pooling if pooling is not None else getattr(config, "sentence_pooling", None)
    if stated is not None and mode != stated:
        source = "pooling" if pooling is not None else "config.sentence_pooling"
        raise ValueError(f"{where} describes pooling={mode!r}, but {source}={stated!r}: expected them equal. Rewrite "
                         "the modules with roformer_hf.sentence.write_sentence_modules(model, folder, overwrite=True)")


def _check_loaded_folder(model, folder: str | os.PathLike) -> None:
    """`check_sentence_modules` of the folder `model` was loaded from, as a load hook."""
    check_sentence_modules(folder, model.config)


def _kind(module: dict) -> str:
    return str(module.get("type", "")).rpartition(".")[2]


def _read_json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from error


register_hook("save", write_sentence_modules)
register_hook("load", _check_loaded_folder)

__all__ = ["POOLINGS", "check_sentence_modules", "folder_pooling", "is_roformer_sim", "sentence_dimensions",
           "sentence_module_files", "sentence_normalize", "sentence_pooling", "sentence_prompts",
           "write_sentence_modules"]
