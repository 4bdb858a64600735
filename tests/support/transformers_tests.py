"""transformers' own model tests (`ModelTesterMixin`, in `tests/test_modeling_common.py` of its source distribution),
fetched from PyPI once and kept under `.transformers-tests/` (ignored by git).

The wheel does not ship transformers' tests; the sdist ships `tests/test_modeling_common.py` but not the two modules it
imports relatively, `tests/exporters/test_export.py` and `tests/generation/test_utils.py`. Those are replaced by empty
mixins, so the export and generation mixins' tests do not run here (the decoder's generation is tested against
transformers' `RoFormerForCausalLM` in test_decoder.py).

Run as a script (`make install` does) to fetch them ahead of the tests:

    python tests/support/transformers_tests.py
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

logger = logging.getLogger(__name__)

CACHE = Path(os.environ.get("ROFORMER_HF_TRANSFORMERS_TESTS", Path(__file__).resolve().parents[2] /
                            ".transformers-tests"))
PACKAGE = "transformers_sdist_tests"  # the name the fetched `tests/` folder is imported under
WANTED = ("tests/test_modeling_common.py",)
STAND_INS = {  # modules the sdist lacks, and the names test_modeling_common.py imports from them
    "exporters/test_export.py": "class ExportTesterMixin:\n    \"\"\"Stand-in: not in the sdist.\"\"\"\n",
    "generation/test_utils.py": "class GenerationTesterMixin:\n    \"\"\"Stand-in: not in the sdist.\"\"\"\n",
}


def folder(version: str = transformers.__version__) -> Path:
    return CACHE / version


def fetch(version: str = transformers.__version__, timeout: float = 300) -> Path:
    """The folder holding package `transformers_sdist_tests` for transformers `version`, downloading its sdist with pip
    when it is not there yet. Raises `RuntimeError` saying why when it cannot be had."""
    root = folder(version)
    package = root / PACKAGE
    if (package / "test_modeling_common.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
                   "--no-deps", "--quiet", "--timeout", "20", "--retries", "1", "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download of the transformers {version} sdist took over {timeout} s") from None
        archives = list(Path(tmp).glob("transformers-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip could not download the transformers {version} sdist from PyPI "
                               f"(exit {done.returncode}): {done.stderr.strip()[-500:]}")
        with tarfile.open(archives[0]) as archive:
            prefix = f"transformers-{version}/"
            staging = Path(tmp) / PACKAGE
            for name in WANTED:
                member = archive.getmember(prefix + name)
                target = staging / Path(name).name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.extractfile(member).read())
        # test_modeling_common.py is written last: a half-written cache never looks complete.
        package.mkdir(parents=True, exist_ok=True)
        for relative, text in STAND_INS.items():
            (package / relative).parent.mkdir(parents=True, exist_ok=True)
            (package / relative).write_text(text)
            (package / relative).with_name("__init__.py").touch()
        (package / "__init__.py").touch()
        for name in WANTED:
            (package / Path(name).name).write_bytes((staging / Path(name).name).read_bytes())
    return root


def import_common(version: str = transformers.__version__):
    """transformers' `tests/test_modeling_common.py` as a module (fetched when needed)."""
    root = str(fetch(version))
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    try:
        logger.info("transformers' model tests in %s", fetch())
    except RuntimeError as error:  # no PyPI here: the suite skips them, saying why
        logger.warning("%s", error)
