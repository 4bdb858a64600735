#!/usr/bin/env python
"""Sequence-to-sequence fine-tuning of a RoFormer decoder, UniLM style, with transformers' Trainer.

One model reads the source and writes the target: `RoFormerForCausalLM` with `prefix_lm=True` (RoFormer-Sim's mask)
takes `[CLS] source [SEP] target [SEP]`, reads the source (segment 0) bidirectionally and the target (segment 1)
left to right, and learns to predict each target token. With no data arguments it learns, on the built-in
Shakespeare plays, to write the line that follows a line of a speech; after training it prints the loss on plays it
never saw and a few generations next to the true line.

    python examples/run_seq2seq.py --output_dir runs/seq2seq --config_overrides "hidden_size=256,num_hidden_layers=4" \
        --num_train_epochs 1 --per_device_train_batch_size 32
    python examples/run_seq2seq.py --output_dir runs/seq2seq --model_name_or_path runs/mlm   # from run_mlm.py

`--model_name_or_path` may be an encoder (run_mlm.py's output, a converted RoFormer checkpoint): its weights become
the decoder's, the UniLM recipe. `--train_file`/`--validation_file` take CSV or JSON with `source` and `target`
columns.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import torch
import transformers
from lib.example_utils import (
    DataArguments,
    load_or_train_tokenizer,
    load_text_datasets,
    new_config,
    parse_arguments,
    train_and_evaluate,
)
from lib.shakespeare import next_line_splits

import roformer_hf

logger = logging.getLogger("run_seq2seq")
COLUMNS = ("source", "target")


@dataclass
class Seq2SeqArguments:
    max_target_length: int = field(default=48, metadata={"help": "Longest target, in tokens; also the most new "
                                                                 "tokens generated."})
    num_examples_to_print: int = field(default=5, metadata={"help": "Validation sources to generate a target for."})


def builtin_pairs():
    """Consecutive lines of the built-in plays' speeches: a line, and the line after it."""
    return next_line_splits()


def tokenize(raw, tokenizer, data: DataArguments, seq2seq: Seq2SeqArguments, training_args):
    """`[CLS] source [SEP] target [SEP]`, the source segment 0 and the target segment 1 (the tokenizer's pair
    encoding); labels are the target's tokens, -100 on the source, which the model reads but does not predict."""
    def encode(batch):
        sources = tokenizer(batch["source"], truncation=True,
                            max_length=data.max_seq_length - seq2seq.max_target_length)
        targets = tokenizer(batch["target"], truncation=True, max_length=seq2seq.max_target_length + 1,
                            add_special_tokens=False)
        rows = {"input_ids": [], "token_type_ids": [], "labels": []}
        for source, target in zip(sources["input_ids"], targets["input_ids"]):
            target = target[:seq2seq.max_target_length] + [tokenizer.sep_token_id]
            rows["input_ids"].append(source + target)
            rows["token_type_ids"].append([0] * len(source) + [1] * len(target))
            rows["labels"].append([-100] * len(source) + target)
        rows["attention_mask"] = [[1] * len(ids) for ids in rows["input_ids"]]
        return rows

    with training_args.main_process_first(desc="tokenizing"):
        return raw.map(encode, batched=True, num_proc=data.preprocessing_num_workers,
                       remove_columns=raw["train"].column_names, desc="Tokenizing")


def generate_targets(model, tokenizer, sources: list[str], seq2seq: Seq2SeqArguments, max_length: int) -> list[str]:
    """Greedy targets for `sources`: the prompts left-padded in one batch, new tokens as segment 1 until [SEP]."""
    tokenizer.padding_side = "left"
    try:
        prompts = tokenizer(sources, return_tensors="pt", padding=True, truncation=True,
                            max_length=max_length - seq2seq.max_target_length).to(model.device)
    finally:
        tokenizer.padding_side = "right"
    model.eval()
    with torch.inference_mode():
        generated = model.generate(**prompts, max_new_tokens=seq2seq.max_target_length, do_sample=False,
                                   eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id)
    new_tokens = generated[:, prompts["input_ids"].shape[1]:]
    # The target is a text of its own, not a continuation of the source's words: no leading space.
    return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def main(argv: list[str] | None = None) -> dict:
    model_args, data, seq2seq, training_args = parse_arguments(Seq2SeqArguments, argv)
    raw = load_text_datasets(data, builtin_pairs)
    missing = [column for column in COLUMNS if column not in raw["train"].column_names]
    if missing:
        raise ValueError(f"The training data has columns {raw['train'].column_names}; expected {list(COLUMNS)}")
    tokenizer = load_or_train_tokenizer(model_args, (row[c] for row in raw["train"] for c in COLUMNS), training_args,
                                        max_length=data.max_seq_length)

    decoder = {"is_decoder": True, "prefix_lm": True}
    if model_args.model_name_or_path:
        model = roformer_hf.RoFormerForCausalLM.from_pretrained(
            model_args.model_name_or_path, attn_implementation=model_args.attn_implementation, **decoder)
    else:
        config = new_config(model_args, tokenizer, max_position_embeddings=data.max_seq_length, **decoder)
        model = roformer_hf.RoFormerForCausalLM._from_config(config,
                                                             attn_implementation=model_args.attn_implementation)
    logger.info("Model: %s with %.2fM parameters", type(model).__name__, model.num_parameters() / 1e6)

    tokenized = tokenize(raw, tokenizer, data, seq2seq, training_args)
    collator = transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=tokenized["train"],
                                   eval_dataset=tokenized["validation"], processing_class=tokenizer,
                                   data_collator=collator)
    metrics = train_and_evaluate(trainer, tokenizer, data.max_seq_length, {})

    examples = raw["validation"].select(range(min(seq2seq.num_examples_to_print, len(raw["validation"]))))
    sources, targets = list(examples["source"]), list(examples["target"])
    generations = generate_targets(model, tokenizer, sources, seq2seq, data.max_seq_length)
    if training_args.should_log:
        print(f"\nvalidation loss {metrics.get('eval_loss', float('nan')):.3f} (perplexity "
              f"{metrics.get('eval_perplexity', float('nan')):.1f}); greedy generations:")
        for source, target, generated in zip(sources, targets, generations):
            print(f"\n  line:      {source}\n  next line: {target}\n  generated: {generated}")
    return {"metrics": metrics, "trainer": trainer, "tokenizer": tokenizer, "generations": generations}


if __name__ == "__main__":
    main(sys.argv[1:] or None)
