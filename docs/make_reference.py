"""Writes docs/reference.md from the code, so that its tables cannot drift from it (tests/examples/test_docs.py compares).

    python docs/make_reference.py           # rewrite docs/reference.md
    python docs/make_reference.py --check   # exit 1 if docs/reference.md differs from what the code gives

The tables: which class and loader each kind of checkpoint takes (the class found by the converter's own reading of a
config.json of that kind), every head with its Auto class and pipeline task (`modeling.HEADS`), and every
`RoFormerConfig` field with its type, default and meaning (the class's annotations, defaults and the `Attributes:`
section of its docstring).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import tempfile
import typing
from pathlib import Path

from roformer_hf import RoFormerConfig
from roformer_hf.convert import _head_class
from roformer_hf.modeling import HEADS

REFERENCE = Path(__file__).resolve().parent / "reference.md"
SMALL = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 64}
# Each kind of checkpoint a user finds: a config.json of that kind, and how to load it.
CHECKPOINTS = (
    ("RoFormer (V1), transformers' `model_type: \"roformer\"`: `junnyu/roformer_chinese_base`, "
     "`roformer_chinese_char_small`",
     {"model_type": "roformer", "architectures": ["RoFormerForMaskedLM"]},
     "`python -m roformer_hf.convert SRC DST`, then the Auto classes on DST; or `{cls}.from_pretrained(SRC)`"),
    ("RoFormer-V2 (JunnYu's `junnyu/roformer_v2_chinese_char_base`): `norm_type: \"rms_norm\"`, `use_bias: false`",
     {"model_type": "roformer", "architectures": ["RoFormerForMaskedLM"], "norm_type": "rms_norm",
      "use_bias": False, "hidden_act": "relu"},
     "the same: the config says V2, and V2 is built"),
    ("RoFormer-Sim (`junnyu/roformer_chinese_sim_char_base`): `is_decoder`, `pooler_activation`",
     {"model_type": "roformer", "architectures": ["RoFormerForCausalLM"], "is_decoder": True,
      "pooler_activation": "linear"},
     "the same; `roformer_hf.similarity` for embeddings and `generate_similar`"),
    ("any of these with pickled weights only (`pytorch_model.bin`, older Hub repositories)",
     {"model_type": "roformer", "architectures": ["RoFormerForMaskedLM"]},
     "`python -m roformer_hf.convert SRC DST` only: it reads the pickle with `torch.load(weights_only=True)`; "
     "`from_pretrained` refuses pickles"),
    ("a roformer_hf folder (`save_pretrained`, the converter, `push_to_hub`)",
     {"model_type": "roformer_hf", "architectures": ["RoFormerForSequenceClassification"]},
     "the Auto classes and pipelines (after `import roformer_hf`), or `trust_remote_code=True` without the "
     "package"),
)


def checkpoint_rows() -> list[str]:
    rows = []
    for kind, config, loader in CHECKPOINTS:
        with tempfile.TemporaryDirectory() as folder:  # the folder read as a user's would be
            (Path(folder) / "config.json").write_text(json.dumps({**SMALL, **config}), encoding="utf-8")
            head = _head_class(Path(folder))
            built = RoFormerConfig.from_pretrained(folder)
        facts = [f"`{name}={getattr(built, name)!r}`" for name in ("norm_type", "use_bias", "is_decoder", "prefix_lm",
                                                                     "add_pooling_layer")
                 if getattr(built, name) != getattr(RoFormerConfig(**SMALL), name)]
        built_as = f"`{head.__name__}`" + (f" ({', '.join(facts)})" if facts else "")
        rows.append(f"| {kind} | {built_as} | {loader.format(cls=head.__name__)} |")
    return rows


def head_rows() -> list[str]:
    return [f"| `{head.model_class.__name__}` | `{head.auto_class}` | "
            f"{f'`{head.pipeline_tag}`' if head.pipeline_tag else 'none (the Hub has no such task)'} |"
            for head in HEADS]


def field_meanings() -> dict[str, str]:
    """The `Attributes:` section of `RoFormerConfig`'s docstring: each field's meaning, joined onto one line."""
    doc = inspect.getdoc(RoFormerConfig)
    section = doc.split("\nAttributes:\n", 1)[1].split("\n\n", 1)[0]
    meanings: dict[str, str] = {}
    for line in section.splitlines():
        if match := re.match(r"    (\w+): (.*)", line):
            name, text = match.groups()
            meanings[name] = text
        else:
            meanings[name] += " " + line.strip()
    return meanings


def type_name(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(value) for value in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def field_rows() -> list[str]:
    annotations = inspect.get_annotations(RoFormerConfig, eval_str=True)
    meanings = field_meanings()
    missing = [name for name in annotations if name not in meanings]
    if missing:
        raise ValueError(f"RoFormerConfig's docstring has no meaning for {missing}: add them to its Attributes section")
    rows = []
    for name, annotation in annotations.items():
        default = getattr(RoFormerConfig, name)
        meaning = meanings[name].replace("|", "\\|")
        rows.append(f"| `{name}` | {type_name(annotation)} | `{default!r}` | {meaning} |")
    return rows


def render() -> str:
    lines = [
        "# Reference",
        "",
        "Generated from the code by `python docs/make_reference.py` (`tests/examples/test_docs.py` fails when they disagree).",
        "",
        "## Which class and loader for which checkpoint",
        "",
        "The class is the one the converter (and `from_pretrained`) builds for a config.json of that kind.",
        "",
        "| checkpoint | built as | how to load it |",
        "| --- | --- | --- |",
        *checkpoint_rows(),
        "",
        "## Heads",
        "",
        "| class | Auto class | pipeline task |",
        "| --- | --- | --- |",
        *head_rows(),
        "",
        "## Configuration fields",
        "",
        "`RoFormerConfig`'s fields, in the order of the class; every field of transformers' `RoFormerConfig` loads too.",
        "",
        "| field | type | default | meaning |",
        "| --- | --- | --- | --- |",
        *field_rows(),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md differs from the code")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = REFERENCE.is_file() and REFERENCE.read_text(encoding="utf-8") == text
        print("docs/reference.md is up to date" if same else "docs/reference.md differs: run python docs/make_reference.py")
        return 0 if same else 1
    REFERENCE.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
