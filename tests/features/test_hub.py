"""Tests of roformer_hf.hub: model cards, and a push to / load from a local Hub server by the real client.

Each Hub client runs in its own process, since huggingface_hub reads HF_ENDPOINT once, at import.
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import BLOCK_ROFORMER_HF
from huggingface_hub import ModelCard

from roformer_hf import (
    RoFormerConfig,
    RoFormerForMaskedLM,
    RoFormerForMultipleChoice,
    RoFormerForSequenceClassification,
)
from roformer_hf.hub import model_card_text, write_model_card

REPO = "user/tiny-roformer"
TEXTS = ["now is the winter of our discontent", "to be or not to be"]  # unequal lengths: one is padded
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
CLIENT_TIMEOUT_S = 240

PUSH = """
import json, sys
import torch
from transformers import BertTokenizerFast
from roformer_hf import RoFormerConfig, RoFormerForSequenceClassification

repo, vocab_dir, texts, tiny = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
torch.manual_seed(0)
tokenizer = BertTokenizerFast.from_pretrained(vocab_dir)
# A wide initialisation gives logits far apart, so a model that was not loaded would be noticed.
config = RoFormerConfig(vocab_size=len(tokenizer), num_labels=3, initializer_range=0.2, **tiny)
model = RoFormerForSequenceClassification(config).eval()
model.push_to_hub(repo)
tokenizer.push_to_hub(repo)
inputs = tokenizer(texts, padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**inputs).logits
print("RESULT", json.dumps({"input_ids": inputs["input_ids"].tolist(), "logits": logits.tolist()}))
"""

# The model must come from the code stored in the repo, not from an installed roformer_hf.
LOAD = BLOCK_ROFORMER_HF + """
import json, sys

try:
    import roformer_hf
    blocked = False
except ImportError:
    blocked = True

import hashlib, os
import torch
from huggingface_hub import hf_hub_download, snapshot_download
from transformers import AutoModelForSequenceClassification, AutoTokenizer

repo, texts = sys.argv[1], json.loads(sys.argv[2])
snapshot = snapshot_download(repo)
digests = {os.path.relpath(os.path.join(folder, name), snapshot):  # sentence-transformers' modules are in subfolders
           hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
           for folder, _, names in os.walk(snapshot) for name in names}
config_path = hf_hub_download(repo, "config.json")
model = AutoModelForSequenceClassification.from_pretrained(repo, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
inputs = tokenizer(texts, padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**inputs).logits
print("RESULT", json.dumps({
    "input_ids": inputs["input_ids"].tolist(), "logits": logits.tolist(), "blocked": blocked,
    "snapshot": digests, "config_in_snapshot": os.path.dirname(config_path) == snapshot,
    "model_module": type(model).__module__, "imported": sorted(m for m, module in sys.modules.items()
                     if m.split(".")[0] == "roformer_hf" and module is not None),
}))
"""

OWN_CARD = """
import sys
from huggingface_hub import HfApi
from roformer_hf import RoFormerConfig, RoFormerForMaskedLM

repo, card = sys.argv[1], sys.argv[2]
api = HfApi()
api.create_repo(repo)
api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=repo)
model = RoFormerForMaskedLM(RoFormerConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=4, intermediate_size=64))
model.push_to_hub(repo)
"""


def run_client(script: str, args: list[str], hub_url: str, tmp_path, block_package_path: bool = False) -> dict:
    """Run `script` in a fresh Python with the local Hub as endpoint; return its RESULT line as JSON."""
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_TOKEN": "dummy", "HF_HOME": str(tmp_path / "hf_home"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    assert done.returncode == 0, f"client failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    results = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(results[-1]) if results else {}


@pytest.fixture
def vocab_dir(tmp_path):
    """A tiny WordPiece vocabulary; `BertTokenizerFast.from_pretrained(vocab_dir)` reads it."""
    words = sorted({word for text in TEXTS for word in text.split()})
    folder = tmp_path / "vocab"
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return folder


def test_push_then_load_with_remote_code_only(hub_server, local_hub, vocab_dir, tmp_path):
    pushed = run_client(PUSH, [REPO, str(vocab_dir), json.dumps(TEXTS), json.dumps(TINY)], hub_server, tmp_path)
    loaded = run_client(LOAD, [REPO, json.dumps(TEXTS)], hub_server, tmp_path)

    assert loaded["blocked"] and loaded["imported"] == []
    assert loaded["model_module"].startswith("transformers_modules.")
    assert 1 not in pushed["input_ids"][0]  # every word is in the vocabulary, no [UNK]
    assert loaded["input_ids"] == pushed["input_ids"]
    pushed_logits, loaded_logits = torch.tensor(pushed["logits"]), torch.tensor(loaded["logits"])
    assert (pushed_logits[0] - pushed_logits[1]).abs().max() > 1e-3  # the comparison below means something
    torch.testing.assert_close(loaded_logits, pushed_logits, rtol=0, atol=1e-6)

    files = local_hub.files(REPO)
    assert loaded["snapshot"] == {name: hashlib.sha256(content).hexdigest() for name, content in files.items()}
    assert loaded["config_in_snapshot"]
    assert {"model.safetensors", "config.json", "modeling.py", "configuration.py", "README.md",
            "tokenizer.json"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-classification"
    assert {"roformer_hf", "roformer", "rotary"} <= set(card.data.tags)
    assert f'AutoModelForSequenceClassification.from_pretrained("{REPO}", trust_remote_code=True)' in card.text
    assert local_hub.unknown_requests == []


def test_push_keeps_a_model_card_already_on_the_hub(hub_server, local_hub, tmp_path):
    own_card = "---\nlicense: mit\n---\n\n# Written by hand\n"
    run_client(OWN_CARD, ["user/has-card", own_card], hub_server, tmp_path)
    files = local_hub.files("user/has-card")
    assert files["README.md"].decode() == own_card
    assert "model.safetensors" in files


@pytest.mark.parametrize(("model_class", "auto_class", "pipeline_tag"), [
    (RoFormerForMaskedLM, "AutoModelForMaskedLM", "fill-mask"),
    (RoFormerForSequenceClassification, "AutoModelForSequenceClassification", "text-classification"),
    (RoFormerForMultipleChoice, "AutoModelForMultipleChoice", None),
])
def test_model_card_describes_each_head(model_class, auto_class, pipeline_tag):
    model = model_class(RoFormerConfig(vocab_size=100, **TINY))
    card = ModelCard(model_card_text(model, repo_id="me/my-model", metrics={"accuracy": 0.8125}))
    assert card.data.pipeline_tag == pipeline_tag
    assert card.data.license == "apache-2.0"
    assert f'{auto_class}.from_pretrained("me/my-model", trust_remote_code=True)' in card.text
    assert f"| parameters | {model.num_parameters():,} |" in card.text
    assert "| accuracy | 0.8125 |" in card.text


def test_save_pretrained_writes_a_card_but_never_replaces_one(tmp_path):
    model = RoFormerForSequenceClassification(RoFormerConfig(vocab_size=100, num_labels=2, **TINY))
    model.save_pretrained(tmp_path / "fresh")
    assert ModelCard.load(tmp_path / "fresh" / "README.md").data.pipeline_tag == "text-classification"

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes\n")
    model.save_pretrained(mine)
    assert (mine / "README.md").read_text() == "my notes\n"
    assert write_model_card(model, mine) is None


def test_write_model_card_needs_a_folder(tmp_path):
    model = RoFormerForMaskedLM(RoFormerConfig(vocab_size=100, **TINY))
    with pytest.raises(ValueError, match="save_directory"):
        write_model_card(model, tmp_path / "missing")
