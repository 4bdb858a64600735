"""Saved folders load with trust_remote_code=True in a process where roformer_hf is not installed."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import BLOCK_ROFORMER_HF, PYTHON, padded_batch, tiny_config
from transformers.dynamic_module_utils import get_relative_import_files

import roformer_hf.modeling
from roformer_hf import (
    RoFormerForCausalLM,
    RoFormerForMaskedLM,
    RoFormerForSequenceClassification,
    RoFormerForTokenClassification,
)
from roformer_hf.modeling import RoFormerPreTrainedModel

LOAD_AND_RUN = BLOCK_ROFORMER_HF + """
import json, sys, torch, transformers
auto = getattr(transformers, sys.argv[2])
model = auto.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids, mask = (torch.tensor(t) for t in json.loads(sys.argv[3]))
with torch.no_grad():
    out = model(ids, attention_mask=mask)[0]
model.save_pretrained(sys.argv[4])  # the remote code saves too (no model card: that needs the package)
print(json.dumps({"module": type(model).__module__, "output": out.tolist()}))
"""


@pytest.mark.parametrize("cls, auto", [
    (RoFormerForSequenceClassification, "AutoModelForSequenceClassification"),
    (RoFormerForMaskedLM, "AutoModelForMaskedLM"),
    (RoFormerForTokenClassification, "AutoModelForTokenClassification"),
    (RoFormerForCausalLM, "AutoModelForCausalLM"),
])
def test_remote_code_loading_without_the_package(tmp_path, cls, auto):
    torch.manual_seed(0)
    decoder = {"is_decoder": True} if cls is RoFormerForCausalLM else {}
    model = cls(tiny_config(num_labels=3, norm_position="pre", rotary_layout="half", **decoder)).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == RoFormerPreTrainedModel.auto_map
    assert len(config["auto_map"]) == 8  # AutoConfig and the seven model classes
    for code_file in ("configuration.py", "modeling.py", "attention.py", "blocked_dropout.py", "cache.py", "masks.py",
                      "rotary.py", "padding.py", "loading.py"):
        assert (tmp_path / code_file).exists(), code_file
    # The model's code and nothing else: what modeling.py imports, without the card and upload code (hub.py).
    code = {path.name for path in tmp_path.glob("*.py")}
    modeling = Path(roformer_hf.modeling.__file__)
    assert code == {modeling.name, *(Path(f).name for f in get_relative_import_files(modeling))}
    assert "hub.py" not in code and "__init__.py" not in code
    assert (tmp_path / "README.md").exists()  # the package wrote the card at save time

    ids, mask = padded_batch([7, 4])
    batch = json.dumps([ids.tolist(), mask.tolist()])
    result = subprocess.run([PYTHON, "-c", LOAD_AND_RUN, str(tmp_path), auto, batch, str(tmp_path / "again")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    assert remote["module"].startswith("transformers_modules.")  # really the copied code, not the package
    with torch.no_grad():
        expected = model(ids, attention_mask=mask)[0]
    torch.testing.assert_close(torch.tensor(remote["output"]), expected, atol=1e-6, rtol=0)
    assert {path.name for path in (tmp_path / "again").glob("*.py")} == code
    # The copied loading.py has no hooks registered: no model card, no sentence-transformers modules.
    assert not (tmp_path / "again" / "README.md").exists() and not (tmp_path / "again" / "modules.json").exists()


def test_block_really_hides_the_package():
    script = BLOCK_ROFORMER_HF + "import importlib.util\nassert importlib.util.find_spec('roformer_hf') is None\n"
    result = subprocess.run([PYTHON, "-c", script + "import roformer_hf.modeling"], capture_output=True, text=True)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr and "'roformer_hf'" in result.stderr
