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

import transformers

from roformer_hf import RoFormerConfig
from roformer_hf.convert import _head_class
from roformer_hf.modeling import HEADS

REFERENCE = Path(__file__).resolve().parent / "reference.md"
SMALL = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 64}
ANY_HEAD = ["each head"]  # a folder of any head: the row checks every one
# Each kind of checkpoint a user finds: a config.json of that kind, and how to load it.
CHECKPOINTS = (
    ("RoFormer (V1), transformers' `model_type: \"roformer\"`: `junnyu/roformer_chinese_base`, "
     "`roformer_chinese_small`, `roformer_chinese_char_base`, `roformer_chinese_char_small`",
     {"model_type": "roformer", "architectures": ["RoFormerForMaskedLM"]},
     "`python -m roformer_hf.convert SRC DST`, then the Auto classes on DST; or `{cls}.from_pretrained(SRC)`"),
    ("RoFormer-V2 (JunnYu's `junnyu/roformer_v2_chinese_char_base`, `roformer_v2_chinese_char_small`): "
     "`norm_type: \"rms_norm\"`, `use_bias: false`",
     {"model_type": "roformer", "architectures": ["RoFormerForMaskedLM"], "norm_type": "rms_norm",
      "use_bias": False, "hidden_act": "relu"},
     "the same: the config says V2, and V2 is built"),
    ("RoFormer-Sim (`junnyu/roformer_chinese_sim_char_base`, `roformer_chinese_sim_char_small`, "
     "`roformer_chinese_sim_char_ft_base`, `roformer_chinese_sim_char_ft_small`): `is_decoder`, `pooler_activation`",
     {"model_type": "roformer", "architectures": ["RoFormerForCausalLM"], "is_decoder": True,
      "pooler_activation": "linear"},
     "the same; `roformer_hf.similarity` for embeddings and `generate_similar`"),
    ("any of these with pickled weights only (`pytorch_model.bin`, older Hub repositories)",
     {"model_type": "roformer", "architectures": ["RoFormerForMaskedLM"]},
     "`python -m roformer_hf.convert SRC DST` only: it reads the pickle with `torch.load(weights_only=True)`; "
     "`from_pretrained` refuses pickles"),
    ("a roformer_hf folder (`save_pretrained`, the converter, `push_to_hub`)",
     {"model_type": "roformer_hf", "architectures": ANY_HEAD},
     "the Auto classes and pipelines (after `import roformer_hf`), or `trust_remote_code=True` without the "
     "package"),
)


def built_head(config: dict) -> tuple[type, RoFormerConfig]:
    """The class and config the converter and `from_pretrained` build from a config.json holding `config`."""
    with tempfile.TemporaryDirectory() as folder:  # the folder read as a user's would be
        (Path(folder) / "config.json").write_text(json.dumps({**SMALL, **config}), encoding="utf-8")
        return _head_class(Path(folder)), RoFormerConfig.from_pretrained(folder)


def checkpoint_rows() -> list[str]:
    rows = []
    for kind, config, loader in CHECKPOINTS:
        if config["architectures"] is ANY_HEAD:
            for each in HEADS:
                name = each.model_class.__name__
                if built_head({**config, "architectures": [name]})[0].__name__ != name:
                    raise ValueError(f"a roformer_hf folder of {name} is not built as {name}")
            rows.append(f"| {kind} | the head its config.json's `architectures` names | {loader} |")
            continue
        head, built = built_head(config)
        facts = [f"`{name}={getattr(built, name)!r}`" for name in ("norm_type", "use_bias", "is_decoder", "prefix_lm",
                                                                     "add_pooling_layer")
                 if getattr(built, name) != getattr(RoFormerConfig(**SMALL), name)]
        built_as = f"`{head.__name__}`" + (f" ({', '.join(facts)})" if facts else "")
        rows.append(f"| {kind} | {built_as} | {loader.format(cls=head.__name__)} |")
    return rows


def head_rows() -> list[str]:
    """Each head with its Auto class, the task its model card names on the Hub, and whether the installed transformers
    has a pipeline of that task (transformers 5 dropped some the Hub keeps)."""
    from transformers.pipelines import SUPPORTED_TASKS

    rows = []
    for head in HEADS:
        task = f"`{head.pipeline_tag}`" if head.pipeline_tag else "none (the Hub has no such task)"
        pipeline = "yes" if head.pipeline_tag in SUPPORTED_TASKS else "no"
        rows.append(f"| `{head.model_class.__name__}` | `{head.auto_class}` | {task} | {pipeline} |")
    return rows


# The functions a user calls, by module: each row says the first sentence of the function's docstring.
PUBLIC_FUNCTIONS = {
    "roformer_hf": ("RoFormerHFTokenizer", "train_tokenizer", "summary"),
    "roformer_hf.convert": ("convert_checkpoint",),
    "roformer_hf.quantization": ("quantize_int8", "int8_kernel_available"),
    "roformer_hf.similarity": ("embedder", "encode", "similarity", "generate_similar"),
    "roformer_hf.sentence": ("sentence_pooling", "sentence_dimensions", "sentence_prompts"),
}


def first_sentence(obj) -> str:
    """The first sentence of `obj`'s docstring, on one line."""
    text = " ".join(inspect.getdoc(obj).split("\n\n", 1)[0].split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    return (match.group(1) if match else text).replace("|", "\\|")


def function_rows() -> list[str]:
    import importlib

    rows = []
    for module_name, names in PUBLIC_FUNCTIONS.items():
        module = importlib.import_module(module_name)
        for name in names:
            function = getattr(module, name)
            signature = f"{module_name}.{name}{inspect.signature(function)}".replace("'", "").replace("|", "\\|")
            rows.append(f"| `{signature}` | {first_sentence(function)} |")
    return rows


# Fields a config.json may hold beyond `RoFormerConfig`'s own, each with the function that reads it.
OPTIONAL_FIELDS = {"sentence_pooling": "roformer_hf.sentence.sentence_pooling",
                   "sentence_normalize": "roformer_hf.sentence.sentence_normalize",
                   "sentence_dimensions": "roformer_hf.sentence.sentence_dimensions"}


def optional_field_rows() -> list[str]:
    import importlib

    rows = []
    for field, path in OPTIONAL_FIELDS.items():
        module_name, _, name = path.rpartition(".")
        reader = getattr(importlib.import_module(module_name), name)
        if f'"{field}"' not in inspect.getsource(reader):
            raise ValueError(f"{path} no longer reads config.{field}: update OPTIONAL_FIELDS")
        rows.append(f"| `{field}` | `{path}` | {first_sentence(reader)} |")
    return rows


ATTENTION = (  # (value, the model class's flag that allows it, what runs)
    ("sdpa", "_supports_sdpa", "the default: PyTorch's `scaled_dot_product_attention`; on CPU each sequence in its own "
     "slice (padding skipped); with attention dropout in training, up to 512 tokens every head's weights at once in "
     "batched products, beyond in blocks that keep only the dropout mask"),
    ("eager", None, "the softmax written out; the only kernel that returns the weights (`output_attentions=True` "
     "takes it whatever was asked)"),
    ("flash_attention_2", "_supports_flash_attn", "flash-attn's kernels on GPU (the `flash-attn` package), padding "
     "skipped by its varlen kernel"),
    ("a name registered with `AttentionInterface`", "_supports_attention_backend", "a function of transformers' "
     "attention interface, called on the padded layout with a dense mask"),
)


def attention_rows() -> list[str]:
    from roformer_hf.modeling import RoFormerPreTrainedModel

    return [f"| `{value}` | {what} |" if not value.startswith("a ") else f"| {value} | {what} |"
            for value, flag, what in ATTENTION if flag is None or getattr(RoFormerPreTrainedModel, flag, False)]


def command_rows() -> list[str]:
    """Every option of each `roformer-hf` subcommand, from its parser."""
    from roformer_hf.cli import _parser

    rows = []
    for name, command in _parser()._subparsers._group_actions[0].choices.items():
        for action in command._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            flag = ", ".join(action.option_strings) or action.dest.upper()
            help_text = " ".join((action.help or "").split()).replace("|", "\\|")
            if "%(default)" in help_text:
                help_text = help_text % {"default": action.default}
            rows.append(f"| `roformer-hf {name}` | `{flag}` | {help_text} |")
    return rows


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
        "| class | Auto class | Hub task (the model card's `pipeline_tag`) | `pipeline()` of that task in "
        f"transformers {transformers.__version__} |",
        "| --- | --- | --- | --- |",
        *head_rows(),

        "",
        "## Attention implementations",
        "",
        "The values of `attn_implementation` (`from_pretrained`, `set_attn_implementation`) the model classes take.",
        "",
        "| `attn_implementation` | what runs |",
        "| --- | --- |",
        *attention_rows(),
        "",
        "## Functions",
        "",
        "| function | what it does |",
        "| --- | --- |",
        *function_rows(),
        "",
        "## The `roformer-hf` command",
        "",
        "Its options, from its parser (`roformer-hf serve --help`); [serving](serving.md) says how to use them.",
        "",
        "| command | option | what it does |",
        "| --- | --- | --- |",
        *command_rows(),
        "",
        "## Configuration fields",
        "",
        "`RoFormerConfig`'s fields, in the order of the class; every field of transformers' `RoFormerConfig` loads too.",
        "",
        "| field | type | default | meaning |",
        "| --- | --- | --- | --- |",
        *field_rows(),
        "",
        "Optional fields of config.json, for sentence embeddings (`SentenceTransformer(folder)`, `roformer_hf.similarity`, "
        "`roformer-hf serve`), each read by one function:",
        "",
        "| field | read by | what it says |",
        "| --- | --- | --- |",
        *optional_field_rows(),
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
