#!/usr/bin/env python
"""The whole journey on built-in data, on a CPU in minutes (`make demo`):

1. pretrain a small RoFormer with masked LM on Shakespeare's spoken lines (a tokenizer is trained first);
2. fine-tune it to tell a speech's genre (comedy / history / tragedy; plays split between train/val/test);
3. evaluate on the test plays against the majority-class baseline;
4. save a Hub-ready folder (weights, tokenizer, code, model card) and reload it with
   AutoModelForSequenceClassification + trust_remote_code in a process where roformer_hf is blocked;
5. run the fill-mask and text-classification pipelines, print the torchinfo summary, plot the loss curves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import run_classification
import run_mlm

import roformer_hf

MODEL = "hidden_size=256,num_hidden_layers=4,num_attention_heads=4,intermediate_size=1024"
FILL_MASK_LINES = ["To be, or not to [MASK], that is the question.", "Now is the [MASK] of our discontent.",
                   "O Romeo, Romeo, wherefore art thou [MASK]?"]
CLASSIFY_LINES = ["Good my lord, the French are landed and the crown is in peril; to arms, to arms!",
                  "Come, sweet wench, let us be merry and dance at the wedding tonight.",
                  "O, I am slain! The poison works; farewell, and let the grave keep my sorrow."]

RELOAD_ELSEWHERE = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "roformer_hf":
            raise ImportError("roformer_hf is not installed here")
sys.meta_path.insert(0, _Block())
import json, transformers
folder, lines = sys.argv[1], json.loads(sys.argv[2])
model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
classify = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer)
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "predictions": classify(lines)}))
"""


def banner(text: str) -> None:
    print(f"\n{'=' * 8} {text} {'=' * max(0, 70 - len(text))}", flush=True)


def common_args(output_dir: Path, args) -> list[str]:
    return ["--output_dir", str(output_dir), "--use_cpu", "true",
            "--report_to", "none", "--seed", str(args.seed), "--logging_steps", "20", "--save_strategy", "no",
            "--dataloader_num_workers", "0", "--disable_tqdm", "false", "--do_train", "true", "--do_eval", "true"]


def plot_losses(histories: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(histories), figsize=(6 * len(histories), 4))
    for ax, (title, history) in zip(axes, histories.items()):
        train = [(h["step"], h["loss"]) for h in history if "loss" in h]
        evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
        if train:
            ax.plot(*zip(*train), label="train loss")
        if evals:
            ax.plot(*zip(*evals), "o-", label="validation loss")
        ax.set(title=title, xlabel="step", ylabel="loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/demo")
    parser.add_argument("--mlm_steps", type=int, default=800)
    parser.add_argument("--cls_epochs", type=float, default=2)
    parser.add_argument("--config_overrides", default=MODEL)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    out = Path(args.output_dir)
    started = time.time()

    banner("1/5 masked-LM pretraining on Shakespeare's lines")
    mlm = run_mlm.main(common_args(out / "mlm", args) + [
        "--config_overrides", args.config_overrides + ",sparse_prediction=true", "--tokenizer_vocab_size", "8000",
        "--max_seq_length", "64",
        "--max_steps", str(args.mlm_steps), "--per_device_train_batch_size", "64", "--learning_rate", "1e-3",
        "--warmup_steps", "60", "--weight_decay", "0.01", "--max_eval_samples", "2000",
        "--eval_strategy", "steps", "--eval_steps", str(max(1, args.mlm_steps // 4))])
    mlm_metrics = mlm["metrics"]

    banner("2/5 fine-tuning: which genre is this speech from?")
    cls = run_classification.main(common_args(out / "classifier", args) + [
        "--model_name_or_path", str(out / "mlm"), "--max_seq_length", "128", "--num_train_epochs",
        str(args.cls_epochs), "--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "64",
        "--learning_rate", "1e-4", "--warmup_steps", "50", "--weight_decay", "0.01",
        # Speeches of 17 plays overfit fast: evaluate every half epoch and keep the best checkpoint.
        "--eval_strategy", "steps", "--eval_steps", "94", "--save_strategy", "steps", "--save_steps", "94",
        "--save_total_limit", "1", "--load_best_model_at_end", "true", "--metric_for_best_model", "accuracy"])
    metrics, split = cls["metrics"], cls["final_split"]

    banner("3/5 a Hub-ready folder, reloaded where roformer_hf is not installed")
    hub_ready = out / "hub-ready"
    trainer = cls["trainer"]
    trainer.model.save_pretrained(hub_ready)
    cls["tokenizer"].save_pretrained(hub_ready)
    print("files:", ", ".join(sorted(os.listdir(hub_ready))))
    reloaded = subprocess.run([sys.executable, "-c", RELOAD_ELSEWHERE, str(hub_ready), json.dumps(CLASSIFY_LINES)],
                              capture_output=True, text=True, check=True)
    remote = json.loads(reloaded.stdout.strip().splitlines()[-1])
    print(f"reloaded as {remote['class']}")

    banner("4/5 pipelines")
    import transformers

    fill = transformers.pipeline("fill-mask", model=str(out / "mlm"), top_k=3)
    for line, predictions in zip(FILL_MASK_LINES, fill(FILL_MASK_LINES)):
        print(f"{line}\n    -> " + ", ".join(f"{p['token_str']} ({p['score']:.2f})" for p in predictions))
    classify = transformers.pipeline("text-classification", model=trainer.model, tokenizer=cls["tokenizer"])
    local = classify(CLASSIFY_LINES)
    for line, here, there in zip(CLASSIFY_LINES, local, remote["predictions"]):
        print(f"{here['label']:>9} {here['score']:.2f}  {line}")
        if here["label"] != there["label"] or abs(here["score"] - there["score"]) > 1e-5:
            raise SystemExit(f"the reloaded model disagrees: {here} vs {there}")
    print("the reloaded model (remote code) gives the same predictions")

    banner("5/5 model summary and loss curves")
    print(roformer_hf.summary(trainer.model, seq_len=128))
    plot_losses({"masked-LM pretraining": mlm["trainer"].state.log_history,
                 "genre fine-tuning": trainer.state.log_history}, out / "loss_curves.png")
    print(f"loss curves: {out / 'loss_curves.png'}")

    banner("result")
    print(f"MLM validation perplexity: {mlm_metrics['eval_perplexity']:.1f}, masked-token accuracy "
          f"{mlm_metrics['eval_accuracy']:.3f}")
    accuracy, baseline = metrics[f"{split}_accuracy"], metrics[f"{split}_majority_baseline_accuracy"]
    print(f"genre classification, {split} split: accuracy {accuracy:.3f}, macro-F1 {metrics[f'{split}_macro_f1']:.3f}"
          f"  vs majority-class baseline accuracy {baseline:.3f}")
    print(f"total time: {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
