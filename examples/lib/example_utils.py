"""What the Trainer scripts (run_mlm.py, run_classification.py, run_seq2seq.py) share: model/data arguments,
loading text data, the tokenizer, a language model's training and evaluation."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field

import datasets
import torch
import transformers

import roformer_hf

from .config_overrides import parse_overrides

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
    refuse_independent_processes(training_args)
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


def refuse_independent_processes(training_args: transformers.TrainingArguments) -> None:
    """Several processes were launched (WORLD_SIZE > 1), but on a machine without GPUs TrainingArguments joins
    them into one job only with `use_cpu`: without it each would train alone, all writing the same output folder
    (transformers only warns). Checked before anything sets up the devices."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not training_args.use_cpu and not _has_accelerator():
        raise ValueError(
            f"WORLD_SIZE={world_size} processes were launched on a machine without GPUs, and --use_cpu is not set: "
            f"each process would train alone and all would write {training_args.output_dir!r}. Pass --use_cpu true "
            "to make them one data-parallel job (gloo), or launch a single process")


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def load_or_train_tokenizer(model_args: ModelArguments, texts, training_args: transformers.TrainingArguments,
                            max_length: int) -> transformers.PreTrainedTokenizerBase:
    """The named tokenizer, the model's own, the one saved with the checkpoint being resumed, or a WordPiece
    tokenizer trained on `texts` (an iterable) that truncates at `max_length` tokens.

    Training is not bit-reproducible, so a resumed run reuses the tokenizer its checkpoint was trained with, and
    with several processes only the first trains: the others build the same tokenizer from its vocabulary."""
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if not source and isinstance(training_args.resume_from_checkpoint, str):
        source = training_args.resume_from_checkpoint
    if source:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    else:
        tokenizer = _train_tokenizer_once(texts, model_args.tokenizer_vocab_size, training_args, max_length)
    logger.info("Tokenizer: %d tokens, vocabulary sha256 %s", len(tokenizer), vocabulary_hash(tokenizer))
    return tokenizer


def _train_tokenizer_once(texts, vocab_size: int, training_args: transformers.TrainingArguments,
                          max_length: int) -> roformer_hf.RoFormerHFTokenizer:
    vocab = None
    if training_args.process_index == 0:
        logger.info("Training a %d-token WordPiece tokenizer on the training text", vocab_size)
        vocab = roformer_hf.train_tokenizer(texts, vocab_size=vocab_size).get_vocab()
    if training_args.world_size > 1:
        shared = [vocab]
        torch.distributed.broadcast_object_list(shared, src=0)
        vocab = shared[0]
    return roformer_hf.RoFormerHFTokenizer(vocab=vocab, model_max_length=max_length)


def vocabulary_hash(tokenizer: transformers.PreTrainedTokenizerBase) -> str:
    """The first 16 hex digits of the sha256 of the {token: id} vocabulary: equal hashes, equal tokenization."""
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocabulary.encode()).hexdigest()[:16]


def record_trained_length(model: transformers.PreTrainedModel, tokenizer, max_seq_length: int) -> None:
    """After training on up to `max_seq_length` tokens: a roformer_hf config's `max_position_embeddings` (the
    length the model was trained at, metadata only) grows to it, and the tokenizer saved with the model
    truncates at that length (`model_max_length`; a tokenizer trained here or loaded from the Hub may have none)."""
    if isinstance(model, roformer_hf.RoFormerPreTrainedModel):
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, max_seq_length)
    tokenizer.model_max_length = model.config.max_position_embeddings


def new_config(model_args: ModelArguments, tokenizer, **fields) -> roformer_hf.RoFormerConfig:
    """A fresh RoFormerConfig sized to the tokenizer, with --config_overrides applied."""
    overrides = parse_overrides(model_args.config_overrides)
    return roformer_hf.RoFormerConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      **{**fields, **overrides})


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 100 else float("inf")


def train_and_evaluate(trainer: transformers.Trainer, tokenizer, max_seq_length: int, metrics: dict) -> dict:
    """A language model's run (run_mlm.py, run_seq2seq.py): with --do_train, train (from --resume_from_checkpoint)
    and save the model and the trainer's state; with --do_eval, the validation loss and its perplexity; both when
    neither flag is given. The training and evaluation metrics join `metrics`, which is saved (all_results.json)
    and returned."""
    args = trainer.args
    if not (args.do_train or args.do_eval):
        logger.info("Neither --do_train nor --do_eval given: doing both")
        args.do_train = args.do_eval = True
    if args.do_train:
        record_trained_length(trainer.model, tokenizer, max_seq_length)
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_model()
        metrics.update(result.metrics)
        trainer.save_state()
    if args.do_eval:
        evaluation = trainer.evaluate()
        evaluation["eval_perplexity"] = perplexity(evaluation["eval_loss"])
        metrics.update(evaluation)
        trainer.log_metrics("eval", evaluation)
    trainer.save_metrics("all", metrics)
    return metrics


def setup_logging(training_args: transformers.TrainingArguments) -> None:
    """The scripts' own messages at INFO on the main process (or --log_level), at WARNING on the others (or
    --log_level_replica); transformers' at WARNING."""
    transformers.utils.logging.set_verbosity_warning()
    level = training_args.get_process_log_level()  # WARNING unless --log_level / --log_level_replica say otherwise
    if training_args.should_log and training_args.log_level == "passive":
        level = logging.INFO
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=level)
