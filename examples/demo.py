#!/usr/bin/env python
"""The whole journey on built-in data, on a CPU in minutes (`make demo`):

1. pretrain a small RoFormer with masked LM on Shakespeare, in blocks of 256 tokens (a tokenizer is trained first);
2. fine-tune it to tell whether a passage of consecutive lines (~210 tokens) is as Shakespeare wrote it or has the
   words within each of its lines shuffled (plays split between train/validation/test, none of the test plays read in
   pretraining): the two classes hold the same words, so this takes reading word order;
3. score it on the test plays beside a bag-of-words baseline (TF-IDF + logistic regression, scikit-learn) and the
   majority baseline, on the same splits;
4. save a Hub-ready folder (weights, tokenizer, code, model card) and reload it with
   AutoModelForSequenceClassification + trust_remote_code in a process where roformer_hf is blocked;
5. run the fill-mask and text-classification pipelines on test passages (true label beside each prediction),
   print the torchinfo summary, draw the loss curves and the rotary pictures (into the output folder; the
   README shows a run's copies in docs/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import figures
import run_classification
import run_mlm
from lib.baseline import bag_of_words_baseline

import roformer_hf

MODEL = ("hidden_size=256,num_hidden_layers=3,num_attention_heads=4,intermediate_size=1024,"
         "hidden_dropout_prob=0,attention_probs_dropout_prob=0")
SEQ_LEN = 256
FILL_MASK_LINES = ["To be, or not to [MASK], that is the question.", "Now is the [MASK] of our discontent.",
                   "O Romeo, Romeo, wherefore art thou [MASK]?"]
EXAMPLES_PER_CLASS = 2
TASK = "as written, or the words within each line shuffled?"

RELOAD_ELSEWHERE = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "roformer_hf":
            raise ImportError("roformer_hf is not installed here")
sys.meta_path.insert(0, _Block())
import json, transformers
transformers.utils.logging.set_verbosity_error()
folder, lines = sys.argv[1], json.loads(sys.argv[2])
model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
classify = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer)
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__,
                  "predictions": classify(lines, truncation=True)}))
"""


def evaluation_seconds(log_history: list[dict]) -> float:
    """Seconds a Trainer spent evaluating, from its log history: every `*_runtime` but the training run's own (which
    includes the evaluations made during training)."""
    return sum(value for entry in log_history for key, value in entry.items()
               if key.endswith("_runtime") and key != "train_runtime")


def time_split(total: float, pretraining: float, fine_tuning: float, evaluation: float) -> str:
    """One line: where the demo's `total` seconds went, each part in minutes and as a share of the total;
    `pretraining` and `fine_tuning` without their evaluations, which `evaluation` holds."""
    parts = {"pretraining": pretraining, "fine-tuning": fine_tuning, "evaluation": evaluation,
             "the rest": total - pretraining - fine_tuning - evaluation}
    return " | ".join(f"{name} {seconds / 60:.1f} min ({seconds / total:.0%})" for name, seconds in parts.items()) + (
        f" | total {total / 60:.1f} min")


def banner(text: str) -> None:
    print(f"\n{'=' * 8} {text} {'=' * max(0, 70 - len(text))}", flush=True)


def common_args(output_dir: Path, args) -> list[str]:
    return ["--output_dir", str(output_dir), "--use_cpu", "true",
            "--report_to", "none", "--seed", str(args.seed), "--logging_steps", "20", "--save_strategy", "no",
            "--dataloader_num_workers", "0", "--disable_tqdm", "false", "--do_train", "true", "--do_eval", "true"]


def pretraining_arguments(output_dir: Path, args: argparse.Namespace) -> list[str]:
    """run_mlm.py's command line for the demo's pretraining.

    A few minutes of pretraining is far from fitting the data, so the recipe buys learning per FLOP: no dropout
    (it only slows a model that underfits), small batches (more updates from the same tokens) and 30% of the
    tokens masked (twice the predictions from the same forward pass). `benchmarks/RESULTS.md` has the ablation."""
    return common_args(output_dir, args) + [
        "--config_overrides", args.config_overrides + ",sparse_prediction=true", "--tokenizer_vocab_size", "8000",
        "--line_by_line", "false", "--max_seq_length", str(SEQ_LEN), "--mlm_probability", str(args.mlm_probability),
        "--max_steps", str(args.mlm_steps), "--per_device_train_batch_size", str(args.mlm_batch_size),
        "--learning_rate", "1e-3", "--warmup_steps", str(max(1, args.mlm_steps // 10)), "--weight_decay", "0.01",
        "--max_eval_samples", "2000", "--eval_strategy", "steps", "--eval_steps", str(max(1, args.mlm_steps // 4))]


def fine_tuning_arguments(output_dir: Path, pretrained: Path, args: argparse.Namespace) -> list[str]:
    """run_classification.py's command line for the demo's fine-tuning of the `pretrained` folder.

    The classifier reads the mean of the passage's token states (`--classifier_pooling mean`): a shuffled
    line leaves its mark on the tokens around it, and the mean hands every one of them to the classifier from the
    first step. On [CLS] alone the fine-tuning had to teach [CLS] to gather that first, and sometimes never did
    (validation accuracy stuck near 0.6 for two epochs); on the mean it took off within half an epoch every time
    (`benchmarks/RESULTS.md`). Small batches: 8 passages a step learn more from one epoch than 16."""
    return common_args(output_dir, args) + [
        "--model_name_or_path", str(pretrained), "--task", "word_order", "--max_seq_length", str(SEQ_LEN),
        "--classifier_pooling", args.classifier_pooling,
        "--num_train_epochs", str(args.cls_epochs), "--per_device_train_batch_size", str(args.cls_batch_size),
        "--per_device_eval_batch_size", "64",
        "--learning_rate", str(args.cls_learning_rate), "--warmup_steps", "20", "--weight_decay", "0.01",
        # Passages of a few plays overfit: evaluate four times and keep the best checkpoint.
        "--eval_strategy", "steps", "--eval_steps", "0.25", "--save_strategy", "steps", "--save_steps", "0.25",
        "--save_total_limit", "1", "--load_best_model_at_end", "true", "--metric_for_best_model", "accuracy"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/demo")
    parser.add_argument("--mlm_steps", type=int, default=400)
    parser.add_argument("--mlm_batch_size", type=int, default=8)
    parser.add_argument("--mlm_probability", type=float, default=0.3)
    parser.add_argument("--cls_epochs", type=float, default=1)
    parser.add_argument("--cls_learning_rate", type=float, default=3e-4)
    parser.add_argument("--cls_batch_size", type=int, default=8)
    parser.add_argument("--classifier_pooling", choices=("cls", "mean"), default="mean",
                        help="what the classifier reads: the mean of the passage's tokens, or [CLS]")
    parser.add_argument("--config_overrides", default=MODEL)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--figures_dir", default=None,
                        help="where the pictures go; default: OUTPUT_DIR/pictures (the README shows copies in docs/)")
    return parser


def chosen_examples(split, column: str, per_class: int, seed: int) -> list[dict]:
    """`per_class` test rows of each class, drawn at random (seeded) before any prediction is made."""
    rng = random.Random(seed)
    chosen = []
    for label in sorted(set(split["label"])):
        rows = [i for i, value in enumerate(split["label"]) if value == label]
        chosen += [split[i] for i in sorted(rng.sample(rows, min(per_class, len(rows))))]
    return [{"text": row[column], "label": row["label"], "play": row["play"]} for row in chosen]


def shorten(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[:width - 3].rsplit(" ", 1)[0] + " ..."


def main() -> None:
    args = build_parser().parse_args()
    out = Path(args.output_dir)
    figures_dir = Path(args.figures_dir) if args.figures_dir else out / "pictures"
    figures_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    banner("1/5 masked-LM pretraining on Shakespeare, blocks of 256 tokens")
    mlm = run_mlm.main(pretraining_arguments(out / "mlm", args))
    mlm_metrics = mlm["metrics"]
    mlm_seconds = time.time() - started
    mlm_evaluation = evaluation_seconds(mlm["trainer"].state.log_history)

    banner(f"2/5 fine-tuning: a passage {TASK}")
    cls_started = time.time()
    cls = run_classification.main(fine_tuning_arguments(out / "classifier", out / "mlm", args))
    metrics, split, raw, column = cls["metrics"], cls["final_split"], cls["raw"], cls["text_column"]
    trainer = cls["trainer"]
    cls_seconds = time.time() - cls_started
    cls_evaluation = evaluation_seconds(trainer.state.log_history)
    model_accuracy = metrics[f"{split}_accuracy"]
    majority_accuracy = metrics[f"{split}_majority_baseline_accuracy"]

    baseline_started = time.time()
    bag_of_words = bag_of_words_baseline(raw["train"][column], raw["train"]["label"], raw["validation"][column],
                                         raw["validation"]["label"], raw[split][column], raw[split]["label"])
    print(f"bag-of-words baseline (TF-IDF + logistic regression, C={bag_of_words.C:g} chosen on validation): "
          f"{split} accuracy {bag_of_words.test_accuracy:.3f}; a shuffled passage holds the same words as the "
          "original, so any model blind to word order is at chance here")
    baseline_seconds = time.time() - baseline_started

    banner("3/5 a Hub-ready folder, reloaded where roformer_hf is not installed")
    hub_ready = out / "hub-ready"
    trainer = cls["trainer"]
    trainer.model.save_pretrained(hub_ready)
    cls["tokenizer"].save_pretrained(hub_ready)
    print("files:", ", ".join(sorted(os.listdir(hub_ready))))
    names = trainer.model.config.id2label
    examples = chosen_examples(raw[split], column, EXAMPLES_PER_CLASS, args.seed)
    texts = [example["text"] for example in examples]
    reloaded = subprocess.run([sys.executable, "-c", RELOAD_ELSEWHERE, str(hub_ready), json.dumps(texts)],
                              capture_output=True, text=True, check=True)
    remote = json.loads(reloaded.stdout.strip().splitlines()[-1])
    print(f"reloaded as {remote['class']}")

    banner("4/5 pipelines")
    import transformers

    fill = transformers.pipeline("fill-mask", model=str(out / "mlm"), top_k=3)
    print("fill-mask (a model pretrained for minutes: expect frequent words that fit the grammar):")
    for line, predictions in zip(FILL_MASK_LINES, fill(FILL_MASK_LINES)):
        print(f"  {line}\n      -> " + ", ".join(f"{p['token_str']} ({p['score']:.2f})" for p in predictions))
    classify = transformers.pipeline("text-classification", model=trainer.model, tokenizer=cls["tokenizer"])
    local = classify(texts, truncation=True)  # cut at the model's trained length (tokenizer.model_max_length)
    print(f"text-classification on {EXAMPLES_PER_CLASS} test passages per class, drawn at random before predicting:")
    for example, here, there in zip(examples, local, remote["predictions"]):
        truth = names[example["label"]]
        verdict = "right" if here["label"] == truth else "WRONG"
        print(f"  {verdict:5} predicted {here['label']:<10} {here['score']:.2f} | true {truth:<10} ({example['play']})"
              f"\n        {shorten(example['text'])}")
        if here["label"] != there["label"] or abs(here["score"] - there["score"]) > 1e-4:
            raise SystemExit(f"the reloaded model disagrees: {here} vs {there}")
    print("the reloaded model (remote code) gives the same predictions")

    banner("5/5 model summary and pictures")
    print(roformer_hf.summary(trainer.model, seq_len=SEQ_LEN))
    mlm_history = mlm["trainer"].state.log_history
    written = [
        figures.plot_loss_curves({
            "masked-LM pretraining (kept: the last step)": (mlm_history, mlm["trainer"].state.global_step),
            "word-order fine-tuning (kept: best validation accuracy)": (trainer.state.log_history,
                                                                    trainer.state.best_global_step),
        }, figures_dir / "loss_curves.png"),
        figures.plot_rotary_decay(figures_dir / "rotary_decay.png"),
        figures.plot_rotary_rotation(figures_dir / "rotary_rotation.png"),
    ]
    print("pictures:", ", ".join(str(path) for path in written))

    banner("result")
    print(f"MLM validation perplexity {mlm_metrics['eval_perplexity']:.0f} with {args.mlm_probability:.0%} of the "
          f"tokens masked (a uniform guess over the vocabulary: "
          f"{mlm['trainer'].model.config.vocab_size}), masked-token accuracy {mlm_metrics['eval_accuracy']:.3f}; "
          f"{mlm['trainer'].state.global_step} pretraining steps")
    print(f"passage {TASK} ({split} plays: {', '.join(sorted(set(raw[split]['play'])))}): macro-F1 "
          f"{metrics[f'{split}_macro_f1']:.3f}; {trainer.state.global_step} fine-tuning steps")
    print(f"{split} accuracy: model {model_accuracy:.2f} | bag-of-words baseline {bag_of_words.test_accuracy:.2f} | "
          f"majority baseline {majority_accuracy:.2f}")
    print("time: " + time_split(time.time() - started, mlm_seconds - mlm_evaluation, cls_seconds - cls_evaluation,
                                mlm_evaluation + cls_evaluation + baseline_seconds))


if __name__ == "__main__":
    main()
