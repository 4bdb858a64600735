#!/usr/bin/env python
"""Masked-language-model pretraining of a RoFormer with transformers' Trainer.

Mirrors transformers' examples/pytorch/language-modeling/run_mlm.py. With no data arguments it trains on the
built-in Shakespeare lines; without --tokenizer_name (and no --model_name_or_path) it first trains a WordPiece
tokenizer on the training text.

    python examples/run_mlm.py --output_dir runs/mlm --config_overrides "hidden_size=256,num_hidden_layers=4" \
        --num_train_epochs 1 --per_device_train_batch_size 32
    accelerate launch --multi_gpu --num_processes 2 examples/run_mlm.py ...   # DDP, no code of ours involved
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from itertools import chain

import transformers
from lib.collator import PackedMLMCollator, ResumableMLMCollator
from lib.example_utils import (
    DataArguments,
    load_or_train_tokenizer,
    load_text_datasets,
    new_config,
    parse_arguments,
    text_column,
    train_and_evaluate,
)
from lib.shakespeare import genre_classification_test_plays, mlm_corpus_splits

import roformer_hf

logger = logging.getLogger("run_mlm")


@dataclass
class MLMArguments:
    line_by_line: bool = field(default=True, metadata={"help": "One sequence per line (else pack lines into "
                                                               "blocks of max_seq_length)."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Share of tokens to mask."})
    packing: bool = field(default=False, metadata={"help": "Padding-free batches: the examples of a batch back to "
                                                           "back in one row (DataCollatorWithFlattening)."})


def builtin_corpus():
    """Shakespeare's spoken lines, leaving out the plays of the built-in classification test split, so that a
    model pretrained here and fine-tuned by run_classification.py has never read its test speeches."""
    return mlm_corpus_splits(exclude_plays=genre_classification_test_plays())


def tokenize(raw, tokenizer, column: str, data: DataArguments, mlm: MLMArguments, training_args):
    def encode_lines(batch):
        lines = [line for line in batch[column] if line and not line.isspace()]
        return tokenizer(lines, truncation=True, max_length=data.max_seq_length, return_special_tokens_mask=True)

    def encode_and_group(batch):
        ids = tokenizer(batch[column], return_special_tokens_mask=True)
        block = data.max_seq_length
        joined = {k: list(chain.from_iterable(v)) for k, v in ids.items()}
        total = len(joined["input_ids"]) // block * block
        return {k: [v[i:i + block] for i in range(0, total, block)] for k, v in joined.items()}

    with training_args.main_process_first(desc="tokenizing"):
        return raw.map(encode_lines if mlm.line_by_line else encode_and_group, batched=True,
                       num_proc=data.preprocessing_num_workers, remove_columns=raw["train"].column_names,
                       desc="Tokenizing")


def masked_token_accuracy(prediction: transformers.EvalPrediction) -> dict:
    """Share of masked tokens predicted right. Logits are reduced to their argmax batch by batch
    (`preprocess_logits_for_metrics`), so evaluation never holds (samples, seq_len, vocab) logits."""
    predictions, labels = prediction.predictions, prediction.label_ids
    masked = labels != -100
    return {"accuracy": float((predictions[masked] == labels[masked]).mean())}


def main(argv: list[str] | None = None) -> dict:
    model_args, data, mlm, training_args = parse_arguments(MLMArguments, argv)
    raw = load_text_datasets(data, builtin_corpus)
    column = text_column(raw, data.text_column_name)
    tokenizer = load_or_train_tokenizer(model_args, (row[column] for row in raw["train"]), training_args,
                                        max_length=data.max_seq_length)

    if model_args.model_name_or_path:
        model = transformers.AutoModelForMaskedLM.from_pretrained(
            model_args.model_name_or_path, attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code)
    else:
        config = new_config(model_args, tokenizer, max_position_embeddings=data.max_seq_length)
        model = roformer_hf.RoFormerForMaskedLM._from_config(config,
                                                             attn_implementation=model_args.attn_implementation)
    logger.info("Model: %s with %.2fM parameters", type(model).__name__, model.num_parameters() / 1e6)

    tokenized = tokenize(raw, tokenizer, column, data, mlm, training_args)
    collator = (PackedMLMCollator if mlm.packing else ResumableMLMCollator)(
        tokenizer, mlm_probability=mlm.mlm_probability, seed=training_args.seed)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=tokenized["train"],
                                   eval_dataset=tokenized["validation"], processing_class=tokenizer,
                                   data_collator=collator, compute_metrics=masked_token_accuracy,
                                   preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1))

    metrics = train_and_evaluate(trainer, tokenizer, data.max_seq_length, {"world_size": training_args.world_size})
    if training_args.push_to_hub:
        trainer.push_to_hub(finetuned_from=model_args.model_name_or_path, tasks="fill-mask")
    return {"metrics": metrics, "trainer": trainer, "tokenizer": tokenizer}


if __name__ == "__main__":
    main(sys.argv[1:] or None)
