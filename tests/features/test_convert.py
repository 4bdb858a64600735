"""roformer_hf.convert: a folder of transformers' RoFormer becomes a folder that every loader reads as roformer_hf,
with transformers' outputs and tokenizer ids; pickled weights and non-empty destinations are refused."""

import doctest
import json
import os
import re
import subprocess

import pytest
import torch
import transformers
from helpers import BLOCK_ROFORMER_HF, FIXTURES, PYTHON, TINY

import roformer_hf
from roformer_hf.convert import convert_checkpoint
from roformer_hf.convert import main as convert_main
from roformer_hf.modeling import RoFormerPreTrainedModel

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["我们", "喜欢", "北京", "天气", "非常", "学习", "模型", "hello", "world", "rotary"]
TEXTS = ["我们喜欢北京的天气。", "hello rotary world", "今天天气非常好，我们学习模型！"]


def _vocab() -> dict[str, int]:
    chars = dict.fromkeys(ch for text in TEXTS + WORDS for ch in text if "\u4e00" <= ch <= "\u9fff")
    tokens = SPECIALS + list(chars) + list("，。！abcdefghijklmnopqrstuvwxyz") + WORDS
    return {token: index for index, token in enumerate(dict.fromkeys(tokens))}


VOCAB = _vocab()
CONFIG = {**TINY, "vocab_size": len(VOCAB)}


def _write_source(folder, head: str = "RoFormerForMaskedLM", **overrides):
    """A checkpoint folder as transformers' RoFormer writes it: model and (jieba) tokenizer."""
    torch.manual_seed(0)
    model = getattr(transformers, head)(transformers.RoFormerConfig(**{**CONFIG, **overrides})).eval()
    model.save_pretrained(folder)
    transformers.RoFormerTokenizer(vocab=VOCAB).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transformers")
    return folder, _write_source(folder)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return convert_checkpoint(source[0], tmp_path_factory.mktemp("converted") / "roformer_hf")


@pytest.fixture(scope="module")
def reference_tokenizer():
    # From a dict: transformers 5.23's RoFormerTokenizer(vocab_file=...) ignores the file.
    return transformers.RoFormerTokenizer(vocab=VOCAB)


def _batch(tokenizer, texts=TEXTS):
    return tokenizer(texts, padding=True, return_tensors="pt")


def _max_diff_on_real_tokens(a, b, mask) -> float:
    return (a - b).abs()[mask.bool()].max().item()


def test_auto_classes_load_roformer_hf_with_transformers_outputs(source, converted, reference_tokenizer):
    folder, reference = source
    # On the source folder transformers builds its own class, roformer_hf imported or not: that is intended.
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(folder)).__module__.startswith("transformers.")
    assert type(transformers.AutoTokenizer.from_pretrained(folder)) is transformers.RoFormerTokenizer

    config = json.loads((converted / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "roformer_hf" and config["auto_map"] == RoFormerPreTrainedModel.auto_map
    assert config["architectures"] == ["RoFormerForMaskedLM"]
    model = transformers.AutoModelForMaskedLM.from_pretrained(converted).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    assert type(model) is roformer_hf.RoFormerForMaskedLM
    assert type(tokenizer) is roformer_hf.RoFormerHFTokenizer and tokenizer.use_jieba
    assert tokenizer.model_max_length == model.config.max_position_embeddings  # pipelines truncate there

    batch = _batch(tokenizer)
    expected_batch = _batch(reference_tokenizer)
    assert batch["input_ids"].tolist() == expected_batch["input_ids"].tolist()
    assert tokenizer.tokenize(TEXTS[0])[:3] == ["我们", "喜欢", "北京"]  # jieba words, not characters
    with torch.no_grad():
        expected = reference(**expected_batch).logits
        actual = model(**batch).logits
    assert _max_diff_on_real_tokens(actual, expected, batch["attention_mask"]) < 1e-5


def test_fill_mask_pipeline_on_the_converted_folder(source, converted, reference_tokenizer):
    _, reference = source
    fill = transformers.pipeline("fill-mask", model=str(converted), top_k=3)
    assert type(fill.model) is roformer_hf.RoFormerForMaskedLM
    assert type(fill.tokenizer) is roformer_hf.RoFormerHFTokenizer
    text = "我们[MASK]北京的天气。"
    predictions = fill(text)
    encoded = reference_tokenizer(text, return_tensors="pt")
    position = encoded["input_ids"][0].tolist().index(reference_tokenizer.mask_token_id)
    with torch.no_grad():
        probabilities = reference(**encoded).logits[0, position].softmax(-1)
    top = probabilities.topk(3)
    assert [p["token"] for p in predictions] == top.indices.tolist()
    assert [p["score"] for p in predictions] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_sentence_transformers_style_loading(source, tmp_path):
    """sentence-transformers loads AutoConfig, AutoModel and AutoTokenizer from the folder; its own files (modules.json,
    the pooling folder) and the model card come along, weights in other formats do not."""
    folder, _ = source
    sentence_folder = tmp_path / "sentence"
    _write_source(sentence_folder)
    (sentence_folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (sentence_folder / "1_Pooling").mkdir()
    (sentence_folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (sentence_folder / "README.md").write_text("# A card someone wrote\n")
    torch.save({}, sentence_folder / "pytorch_model.bin")
    (sentence_folder / "tf_model.h5").write_bytes(b"stale")

    converted = convert_checkpoint(sentence_folder, tmp_path / "converted")
    assert (converted / "modules.json").read_text() == (sentence_folder / "modules.json").read_text()
    assert (converted / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert (converted / "README.md").read_text() == "# A card someone wrote\n"
    assert not (converted / "pytorch_model.bin").exists() and not (converted / "tf_model.h5").exists()

    config = transformers.AutoConfig.from_pretrained(converted)
    model = transformers.AutoModel.from_pretrained(converted, config=config).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    assert type(config) is roformer_hf.RoFormerConfig and type(model) is roformer_hf.RoFormerModel
    reference = transformers.RoFormerModel.from_pretrained(folder).eval()
    batch = _batch(tokenizer)
    with torch.no_grad():
        actual, expected = model(**batch).last_hidden_state, reference(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1)
    torch.testing.assert_close((actual * mask).sum(1) / mask.sum(1), (expected * mask).sum(1) / mask.sum(1),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("head, auto, overrides", [
    ("RoFormerForSequenceClassification", "AutoModelForSequenceClassification", {"num_labels": 3}),
    ("RoFormerModel", "AutoModel", {"rotary_value": True, "embedding_size": 24}),
])
def test_the_head_follows_the_source_architectures(tmp_path, head, auto, overrides):
    reference = _write_source(tmp_path / "src", head, **overrides)
    converted = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    model = getattr(transformers, auto).from_pretrained(converted).eval()
    assert type(model) is getattr(roformer_hf, head)
    batch = _batch(transformers.AutoTokenizer.from_pretrained(converted))
    with torch.no_grad():
        actual, expected = model(**batch)[0], reference(**batch)[0]
    assert actual.shape == expected.shape
    real = batch["attention_mask"].bool() if actual.dim() == 3 else slice(None)  # hidden states: real tokens
    torch.testing.assert_close(actual[real], expected[real], atol=1e-5, rtol=0)


REMOTE_SCRIPT = BLOCK_ROFORMER_HF + """
import json, sys, torch, transformers
folder, texts = sys.argv[1], json.loads(sys.argv[2])
model = transformers.AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
batch = tokenizer(texts, padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**batch).logits
assert not [name for name, module in sys.modules.items() if name.split(".")[0] == "roformer_hf" and module]
print(json.dumps({"modules": [type(model).__module__, type(tokenizer).__module__], "use_jieba": tokenizer.use_jieba,
                  "input_ids": batch["input_ids"].tolist(), "logits": logits.tolist()}))
"""


def test_trust_remote_code_without_roformer_hf(source, converted, reference_tokenizer, tmp_path):
    _, reference = source
    completed = subprocess.run([PYTHON, "-c", REMOTE_SCRIPT, str(converted), json.dumps(TEXTS)], capture_output=True,
                               text=True, timeout=300, cwd=tmp_path,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
                                    "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote = json.loads(completed.stdout.strip().splitlines()[-1])
    assert all(module.startswith("transformers_modules.") for module in remote["modules"])
    assert remote["use_jieba"]
    batch = _batch(reference_tokenizer)
    assert remote["input_ids"] == batch["input_ids"].tolist()
    with torch.no_grad():
        expected = reference(**batch).logits
    assert _max_diff_on_real_tokens(torch.tensor(remote["logits"]), expected, batch["attention_mask"]) < 1e-5


def _pickled_only(folder):
    """A folder of transformers' RoFormer whose weights are only in pytorch_model.bin (the published checkpoints)."""
    model = _write_source(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return model


def test_pickled_weights_are_refused_by_from_pretrained_which_names_the_converter(tmp_path):
    _pickled_only(tmp_path / "pickled")
    with pytest.raises(OSError, match=r"pickle \(pytorch_model\.bin\), which from_pretrained refuses to load.*"
                                      r"python -m roformer_hf\.convert .*weights_only=True") as loading:
        roformer_hf.RoFormerForMaskedLM.from_pretrained(tmp_path / "pickled")
    assert "no file named" not in str(loading.value)


def test_the_converter_reads_pickled_weights_into_what_the_safetensors_route_gives(tmp_path, reference_tokenizer):
    model = _pickled_only(tmp_path / "pickled")
    model.save_pretrained(tmp_path / "safe")  # the same weights as safetensors
    transformers.RoFormerTokenizer(vocab=VOCAB).save_pretrained(tmp_path / "safe")
    from_pickle = convert_checkpoint(tmp_path / "pickled", tmp_path / "from_pickle")
    from_safetensors = convert_checkpoint(tmp_path / "safe", tmp_path / "from_safetensors")
    assert (from_pickle / "model.safetensors").is_file() and not (from_pickle / "pytorch_model.bin").exists()
    batch = _batch(reference_tokenizer)
    with torch.no_grad():
        logits = [transformers.AutoModelForMaskedLM.from_pretrained(folder).eval()(**batch).logits
                  for folder in (from_pickle, from_safetensors)]
    assert torch.equal(*logits)


@pytest.mark.parametrize("fixture, head", [("roformer_v2/RoFormerForMaskedLM", "RoFormerForMaskedLM"),
                                           ("roformer_sim", "RoFormerForCausalLM")])
def test_pickled_roformer_v2_and_sim_checkpoints_convert_to_their_own_class(tmp_path, fixture, head):
    """JunnYu's RoFormer-V2 and RoFormer-Sim weights (tests/support/fixtures), as older Hub repositories hold them: pickled.
    The converter builds V2 (no norm weights, no biases) and Sim (prefix-LM, pooler), with the fixture's outputs."""
    from safetensors.torch import load_file

    source = FIXTURES / fixture
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((source / "config.json").read_text())
    weights = load_file(source / "model.safetensors")
    half = len(weights) // 2  # sharded, as large checkpoints are
    shards = {"pytorch_model-00001-of-00002.bin": dict(list(weights.items())[:half]),
              "pytorch_model-00002-of-00002.bin": dict(list(weights.items())[half:])}
    for name, shard in shards.items():
        torch.save(shard, pickled / name)
    (pickled / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {key: name for name, shard in shards.items() for key in shard}}))
    converted = getattr(transformers, "AutoModelForCausalLM" if head == "RoFormerForCausalLM" else
                        "AutoModelForMaskedLM").from_pretrained(convert_checkpoint(pickled, tmp_path / "dst")).eval()
    original = getattr(roformer_hf, head).from_pretrained(source).eval()
    assert type(converted) is getattr(roformer_hf, head)
    assert converted.config.norm_type == original.config.norm_type and \
        converted.config.prefix_lm == original.config.prefix_lm
    ids = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        new, old = converted(ids), original(ids)
    assert torch.equal(new.logits, old.logits)
    if head == "RoFormerForCausalLM":
        assert torch.equal(new.pooler_output, old.pooler_output)


class RunsCode:
    """What a malicious pickle carries: unpickling it calls `os.system`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_pickle_that_holds_more_than_tensors_is_refused_unread(tmp_path):
    folder = tmp_path / "pickled"
    _pickled_only(folder)
    ran = tmp_path / "code_ran"
    torch.save({**torch.load(folder / "pytorch_model.bin", weights_only=True), "payload": RunsCode(ran)},
               folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin holds more than tensors .*weights_only=True"):
        convert_checkpoint(folder, tmp_path / "dst")
    assert not ran.exists() and not (tmp_path / "dst").exists()
    torch.save([torch.zeros(2)], folder / "pytorch_model.bin")  # tensors, but not a state dict
    with pytest.raises(ValueError, match="holds a list: expected a state dict"):
        convert_checkpoint(folder, tmp_path / "dst")


def test_a_non_empty_destination_is_replaced_only_with_overwrite(source, tmp_path):
    folder, _ = source
    destination = tmp_path / "dst"
    destination.mkdir()
    (destination / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"is not empty: pass --overwrite"):
        convert_checkpoint(folder, destination)
    assert [path.name for path in destination.iterdir()] == ["keep.txt"]

    convert_checkpoint(folder, destination, overwrite=True)
    assert not (destination / "keep.txt").exists() and (destination / "model.safetensors").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dst"]  # no staging folder left behind


def test_command_line(source, tmp_path, capsys):
    folder, _ = source
    destination = tmp_path / "dst"
    destination.mkdir()
    (destination / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as refused:  # the command's `main`, in this process
        convert_main([str(folder), str(destination)])
    assert refused.value.code == 1 and "is not empty: pass --overwrite" in capsys.readouterr().err
    assert (destination / "keep.txt").exists()
    command = [PYTHON, "-m", "roformer_hf.convert", str(folder), str(destination)]
    done = subprocess.run([*command, "--overwrite"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(destination)) is roformer_hf.RoFormerForMaskedLM


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, r"model_type='bert': expected 'roformer'"),
    ({"architectures": ["RoFormerForPreTraining"]}, r"architectures=\['RoFormerForPreTraining'\]: expected one of"),
    ({"architectures": None}, r"architectures=None: expected one of"),
])
def test_unsupported_sources_are_refused(tmp_path, change, message):
    folder = tmp_path / "src"
    _write_source(folder)
    _edit_config(folder, **change)
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(folder, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_destination_inside_the_source_is_refused(tmp_path):
    folder = tmp_path / "src"
    _write_source(folder)
    with pytest.raises(ValueError, match="expected a folder outside src"):
        convert_checkpoint(folder, folder / "converted")
    with pytest.raises(ValueError, match="expected a folder outside src"):
        convert_checkpoint(folder, folder, overwrite=True)
    assert (folder / "model.safetensors").is_file()


def test_a_tokenizer_roformer_hf_cannot_read_is_refused(tmp_path):
    folder = tmp_path / "src"
    _write_source(folder)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "XLNetTokenizer"}))
    with pytest.raises(ValueError, match="tokenizer_class='XLNetTokenizer': expected one of"):
        convert_checkpoint(folder, tmp_path / "dst")


def test_docstring_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", convert_checkpoint.__doc__, flags=re.DOTALL)
    test = doctest.DocTestParser().get_doctest("".join(blocks), {}, "convert_checkpoint", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_roformer_sim_folder_converts_to_a_causal_lm_with_its_prefix_and_pooler(tmp_path):
    """JunnYu's RoFormer-Sim folder (tests/support/fixtures/roformer_sim) becomes a roformer_hf folder that the Auto class
    loads as the same model: prefix-LM, pooler, and the same first-pass logits."""
    source = FIXTURES / "roformer_sim"
    destination = convert_checkpoint(source, tmp_path / "sim")
    converted = transformers.AutoModelForCausalLM.from_pretrained(destination).eval()
    original = roformer_hf.RoFormerForCausalLM.from_pretrained(source).eval()
    assert type(converted) is roformer_hf.RoFormerForCausalLM
    assert json.loads((destination / "config.json").read_text())["prefix_lm"] is True
    ids = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, atol=0, rtol=0)
        torch.testing.assert_close(converted(ids).pooler_output, original(ids).pooler_output, atol=0, rtol=0)
