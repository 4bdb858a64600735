"""roformer_hf needs only its core requirements (setup.cfg's install_requires); the extras' packages are optional."""

import json
import subprocess

import torch
from helpers import PYTHON, block_imports, padded_batch, tiny_config

from roformer_hf import RoFormerForMaskedLM

# What the examples, summary and serve extras bring, none of which `import roformer_hf` may need.
EXTRAS_ONLY = ("accelerate", "datasets", "evaluate", "fastapi", "orjson", "ray", "sentence_transformers", "torchao",
               "torchinfo")

CORE_ONLY = block_imports(*EXTRAS_ONLY) + """
import json, sys, torch
import roformer_hf

model = roformer_hf.RoFormerForMaskedLM.from_pretrained(sys.argv[1]).eval()
ids, mask = (torch.tensor(t) for t in json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(ids, attention_mask=mask).logits
try:
    roformer_hf.summary(model)
    summary_error = None
except ImportError as error:
    summary_error = str(error)
print(json.dumps({"logits": logits.tolist(), "summary_error": summary_error}))
"""


def test_core_install_imports_and_runs_without_the_extras(tmp_path):
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    ids, mask = padded_batch([6, 3])
    result = subprocess.run([PYTHON, "-c", CORE_ONLY, str(tmp_path), json.dumps([ids.tolist(), mask.tolist()])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(torch.tensor(remote["logits"]), expected, atol=1e-6, rtol=0)
    assert "pip install roformer_hf[summary]" in remote["summary_error"]
