#!/usr/bin/env python
"""Sequence-classification fine-tuning of a RoFormer with transformers' Trainer.

From a pretrained folder (`--model_name_or_path`, e.g. the output of run_mlm.py) or from scratch
(`--config_overrides`). With no data arguments it fine-tunes on a built-in task on Shakespeare, split by play
into train/validation/test (`--task`): `word_order` (the default: is a passage of consecutive lines as written, or
were the words within its lines shuffled?) or `genre` (comedy, history or tragedy?); passages of at least
`--passage_words` words. Accuracy and macro-F1 come from `evaluate` (the offline metric module
lib/classification_metric.py, or Hub metrics named with --metric_names), printed beside the majority-class baseline.

    python examples/run_classification.py --model_name_or_path runs/mlm --output_dir runs/cls --num_train_epochs 3
"""

from __future__ import annotations

import collections
import logging
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import transformers
from lib.classification_metric import load_classification_metrics
from lib.example_utils import (
    load_file,
    load_or_train_tokenizer,
    load_text_datasets,
    new_config,
    parse_arguments,
    record_trained_length,
    text_column,
)
from lib.shakespeare import genre_classification_splits, word_order_splits

import roformer_hf

logger = logging.getLogger("run_classification")


@dataclass
class ClassificationArguments:
    label_column_name: str = field(default="label", metadata={"help": "Column holding the class."})
    test_file: str | None = field(default=None, metadata={"help": "A file for the final test evaluation."})
    metric_names: str | None = field(
        default=None, metadata={"help": "Comma-separated Hub metrics (online); default: offline accuracy + f1."})
    task: str = field(default="word_order", metadata={
        "help": "Built-in data: word_order (as written, or the words within lines shuffled?) or genre.",
        "choices": ["word_order", "genre"]})
    passage_words: int = field(default=150, metadata={
        "help": "Built-in data: words per passage (about 1.4 tokens each); genre only: 0 for single speeches."})
    classifier_pooling: str | None = field(default=None, metadata={
        "help": "What the classifier reads: cls (the first token) or mean (the mean of the tokens); default: the "
                "model's config.classifier_pooling (cls for a new model).", "choices": ["cls", "mean"]})


def builtin_task(arguments: ClassificationArguments) -> datasets.DatasetDict:
    if arguments.task == "word_order":
        return word_order_splits(passage_words=arguments.passage_words)
    return genre_classification_splits(passage_words=arguments.passage_words or None)


def label_names(raw: datasets.DatasetDict, column: str) -> list[str]:
    feature = raw["train"].features[column]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    values = sorted({str(v) for split in raw.values() for v in split[column]})
    if len(values) < 2:
        raise ValueError(f"--label_column_name {column!r} holds {len(values)} distinct value(s); expected >= 2")
    return values


def majority_baseline(train_labels: list[int], eval_labels: list[int]) -> tuple[int, float]:
    """The most frequent training label and the accuracy of always predicting it on `eval_labels`."""
    majority = collections.Counter(train_labels).most_common(1)[0][0]
    return majority, float(np.mean(np.asarray(eval_labels) == majority))


def load_pretrained_with_fresh_head(model_args, **kwargs) -> transformers.PreTrainedModel:
    """`AutoModelForSequenceClassification.from_pretrained`, saying in one line which weights start fresh (the
    new head) and which of the checkpoint's are left out (e.g. a masked-LM head), instead of transformers'
    load-report table."""
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            model_args.model_name_or_path, attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code, output_loading_info=True, **kwargs)
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    fresh = sorted({key.rsplit(".", 1)[0] for key in info["missing_keys"]})
    unused = sorted({key.split(".")[0] for key in info["unexpected_keys"]})
    if fresh or unused:
        logger.info("Loaded the pretrained encoder of %s; %s", model_args.model_name_or_path,
                    "; ".join(part for part in (
                        fresh and f"the new classifier head starts fresh ({', '.join(fresh)})",
                        unused and f"left out the checkpoint's {', '.join(unused)} weights (its pretraining head)")
                              if part))
    return model


def main(argv: list[str] | None = None) -> dict:
    model_args, data, cls_args, training_args = parse_arguments(ClassificationArguments, argv)
    raw = load_text_datasets(data, lambda: builtin_task(cls_args))
    if cls_args.test_file:
        raw["test"] = load_file(cls_args.test_file, "--test_file")["train"]
    column = text_column(raw, data.text_column_name)
    if cls_args.label_column_name not in raw["train"].column_names:
        raise ValueError(f"--label_column_name {cls_args.label_column_name!r} not in the data's columns "
                         f"{raw['train'].column_names}")
    names = label_names(raw, cls_args.label_column_name)
    label2id = {name: i for i, name in enumerate(names)}

    tokenizer = load_or_train_tokenizer(model_args, (row[column] for row in raw["train"]), training_args,
                                        max_length=data.max_seq_length)
    id2label = dict(enumerate(names))
    head = {"num_labels": len(names), "id2label": id2label, "label2id": label2id}
    if cls_args.classifier_pooling:
        head["classifier_pooling"] = cls_args.classifier_pooling
    if model_args.model_name_or_path:
        model = load_pretrained_with_fresh_head(model_args, **head)
    else:
        config = new_config(model_args, tokenizer, max_position_embeddings=data.max_seq_length, **head)
        model = roformer_hf.RoFormerForSequenceClassification._from_config(
            config, attn_implementation=model_args.attn_implementation)

    is_class_label = isinstance(raw["train"].features[cls_args.label_column_name], datasets.ClassLabel)

    def encode(batch):
        encoded = tokenizer(batch[column], truncation=True, max_length=data.max_seq_length)
        labels = batch[cls_args.label_column_name]
        encoded["labels"] = labels if is_class_label else [label2id[str(v)] for v in labels]
        return encoded

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(encode, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")

    metric = load_classification_metrics(cls_args.metric_names.split(",") if cls_args.metric_names else None)

    def compute_metrics(prediction: transformers.EvalPrediction) -> dict:
        predictions = np.argmax(prediction.predictions, axis=-1)
        return metric.compute(predictions=predictions, references=prediction.label_ids)

    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=tokenized["train"],
                                   eval_dataset=tokenized["validation"], processing_class=tokenizer,
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer),
                                   compute_metrics=compute_metrics)
    metrics = {"world_size": training_args.world_size}
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        logger.info("None of --do_train/--do_eval/--do_predict given: training, then evaluating")
        training_args.do_train = True
    if training_args.do_train:
        record_trained_length(model, tokenizer, data.max_seq_length)
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.save_state()
        metrics.update(result.metrics)

    final_split = "test" if "test" in tokenized else "validation"
    evaluation = trainer.evaluate(tokenized[final_split], metric_key_prefix=final_split)
    majority, baseline = majority_baseline(tokenized["train"]["labels"], tokenized[final_split]["labels"])
    evaluation[f"{final_split}_majority_baseline_accuracy"] = baseline
    metrics.update(evaluation)
    trainer.log_metrics(final_split, evaluation)
    trainer.save_metrics("all", metrics)
    if training_args.should_log:
        print(f"{final_split} accuracy {evaluation[f'{final_split}_accuracy']:.3f} vs majority-class baseline "
              f"{baseline:.3f} (always '{names[majority]}')")
    if training_args.push_to_hub:
        trainer.push_to_hub(finetuned_from=model_args.model_name_or_path, tasks="text-classification")
    return {"metrics": metrics, "trainer": trainer, "tokenizer": tokenizer, "final_split": final_split, "raw": raw,
            "text_column": column}


if __name__ == "__main__":
    main(sys.argv[1:] or None)
