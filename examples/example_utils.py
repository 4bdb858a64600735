"""What run_mlm.py and run_classification.py share: model/data arguments, loading text data, the tokenizer."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import datasets
import transformers
from config_overrides import parse_overrides

import roformer_hf

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A pretrained folder or Hub repo; leave out to train from scratch."})
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Override config fields when training from scratch: 'hidden_size=256,num_hidden_layers=4'"})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "A tokenizer folder or Hub repo; by default the model's, or a new one "
                                        "trained on the training text."})
    tokenizer_vocab_size: int = field(default=8000, metadata={"help": "Vocabulary size of a newly trained tokenizer."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa, eager or flash_attention_2."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow code from a Hub repo to run."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A dataset on the Hub (needs a network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "A .txt, .csv or .json(l) file."})
    validation_file: str | None = field(default=None, metadata={"help": "A .txt, .csv or .json(l) file."})
    text_column_name: str | None = field(default=None, metadata={"help": "Column holding the text."})
    max_seq_length: int = field(default=128, metadata={"help": "Longest tokenized sequence; longer is truncated."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many evaluation rows."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Share of train held out for validation when no validation split exists."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


def parse_arguments(script_arguments, argv: list[str] | None):
    """(ModelArguments, DataArguments, script_arguments, TrainingArguments) from the command line, with logging
    and the seed set up."""
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, script_arguments,
                                            transformers.TrainingArguments))
    parsed = parser.parse_args_into_dataclasses(args=argv)
    training_args = parsed[-1]
    setup_logging(training_args)
    transformers.set_seed(training_args.seed)
    return parsed


def load_file(path: str, argument: str) -> datasets.DatasetDict:
    """A .txt, .csv, .json(l) or .parquet file as a DatasetDict with one split, "train"."""
    extension = os.path.splitext(path)[1].lstrip(".")
    builder = {"txt": "text", "jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(extension)
    if builder is None:
        raise ValueError(f"{argument} {path!r}: expected a .txt, .csv, .json(l) or .parquet file")
    return datasets.load_dataset(builder, data_files=path)


def load_text_datasets(data: DataArguments, builtin) -> datasets.DatasetDict:
    """Hub dataset, local files, or the built-in data (`builtin()`), always with train and validation splits."""
    if data.dataset_name:
        raw = datasets.load_dataset(data.dataset_name, data.dataset_config_name)
    elif data.train_file:
        raw = load_file(data.train_file, "--train_file")
        if data.validation_file:
            raw["validation"] = load_file(data.validation_file, "--validation_file")["train"]
    else:
        logger.info("No data arguments: using the built-in Shakespeare data")
        raw = builtin()
    if "validation" not in raw:
        held_out = raw["train"].train_test_split(test_size=data.validation_split_percentage / 100, seed=0)
        raw = datasets.DatasetDict({**raw, "train": held_out["train"], "validation": held_out["test"]})
    if data.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(data.max_train_samples, len(raw["train"]))))
    if data.max_eval_samples is not None:
        for split in [s for s in raw if s != "train"]:
            raw[split] = raw[split].select(range(min(data.max_eval_samples, len(raw[split]))))
    return raw


def text_column(raw: datasets.DatasetDict, requested: str | None) -> str:
    columns = raw["train"].column_names
    if requested:
        if requested not in columns:
            raise ValueError(f"--text_column_name {requested!r} not in the data's columns {columns}")
        return requested
    return "text" if "text" in columns else columns[0]


def load_or_train_tokenizer(model_args: ModelArguments, texts, resume_from_checkpoint: str | None = None
                            ) -> transformers.PreTrainedTokenizerBase:
    """The named tokenizer, the model's own, the one saved with the checkpoint being resumed, or a WordPiece
    tokenizer trained on `texts` (an iterable). Training is not bit-reproducible, so a resumed run must reuse
    the tokenizer its checkpoint was trained with."""
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if not source and isinstance(resume_from_checkpoint, str):
        source = resume_from_checkpoint
    if source:
        return transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    logger.info("Training a %d-token WordPiece tokenizer on the training text", model_args.tokenizer_vocab_size)
    return roformer_hf.train_tokenizer(texts, vocab_size=model_args.tokenizer_vocab_size)


def new_config(model_args: ModelArguments, tokenizer, **fields) -> roformer_hf.RoFormerConfig:
    """A fresh RoFormerConfig sized to the tokenizer, with --config_overrides applied."""
    overrides = parse_overrides(model_args.config_overrides)
    return roformer_hf.RoFormerConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      **{**fields, **overrides})


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 100 else float("inf")


def setup_logging(training_args: transformers.TrainingArguments) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO if training_args.should_log else logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()
