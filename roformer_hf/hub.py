"""Model cards and Hub uploads for RoFormer models.

`save_pretrained` writes a model card (README.md) next to the weights unless the folder already has one, and
`push_to_hub` uploads it unless the Hub repository already has one: a card someone wrote is never replaced.

It only reads the model it is given (its class's `heads` table names the Auto class and Hub task). It registers
`write_model_card` as a save hook and `push_to_hub_with_card` as the push hook at its import (`loading.register_hook`;
the package imports it): the modeling code does not import it, so saved folders, which carry the modeling code, do
not carry it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from huggingface_hub import HfApi, ModelCardData

from .loading import register_hook

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
DEFAULT_TAGS = ("roformer_hf", "roformer", "rotary")
CONFIG_ROWS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "hidden_act", "max_position_embeddings", "rotary_layout", "rope_parameters",
               "rotary_value", "norm_position", "norm_type", "use_bias")


def _head(model):
    """The row of `model`'s class in the table of RoFormer models (`modeling.HEADS`)."""
    for head in getattr(model, "heads", ()):
        if head.model_class is type(model):
            return head
    raise ValueError(f"model={type(model).__name__}: expected a roformer_hf model class")


def auto_class_name(model) -> str:
    """The transformers Auto class that loads `model`'s class, e.g. `"AutoModelForMaskedLM"`."""
    return _head(model).auto_class


def model_card_text(
    model,
    repo_id: str | None = None,
    tokenizer=None,
    metrics: Mapping[str, float] | None = None,
    license: str = "apache-2.0",
    tags: Iterable[str] = (),
    datasets: list[str] | None = None,
) -> str:
    """The Markdown of a model card: YAML metadata, a usage snippet, the model's size and configuration, and
    `metrics` when given.

    Args:
        model: a RoFormer model (any head).
        repo_id: the Hub repository (or local folder) the usage snippet loads from; defaults to a placeholder.
        tokenizer: the model's tokenizer, described in the card when given.
        metrics: evaluation results, e.g. `{"accuracy": 0.91}`.
        license: a Hub license identifier.
        tags: extra tags, after `roformer_hf`, `roformer`, `rotary`.
        datasets: Hub ids of the training data sets.
    """
    auto_class = auto_class_name(model)
    title = repo_id.rstrip("/").split("/")[-1] if repo_id else type(model).__name__
    repo_id = repo_id or "path/to/this/model"
    metadata = ModelCardData(
        library_name="transformers",
        license=license,
        tags=[*DEFAULT_TAGS, *(tag for tag in tags if tag not in DEFAULT_TAGS)],
        pipeline_tag=_head(model).pipeline_tag,
        datasets=datasets,
    )
    sections = [
        f"---\n{metadata.to_yaml()}\n---\n",
        f"# {title}\n",
        f"A RoFormer encoder (rotary position embeddings) as `{type(model).__name__}`, saved with the "
        "`roformer_hf` package.\n",
        _usage_section(auto_class, repo_id, tokenizer),
        _model_section(model, tokenizer),
    ]
    if metrics:
        sections.append(_table("## Evaluation", {name: _format(value) for name, value in metrics.items()},
                               ("Metric", "Value")))
    return "\n".join(sections)


def _usage_section(auto_class: str, repo_id: str, tokenizer) -> str:
    tokenizer_note = "" if tokenizer is not None else "  # the tokenizer the model was trained with"
    return (
        "## Usage\n\n"
        "The modeling code is stored with the weights, so transformers alone loads the model (the tokenizer "
        "needs `trust_remote_code=True` too, to read the model's config):\n\n"
        "```python\n"
        f"from transformers import {auto_class}, AutoTokenizer\n\n"
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}", trust_remote_code=True){tokenizer_note}\n'
        f'model = {auto_class}.from_pretrained("{repo_id}", trust_remote_code=True)\n'
        'inputs = tokenizer("Now is the winter of our discontent", return_tensors="pt")\n'
        "outputs = model(**inputs)\n"
        "```\n\n"
        "With `pip install roformer_hf`, `import roformer_hf` registers the model with the Auto classes and "
        "`trust_remote_code` is not needed.\n"
    )


def _model_section(model, tokenizer) -> str:
    config = model.config
    rows = {"class": f"`{type(model).__name__}`", "parameters": f"{model.num_parameters():,}"}
    rows.update({name: f"`{getattr(config, name)}`" for name in CONFIG_ROWS if hasattr(config, name)})
    if getattr(config, "embedding_size", config.hidden_size) != config.hidden_size:
        rows["embedding_size"] = f"`{config.embedding_size}`"
    if auto_class_name(model) in ("AutoModelForSequenceClassification", "AutoModelForTokenClassification"):
        rows["labels"] = ", ".join(f"`{config.id2label[i]}`" for i in sorted(config.id2label))
    if tokenizer is not None:
        rows["tokenizer"] = f"`{type(tokenizer).__name__}`, {len(tokenizer):,} tokens"
    return _table("## Model", rows, ("", ""))


def _table(heading: str, rows: Mapping[str, str], header: tuple[str, str]) -> str:
    lines = [f"{heading}\n", f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows.items()]
    return "\n".join(lines) + "\n"


def _format(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def write_model_card(
    model, save_directory: str | os.PathLike, *, overwrite: bool = False, **card_kwargs
) -> Path | None:
    """Write `model_card_text(model, **card_kwargs)` to `save_directory/README.md`.

    An existing README.md is kept unless `overwrite=True`. Returns the path written, or None when kept.
    """
    if not Path(save_directory).is_dir():
        raise ValueError(f"save_directory={os.fspath(save_directory)!r}: expected an existing folder")
    path = Path(save_directory) / CARD_NAME
    if path.exists() and not overwrite:
        logger.info("%s exists: keeping it, no model card written", path)
        return None
    path.write_text(model_card_text(model, **card_kwargs), encoding="utf-8")
    return path


def push_to_hub_with_card(
    model,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | None = None,
    **card_kwargs,
):
    """Upload `model` (weights, config, modeling code) and its model card to the Hub in one commit.

    transformers' `push_to_hub` writes its generic card over the README.md that `save_pretrained` wrote; this
    keeps ours, and uploads none when the repository already has a README.md. The arguments are those of
    transformers' `push_to_hub`, plus `card_kwargs` for `model_card_text` (e.g. `metrics`); a `tokenizer`
    given there is described in the card and uploaded in the same commit.

    Returns:
        The `huggingface_hub.CommitInfo` of the upload.
    """
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    has_card = api.file_exists(repo_id, CARD_NAME, revision=revision)
    tags = [*(getattr(model, "model_tags", None) or []), *(tags or [])]
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        if card_kwargs.get("tokenizer") is not None:
            card_kwargs["tokenizer"].save_pretrained(folder)
        if has_card:
            logger.info("%s already has a %s: keeping it", repo_id, CARD_NAME)
            (Path(folder) / CARD_NAME).unlink(missing_ok=True)
        else:
            write_model_card(model, folder, overwrite=True, repo_id=repo_id, tags=tags, **card_kwargs)
        return api.upload_folder(
            repo_id=repo_id, folder_path=folder, commit_message=commit_message or "Upload model",
            commit_description=commit_description, revision=revision, create_pr=create_pr,
        )


register_hook("save", write_model_card)
register_hook("push", push_to_hub_with_card)

__all__ = ["auto_class_name", "model_card_text", "push_to_hub_with_card", "write_model_card"]
