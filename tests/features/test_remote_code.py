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
ids, mask = (torch.tensor(t) for t in json.loads(sys.argv[1]))
for folder, auto in json.loads(sys.argv[2]):
    model = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)[0]
    model.save_pretrained(folder + "/again")  # the remote code saves too (no model card: that needs the package)
    print(json.dumps({"folder": folder, "module": type(model).__module__, "output": out.tolist()}))
"""
HEADS = {
    "AutoModelForSequenceClassification": RoFormerForSequenceClassification,
    "AutoModelForMaskedLM": RoFormerForMaskedLM,
    "AutoModelForTokenClassification": RoFormerForTokenClassification,
    "AutoModelForCausalLM": RoFormerForCausalLM,
}


@pytest.fixture(scope="module")
def loaded_elsewhere(tmp_path_factory):
    """Each head saved by the package, then loaded through its Auto class, run and saved again in one process where
    roformer_hf cannot be imported: {Auto class: (model, folder, what that process gave)}."""
    ids, mask = padded_batch([7, 4])
    saved = {}
    for auto, cls in HEADS.items():
        torch.manual_seed(0)
        decoder = {"is_decoder": True} if cls is RoFormerForCausalLM else {}
        model = cls(tiny_config(num_labels=3, norm_position="pre", rotary_layout="half", **decoder)).eval()
        folder = tmp_path_factory.mktemp(cls.__name__)
        model.save_pretrained(folder)
        saved[auto] = (model, folder)
    result = subprocess.run([PYTHON, "-c", LOAD_AND_RUN, json.dumps([ids.tolist(), mask.tolist()]),
                             json.dumps([(str(folder), auto) for auto, (_, folder) in saved.items()])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = {answer["folder"]: answer for answer in map(json.loads, result.stdout.strip().splitlines()[-len(HEADS):])}
    return {auto: (model, folder, remote[str(folder)]) for auto, (model, folder) in saved.items()}, (ids, mask)


@pytest.mark.parametrize("auto", HEADS)
def test_remote_code_loading_without_the_package(loaded_elsewhere, auto):
    heads, (ids, mask) = loaded_elsewhere
    model, folder, remote = heads[auto]
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == RoFormerPreTrainedModel.auto_map
    assert len(config["auto_map"]) == 8  # AutoConfig and the seven model classes
    for code_file in ("configuration.py", "modeling.py", "attention.py", "blocked_dropout.py", "cache.py", "masks.py",
                      "rotary.py", "padding.py", "loading.py"):
        assert (folder / code_file).exists(), code_file
    # The model's code and nothing else: what modeling.py imports, without the card and upload code (hub.py).
    code = {path.name for path in folder.glob("*.py")}
    modeling = Path(roformer_hf.modeling.__file__)
    assert code == {modeling.name, *(Path(f).name for f in get_relative_import_files(modeling))}
    assert "hub.py" not in code and "__init__.py" not in code
    assert (folder / "README.md").exists()  # the package wrote the card at save time

    assert remote["module"].startswith("transformers_modules.")  # really the copied code, not the package
    with torch.no_grad():
        expected = model(ids, attention_mask=mask)[0]
    torch.testing.assert_close(torch.tensor(remote["output"]), expected, atol=1e-6, rtol=0)
    assert {path.name for path in (folder / "again").glob("*.py")} == code
    # The copied loading.py has no hooks registered: no model card, no sentence-transformers modules.
    assert not (folder / "again" / "README.md").exists() and not (folder / "again" / "modules.json").exists()


def test_block_really_hides_the_package():
    script = BLOCK_ROFORMER_HF + "import importlib.util\nassert importlib.util.find_spec('roformer_hf') is None\n"
    result = subprocess.run([PYTHON, "-c", script + "import roformer_hf.modeling"], capture_output=True, text=True)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr and "'roformer_hf'" in result.stderr
