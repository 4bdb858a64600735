"""The example scripts end to end on tiny settings: real Trainer, real files, real processes."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time

import demo
import pytest
import run_classification
import run_mlm
import run_seq2seq
import safetensors.torch
import torch
import transformers
from helpers import BLOCK_ROFORMER_HF, EXAMPLES, PYTHON, free_port
from lib.config_overrides import parse_overrides
from lib.example_utils import vocabulary_hash

import roformer_hf

TINY_MODEL = "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64"
WORDS = {
    0: "merry wedding jest love dance sweet wench song feast fool laugh ring".split(),
    1: "king crown france war lord england battle throne arms duke herald army".split(),
}


def _sentence(rng: random.Random, label: int) -> str:
    common = "the a and of to my thou thee is".split()
    return " ".join(rng.choice(WORDS[label] if rng.random() < 0.5 else common) for _ in range(rng.randint(5, 14)))


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    for split, n in (("train", 400), ("validation", 60)):
        (folder / f"{split}.txt").write_text("\n".join(_sentence(rng, rng.randint(0, 1)) for _ in range(n)) + "\n")
    for split, n in (("train", 160), ("validation", 40), ("test", 40)):
        with open(folder / f"{split}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "genre"])
            for _ in range(n):
                label = rng.randint(0, 1)
                writer.writerow([_sentence(rng, label), ["comedy", "history"][label]])
    return folder


def _common(output_dir, **extra) -> list[str]:
    args = {"output_dir": str(output_dir), "use_cpu": "true", "report_to": "none", "seed": "7",
            "per_device_train_batch_size": "8", "per_device_eval_batch_size": "16", "logging_steps": "1",
            "disable_tqdm": "true", "do_train": "true", "do_eval": "true", "dataloader_num_workers": "0", **extra}
    return [item for key, value in args.items() for item in (f"--{key}", str(value))]


def _mlm_args(text_files, output_dir, **extra) -> list[str]:
    return _common(output_dir, train_file=text_files / "train.txt", validation_file=text_files / "validation.txt",
                   config_overrides=TINY_MODEL, tokenizer_vocab_size=120, max_seq_length=32, **extra)


@pytest.fixture(scope="module")
def pretrained(text_files, tmp_path_factory):
    """run_mlm.py from scratch: trains a tokenizer, then the model; the folder is reused by later tests."""
    output_dir = tmp_path_factory.mktemp("mlm")
    result = run_mlm.main(_mlm_args(text_files, output_dir, max_steps=6, save_steps=3, learning_rate=1e-3))
    return output_dir, result


def test_run_mlm_trains_tokenizer_and_model(pretrained):
    output_dir, result = pretrained
    metrics = result["metrics"]
    assert metrics["eval_perplexity"] == pytest.approx(torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-6)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["world_size"] == 1
    assert result["trainer"].state.global_step == 6
    model = transformers.AutoModelForMaskedLM.from_pretrained(output_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(output_dir)
    assert isinstance(model, roformer_hf.RoFormerForMaskedLM)
    assert isinstance(tokenizer, roformer_hf.RoFormerHFTokenizer)
    assert model.config.vocab_size == len(tokenizer) == 120
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    # The saved tokenizer truncates at the length the model was trained at (was: model_max_length 1e30).
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 32
    assert len(tokenizer("the king " * 100, truncation=True)["input_ids"]) == 32
    assert (output_dir / "checkpoint-3" / "model.safetensors").exists()


def test_resume_from_checkpoint_reaches_the_uninterrupted_result(pretrained, text_files, tmp_path):
    """A run stopped after step 3 (its checkpoint copied alone into a fresh folder) and resumed must end where
    the uninterrupted run ended."""
    output_dir, uninterrupted = pretrained
    shutil.copytree(output_dir / "checkpoint-3", tmp_path / "checkpoint-3")
    resumed = run_mlm.main(_mlm_args(text_files, tmp_path, max_steps=6, save_steps=3, learning_rate=1e-3,
                                     resume_from_checkpoint=tmp_path / "checkpoint-3"))
    assert resumed["trainer"].state.global_step == 6
    losses = {h["step"]: h["loss"] for h in resumed["trainer"].state.log_history if "loss" in h}
    expected = {h["step"]: h["loss"] for h in uninterrupted["trainer"].state.log_history if "loss" in h}
    for step in (4, 5, 6):
        assert losses[step] == pytest.approx(expected[step], abs=1e-5)
    assert resumed["metrics"]["eval_loss"] == pytest.approx(uninterrupted["metrics"]["eval_loss"], abs=1e-5)


def test_run_mlm_packing_gives_the_padded_evaluation(pretrained, text_files, tmp_path):
    """--packing (one padding-free row per batch): the same masked tokens and the same evaluation loss as padded
    batches, and training runs."""
    mlm_dir, _ = pretrained
    padded, packed = (run_mlm.main(_mlm_args(text_files, tmp_path / name, model_name_or_path=mlm_dir,
                                             tokenizer_name=mlm_dir, max_steps=2, packing=name))
                      for name in ("false", "true"))
    for key in ("eval_loss", "eval_accuracy"):
        assert packed["metrics"][key] == pytest.approx(padded["metrics"][key], abs=1e-5)
    batch = next(iter(packed["trainer"].get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert (batch["position_ids"] == 0).sum() == 8  # eight examples, positions restarting at each
    assert torch.isfinite(torch.tensor(packed["metrics"]["train_loss"]))


def test_run_classification_from_pretrained_folder(pretrained, text_files, tmp_path, capfd, caplog):
    mlm_dir, _ = pretrained
    with caplog.at_level("INFO", logger="run_classification"):
        result = run_classification.main(_common(
            tmp_path, model_name_or_path=mlm_dir, train_file=text_files / "train.csv",
            validation_file=text_files / "validation.csv", test_file=text_files / "test.csv",
            text_column_name="sentence", label_column_name="genre", max_seq_length=48, num_train_epochs=2,
            learning_rate=1e-3, classifier_pooling="mean"))
    # One line about the new head instead of transformers' load report (MISSING / UNEXPECTED table).
    assert "the new classifier head starts fresh (classifier.dense, classifier.out_proj)" in caplog.text
    assert "left out the checkpoint's cls weights" in caplog.text
    assert "UNEXPECTED" not in capfd.readouterr().err
    metrics = result["metrics"]
    assert result["final_split"] == "test"
    assert {"test_accuracy", "test_macro_f1", "test_majority_baseline_accuracy"} <= metrics.keys()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert model.config.id2label == {0: "comedy", 1: "history"} and model.config.classifier_pooling == "mean"
    # Fine-tuned on up to 48 tokens, longer than the 32 of pretraining: config and tokenizer say 48.
    assert model.config.max_position_embeddings == 48
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).model_max_length == 48
    # The encoder started from the pretrained weights: the [MASK] embedding, never seen in fine-tuning, is
    # exactly the pretrained one, while the embedding of a word of the data has moved.
    pretrained_model = transformers.AutoModelForMaskedLM.from_pretrained(mlm_dir)
    before = pretrained_model.roformer.embeddings.word_embeddings.weight
    after = model.roformer.embeddings.word_embeddings.weight
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert torch.equal(after[tokenizer.mask_token_id], before[tokenizer.mask_token_id])
    the = tokenizer("the", add_special_tokens=False)["input_ids"][0]
    assert not torch.equal(after[the], before[the])
    # The reported accuracy is the model's accuracy on the test file.
    with open(text_files / "test.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    batch = tokenizer([r["sentence"] for r in rows], padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        predictions = model.eval()(**batch).logits.argmax(-1)
    accuracy = sum(model.config.id2label[int(p)] == r["genre"] for p, r in zip(predictions, rows)) / len(rows)
    assert metrics["test_accuracy"] == pytest.approx(accuracy)


def test_run_classification_from_scratch_rejects_a_missing_label_column(text_files, tmp_path):
    with pytest.raises(ValueError, match="--label_column_name 'nope'"):
        run_classification.main(_common(tmp_path, train_file=text_files / "train.csv",
                                        label_column_name="nope", config_overrides=TINY_MODEL))


def _launch_two_processes(script_args: list[str], env: dict) -> subprocess.CompletedProcess:
    command = [PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(EXAMPLES / "run_mlm.py"), *script_args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)


def test_two_process_ddp_run_with_accelerate(text_files, tmp_path):
    """accelerate launch --multi_gpu runs two gloo ranks on CPU. Without --tokenizer_name the tokenizer is trained
    once, on rank 0, and rank 1 tokenizes with the same vocabulary (WordPiece training is not reproducible: two
    ranks training their own got two vocabularies)."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES), "OMP_NUM_THREADS": "1"}
    result = _launch_two_processes(
        _mlm_args(text_files, tmp_path, max_steps=3, ddp_find_unused_parameters="false", save_strategy="no",
                  log_level_replica="info"), env)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((tmp_path / "all_results.json").read_text())
    assert metrics["world_size"] == 2
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["train_batch_size"] == 8
    assert (tmp_path / "model.safetensors").exists()
    assert result.stderr.count("Training a 120-token WordPiece tokenizer") == 1
    hashes = re.findall(r"vocabulary sha256 ([0-9a-f]{16})", result.stderr)
    saved = vocabulary_hash(transformers.AutoTokenizer.from_pretrained(tmp_path))
    assert hashes == [saved, saved]  # one line per rank


FSDP2_TRAINING = """
import sys, torch, torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
import roformer_hf
from roformer_hf.modeling import RoFormerLayer

def build():
    torch.manual_seed(0)
    return roformer_hf.RoFormerForMaskedLM(roformer_hf.RoFormerConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

def train(model, rows):  # every token labelled and no padding: each rank's mean loss weighs alike
    ids = torch.randint(1, 97, (4, 12), generator=torch.Generator().manual_seed(1))[rows].contiguous()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # (Adam would blow rounding up on near-zero grads)
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sharded = build()
for module in sharded.modules():
    if isinstance(module, RoFormerLayer):
        fully_shard(module)
fully_shard(sharded)
weight = sharded.roformer.encoder.layer[0].intermediate.dense.weight
assert (world, weight.to_local().shape[0], weight.full_tensor().shape[0]) == (2, 24, 48), "not sharded"
train(sharded, slice(rank, None, world))  # half the batch on each rank
weights = {name: param.full_tensor().contiguous() for name, param in sharded.named_parameters()}
if rank == 0:
    single = build()
    train(single, slice(None))  # the whole batch in one process
    save_file(weights, sys.argv[1] + "/fsdp.safetensors")
    save_file({name: param.detach().contiguous() for name, param in single.named_parameters()},
              sys.argv[1] + "/single.safetensors")
    save_file({name: param.detach().contiguous() for name, param in build().named_parameters()},
              sys.argv[1] + "/initial.safetensors")
dist.destroy_process_group()
"""


def test_two_process_fsdp2_training_matches_one_process(tmp_path):
    """torch's FSDP2 on CPU (gloo): `fully_shard` on each RoFormerLayer and on the whole MLM model, two ranks with
    half the batch each, trains to the weights of one process on the whole batch."""
    script = tmp_path / "fsdp_train.py"
    script.write_text(FSDP2_TRAINING)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), str(script), str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-4000:]
    fsdp, single, initial = (safetensors.torch.load_file(tmp_path / f"{name}.safetensors")
                             for name in ("fsdp", "single", "initial"))
    assert fsdp.keys() == single.keys() and len(fsdp) > 30
    for name, value in single.items():
        assert not torch.equal(value, initial[name]) or "token_type" in name, name  # trained (type 1 never seen)
        torch.testing.assert_close(fsdp[name], value, atol=1e-6, rtol=0, msg=name)


def test_independent_cpu_processes_are_refused(text_files, tmp_path, monkeypatch):
    """Two processes launched (`WORLD_SIZE=2`, as `accelerate launch` and torchrun set it; the DDP test above launches
    real ranks) without --use_cpu on a machine without GPUs would each train alone, both writing tmp_path: the script
    stops before training, naming the flag."""
    if torch.cuda.is_available():
        pytest.skip("with GPUs the processes form one job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 processes were launched on a machine without GPUs, and "
                                         r"--use_cpu is not set"):
        run_mlm.main(_mlm_args(text_files, tmp_path, max_steps=3, use_cpu="false"))
    assert not (tmp_path / "model.safetensors").exists()


def test_summary_example_prints_layers(monkeypatch, capsys):
    import model_summary

    monkeypatch.setattr(sys, "argv", ["model_summary.py", "--config_overrides", TINY_MODEL + ",vocab_size=100",
                                      "--seq_len", "16"])
    model_summary.main()
    printed = capsys.readouterr().out
    assert "RoFormerLayer" in printed
    model = roformer_hf.RoFormerForMaskedLM(roformer_hf.RoFormerConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    assert f"Total params: {model.num_parameters():,}" in printed


def test_config_overrides_are_typed():
    overrides = parse_overrides("hidden_size=256, rotary_layout=half,rope_theta=1e6,sparse_prediction=True,")
    assert overrides == {"hidden_size": 256, "rotary_layout": "half", "rope_theta": 1e6, "sparse_prediction": True}
    assert [type(value) for value in overrides.values()] == [int, str, float, bool]
    assert parse_overrides(None) == parse_overrides("") == {}
    with pytest.raises(ValueError, match="'num_hidden_layers'"):
        parse_overrides("hidden_size=32,num_hidden_layers")


def test_run_mlm_push_to_hub_and_load_elsewhere(text_files, pretrained, hub_server, tmp_path):
    """--push_to_hub over real HTTP to a local Hub server; a process without roformer_hf loads the repo."""
    mlm_dir, _ = pretrained
    env = {**os.environ, "HF_ENDPOINT": hub_server, "HF_TOKEN": "dummy", "HF_HUB_DISABLE_TELEMETRY": "1",
           "PYTHONPATH": str(EXAMPLES)}
    env.pop("HF_HUB_OFFLINE", None)
    push = subprocess.run([PYTHON, str(EXAMPLES / "run_mlm.py"),
                           *_mlm_args(text_files, tmp_path / "out", max_steps=2, tokenizer_name=mlm_dir,
                                      save_strategy="no", push_to_hub="true", hub_model_id="user/roformer-mlm")],
                          capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert push.returncode == 0, push.stderr[-4000:]
    load = BLOCK_ROFORMER_HF + """
import json, torch, transformers
model = transformers.AutoModelForMaskedLM.from_pretrained("user/roformer-mlm", trust_remote_code=True).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained("user/roformer-mlm", trust_remote_code=True)
ids = tokenizer(["the king and the crown"], return_tensors="pt")
with torch.no_grad():
    print(json.dumps({"module": type(model).__module__, "ids": ids["input_ids"].tolist(),
                      "logits": model(**ids).logits[0, 1, :5].tolist()}))
"""
    loaded = subprocess.run([PYTHON, "-c", load], capture_output=True, text=True, timeout=300, env=env,
                            stdin=subprocess.DEVNULL)
    assert loaded.returncode == 0, loaded.stderr[-4000:]
    remote = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert remote["module"].startswith("transformers_modules.")
    local_model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out").eval()
    local_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = local_tokenizer(["the king and the crown"], return_tensors="pt")
    assert ids["input_ids"].tolist() == remote["ids"]
    with torch.no_grad():
        expected = local_model(**ids).logits[0, 1, :5]
    torch.testing.assert_close(torch.tensor(remote["logits"]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("task, names", [("word_order", ["as written", "shuffled"]),
                                         ("genre", ["comedies", "histories", "tragedies"])])
def test_run_classification_builtin_tasks(task, names):
    raw = run_classification.builtin_task(run_classification.ClassificationArguments(task=task, passage_words=150))
    assert raw["train"].features["label"].names == names
    assert not set(raw["train"]["play"]) & set(raw["test"]["play"])


def test_run_seq2seq_learns_pairs_and_generates(text_files, pretrained, tmp_path, capsys):
    """UniLM fine-tuning from run_mlm.py's encoder on source/target pairs: the evaluation loss ends below a uniform
    guess, and each printed example shows the line, the true next line and a generation."""
    rng = random.Random(1)
    for split, n in (("train", 120), ("validation", 16)):
        with open(text_files / f"pairs_{split}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["source", "target"])
            for _ in range(n):
                label = rng.randint(0, 1)
                writer.writerow([_sentence(rng, label), _sentence(rng, label)])
    mlm_dir, _ = pretrained
    result = run_seq2seq.main(_common(
        tmp_path, train_file=text_files / "pairs_train.csv", validation_file=text_files / "pairs_validation.csv",
        model_name_or_path=mlm_dir, max_seq_length=48, max_target_length=20, max_steps=20, learning_rate=3e-3,
        num_examples_to_print=3))
    vocabulary = len(result["tokenizer"])
    assert result["metrics"]["eval_loss"] < math.log(vocabulary) - 0.3  # a uniform guess: log(vocabulary)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model) is roformer_hf.RoFormerForCausalLM and model.config.prefix_lm
    printed = capsys.readouterr().out
    assert printed.count("next line:") == 3 and printed.count("generated:") == 3
    assert len(result["generations"]) == 3


def test_run_seq2seq_builtin_next_line_task(tmp_path, capsys):
    result = run_seq2seq.main(_common(tmp_path, config_overrides=TINY_MODEL, tokenizer_vocab_size=300,
                                      max_train_samples=64, max_eval_samples=16, max_steps=2, max_seq_length=64,
                                      num_examples_to_print=2))
    assert result["metrics"]["eval_loss"] > 0
    assert "next line:" in capsys.readouterr().out


def test_demo_time_split_counts_trainer_evaluations(text_files, tmp_path):
    """The demo's time report: `evaluation_seconds` reads the evaluations' seconds from a Trainer's log (here timed
    around two `evaluate()` calls made after training, which must be all it adds), and `time_split` gives the
    rest of the total as "the rest"."""
    result = run_mlm.main(_mlm_args(text_files, tmp_path, max_steps=2))
    trainer = result["trainer"]
    before = demo.evaluation_seconds(trainer.state.log_history)
    assert before > 0  # run_mlm's final evaluation
    start = time.perf_counter()
    trainer.evaluate()
    trainer.evaluate()
    elapsed = time.perf_counter() - start
    added = demo.evaluation_seconds(trainer.state.log_history) - before
    assert 0.5 * elapsed < added <= elapsed

    line = demo.time_split(600.0, pretraining=300.0, fine_tuning=150.0, evaluation=60.0)
    assert line == ("pretraining 5.0 min (50%) | fine-tuning 2.5 min (25%) | evaluation 1.0 min (10%) | "
                    "the rest 1.5 min (15%) | total 10.0 min")


def test_demo_command_lines_reach_the_scripts_as_given(tmp_path):
    """The demo's flags (`--mlm_batch_size`, `--mlm_probability`, `--cls_learning_rate`, ...) arrive in the
    arguments run_mlm.py and run_classification.py train with, and its model is built without dropout, classifying
    the mean of the token states."""
    from lib.example_utils import parse_arguments

    args = demo.build_parser().parse_args(["--mlm_steps", "7", "--mlm_batch_size", "3", "--mlm_probability", "0.25",
                                           "--cls_epochs", "1.5", "--cls_learning_rate", "3e-4"])
    model_args, _, mlm, training = parse_arguments(run_mlm.MLMArguments,
                                                   demo.pretraining_arguments(tmp_path / "mlm", args))
    assert (mlm.mlm_probability, training.per_device_train_batch_size, training.max_steps) == (0.25, 3, 7)
    overrides = parse_overrides(model_args.config_overrides)
    assert overrides["hidden_dropout_prob"] == 0 and overrides["attention_probs_dropout_prob"] == 0
    _, _, classification, training = parse_arguments(
        run_classification.ClassificationArguments,
        demo.fine_tuning_arguments(tmp_path / "cls", tmp_path / "mlm", args))
    assert (training.num_train_epochs, training.learning_rate) == (1.5, 3e-4)
    assert classification.classifier_pooling == "mean"
