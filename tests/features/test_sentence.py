"""roformer_hf.sentence: saved folders carry sentence-transformers' module files, so `SentenceTransformer(folder)`
gives the embedding the model was made for (RoFormer-Sim: its pooler output, JunnYu's numbers; others: the pooling
stated, mean by default), equal to the model's own outputs on padded batches; folders that disagree with their
config are refused; `SentenceTransformerTrainer` trains a model with a contrastive loss, padding still skipped."""

import doctest
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import BLOCK_ROFORMER_HF, FIXTURES, PYTHON, TINY, WORDS, tiny_config
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Pooling

import roformer_hf
from roformer_hf import RoFormerForCausalLM, RoFormerForMaskedLM, RoFormerHFTokenizer, RoFormerModel
from roformer_hf.convert import convert_checkpoint
from roformer_hf.sentence import check_sentence_modules, sentence_pooling, write_sentence_modules

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SENTENCES = ["the king dies", "a queen loves the crown and the sword at night", "day", "the sword speaks"]
SIM = FIXTURES / "roformer_sim"


def tokenizer(words=WORDS) -> RoFormerHFTokenizer:
    return RoFormerHFTokenizer(vocab={token: i for i, token in enumerate(SPECIALS + list(words))})


def saved(folder, model, tok=None):
    model.save_pretrained(folder)
    (tok or tokenizer()).save_pretrained(folder)
    return folder


def files(folder: Path) -> dict[str, object]:
    """The sentence-transformers files of a folder, parsed: modules.json and the config of each module it lists."""
    modules = json.loads((folder / "modules.json").read_text())
    names = ["modules.json", "sentence_bert_config.json", *(f"{m['path']}/config.json" for m in modules if m["path"])]
    return {name: json.loads((folder / name).read_text()) for name in names}


def padded(texts=SENTENCES, tok=None):
    return (tok or tokenizer())(texts, padding=True, return_tensors="pt")


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


# --- RoFormer-Sim: the pooler output ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_folder(tmp_path_factory):
    """JunnYu's RoFormer-Sim folder (tests/support/fixtures/roformer_sim) with a tokenizer of its 50 ids, converted."""
    source = tmp_path_factory.mktemp("sim_source")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(SIM / name, source / name)
    tokenizer([f"w{i}" for i in range(50 - len(SPECIALS))]).save_pretrained(source)
    return convert_checkpoint(source, tmp_path_factory.mktemp("sim") / "converted")


def test_converted_roformer_sim_embeds_with_junnyus_pooler_output(sim_folder):
    """The converter writes a Transformer module reading `pooler_output`; sentence-transformers' modules then give,
    on JunnYu's padded batch, JunnYu's pooler output within 1e-5."""
    modules = json.loads((sim_folder / "modules.json").read_text())
    assert [module["type"].rpartition(".")[2] for module in modules] == ["Transformer"]
    config = json.loads((sim_folder / "sentence_bert_config.json").read_text())
    assert config["modality_config"]["text"]["method_output_name"] == "pooler_output"
    assert config["module_output_name"] == "sentence_embedding"

    model = SentenceTransformer(str(sim_folder), device="cpu")
    assert type(model[0].model) is RoFormerModel and model[0].model.config.prefix_lm
    refs = load_file(SIM / "references.safetensors")
    features = {name: refs[name] for name in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        embeddings = model(features)["sentence_embedding"]
    torch.testing.assert_close(embeddings, refs["pooler_output"], atol=1e-5, rtol=0)


def test_sim_encode_equals_the_models_pooler_output_on_a_padded_batch(sim_folder):
    """`SentenceTransformer.encode` (sorted, batched) equals the causal LM's own `pooler_output` on one padded
    batch, and `similarity` is the cosine of those."""
    texts = ["w1 w2 w3 w4 w5 w6 w7", "w9", "w10 w11 w12", "w40 w41 w42 w43 w44"]
    model = SentenceTransformer(str(sim_folder), device="cpu")
    causal = RoFormerForCausalLM.from_pretrained(sim_folder).eval()
    batch = padded(texts, RoFormerHFTokenizer.from_pretrained(sim_folder))
    assert (batch["attention_mask"] == 0).any()
    with torch.no_grad():
        expected = causal(**batch).pooler_output
    actual = model.encode(texts, convert_to_tensor=True, batch_size=3)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    scores = model.similarity(actual[:2], actual[2:])
    torch.testing.assert_close(scores, F.normalize(expected[:2], dim=-1) @ F.normalize(expected[2:], dim=-1).T,
                               atol=1e-5, rtol=0)


# --- other models: the pooling stated, mean by default ----------------------------------------------------------


def test_default_is_mean_pooling_equal_to_the_models_masked_mean(tmp_path):
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config(vocab_size=len(SPECIALS) + len(WORDS))).eval()
    folder = saved(tmp_path / "mlm", model)
    assert sentence_pooling(model.config) == "mean"
    sentence_model = SentenceTransformer(str(folder), device="cpu")
    batch = padded()
    with torch.no_grad():
        expected = masked_mean(model.roformer(**batch).last_hidden_state, batch["attention_mask"])
    torch.testing.assert_close(sentence_model.encode(SENTENCES, convert_to_tensor=True), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["cls", "pooler"])
def test_the_pooling_the_config_states_with_normalize(tmp_path, pooling):
    """`config.sentence_pooling` and `config.sentence_normalize` (saved in config.json) choose the modules."""
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config(vocab_size=len(SPECIALS) + len(WORDS), add_pooling_layer=True,
                                      sentence_pooling=pooling, sentence_normalize=True)).eval()
    folder = saved(tmp_path / pooling, model)
    kinds = [module["type"].rpartition(".")[2] for module in json.loads((folder / "modules.json").read_text())]
    assert kinds == (["Transformer", "Normalize"] if pooling == "pooler" else ["Transformer", "Pooling", "Normalize"])
    batch = padded()
    with torch.no_grad():
        out = model(**batch)
    expected = out.pooler_output if pooling == "pooler" else out.last_hidden_state[:, 0]
    actual = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(actual, F.normalize(expected, dim=-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling, normalize", [("mean", False), ("weightedmean", True), ("pooler", False)])
def test_written_files_are_those_sentence_transformers_writes(tmp_path, pooling, normalize):
    """The files equal, parsed, those sentence-transformers' own `save` writes for the same modules."""
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config(vocab_size=len(SPECIALS) + len(WORDS), add_pooling_layer=True))
    folder = saved(tmp_path / "ours", model)
    write_sentence_modules(model, folder, pooling=pooling, normalize=normalize, overwrite=True)
    if pooling == "pooler":
        modules = [Transformer(str(folder), module_output_name="sentence_embedding",
                               modality_config={"text": {"method": "forward", "method_output_name": "pooler_output"}})]
    else:
        modules = [Transformer(str(folder)), Pooling(TINY["hidden_size"], pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "theirs"))
    assert files(folder) == files(tmp_path / "theirs")


# --- what is refused ----------------------------------------------------------------------------------------------


def test_a_pooling_the_model_does_not_have_is_refused(tmp_path):
    model = RoFormerModel(tiny_config())
    with pytest.raises(ValueError, match=r"pooling='pooler', but this model has no pooler \(config.add_pooling_layer"):
        sentence_pooling(model.config, "pooler")
    with pytest.raises(ValueError, match=r"pooling='sum': expected one of \('pooler', 'cls'"):
        write_sentence_modules(model, tmp_path, pooling="sum")
    model.config.sentence_pooling = "pooler"
    with pytest.raises(ValueError, match="config.sentence_pooling='pooler', but this model has no pooler"):
        model.save_pretrained(tmp_path / "refused")


def test_folders_whose_modules_disagree_with_the_config_are_refused_on_load(tmp_path):
    torch.manual_seed(0)
    with_pooler = RoFormerModel(tiny_config(vocab_size=len(SPECIALS) + len(WORDS), add_pooling_layer=True))
    folder = saved(tmp_path / "pooler", with_pooler)
    write_sentence_modules(with_pooler, folder, pooling="pooler", overwrite=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "add_pooling_layer": False}))
    message = "read the model's pooler_output, but its config says add_pooling_layer=False"
    with pytest.raises(ValueError, match=message):
        RoFormerModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=message):
        SentenceTransformer(str(folder), device="cpu")

    mean_folder = saved(tmp_path / "mean", RoFormerModel(tiny_config(vocab_size=len(SPECIALS) + len(WORDS))))
    pooling_file = mean_folder / "1_Pooling" / "config.json"
    pooling_file.write_text(json.dumps({**json.loads(pooling_file.read_text()), "embedding_dimension": 64}))
    with pytest.raises(ValueError, match="embedding_dimension=64, but the model's hidden_size is 32"):
        SentenceTransformer(str(mean_folder), device="cpu")

    stated = saved(tmp_path / "stated", RoFormerModel(tiny_config(vocab_size=len(SPECIALS) + len(WORDS))))
    config = json.loads((stated / "config.json").read_text())
    (stated / "config.json").write_text(json.dumps({**config, "sentence_pooling": "cls"}))
    with pytest.raises(ValueError, match="describes pooling='mean', but config.sentence_pooling='cls'"):
        RoFormerModel.from_pretrained(stated)


def test_existing_modules_are_kept_and_checked_on_save(tmp_path):
    """A folder's own modules.json is kept (sentence-transformers' save, a converted folder's); a request it
    contradicts raises instead of being silently ignored."""
    torch.manual_seed(0)
    model = RoFormerModel(tiny_config(vocab_size=len(SPECIALS) + len(WORDS)))
    folder = saved(tmp_path / "kept", model)
    write_sentence_modules(model, folder, pooling="max", overwrite=True)
    before = files(folder)
    model.save_pretrained(folder)
    assert files(folder) == before
    assert write_sentence_modules(model, folder, pooling="max") == []
    with pytest.raises(ValueError, match="describes pooling='max', but pooling='cls'"):
        write_sentence_modules(model, folder, pooling="cls")
    write_sentence_modules(model, folder, pooling="cls", overwrite=True)
    check_sentence_modules(folder, model.config, "cls")


@pytest.mark.parametrize("function", [sentence_pooling, write_sentence_modules])
def test_docstring_example_runs(function):
    blocks = re.findall(r"```python\n(.*?)```", function.__doc__, flags=re.DOTALL)
    test = doctest.DocTestParser().get_doctest("".join(blocks), {}, function.__name__, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


# --- training with sentence-transformers ------------------------------------------------------------------------


def test_sentence_transformers_trainer_with_a_contrastive_loss_skips_padding(tmp_path):
    """`SentenceTransformerTrainer` with MultipleNegativesRankingLoss trains a roformer_hf model: the loss on the
    training pairs falls, and every layer receives exactly the batch's real tokens, side by side (the varlen
    layout), never its padding."""
    torch.manual_seed(0)
    folder = saved(tmp_path / "base", RoFormerModel(tiny_config(vocab_size=len(SPECIALS) + len(WORDS))))
    model = SentenceTransformer(str(folder), device="cpu")
    rng = torch.Generator().manual_seed(0)

    def sentence() -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(2, 9, (1,),
                                                                                             generator=rng)),),
                                                             generator=rng).tolist())
    anchors = [sentence() for _ in range(32)]
    pairs = Dataset.from_dict({"anchor": anchors, "positive": [a + " " + sentence() for a in anchors]})
    loss = MultipleNegativesRankingLoss(model)

    def pair_loss() -> float:
        with torch.no_grad():
            a = model.encode(anchors, convert_to_tensor=True)
            p = model.encode(list(pairs["positive"]), convert_to_tensor=True)
        return F.cross_entropy(20 * F.normalize(a, dim=-1) @ F.normalize(p, dim=-1).T, torch.arange(32)).item()

    seen = []  # (real tokens in the batch, whether it had padding, the first layer's input shape, the layout's mode)
    encoder = model[0].model
    real = {}
    hooks = [
        model[0].register_forward_pre_hook(  # sentence-transformers' Transformer module, given the tokenized batch
            lambda module, args: real.update(n=int(args[0]["attention_mask"].sum()),
                                             padded=bool((args[0]["attention_mask"] == 0).any()))),
        encoder.encoder.layer[0].register_forward_pre_hook(
            lambda module, args: seen.append((real["n"], real["padded"], tuple(args[0].shape), args[1].layout.mode))),
    ]
    before = pair_loss()
    seen.clear()
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=12, per_device_train_batch_size=8, learning_rate=3e-3,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", seed=0, warmup_steps=0)
    SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs, loss=loss).train()
    for hook in hooks:
        hook.remove()
    assert pair_loss() < 0.8 * before
    assert len(seen) >= 24  # anchors and positives of 12 steps
    assert sum(padded for _, padded, _, _ in seen) >= len(seen) // 2  # most batches had padding to skip
    for tokens, _, shape, mode in seen:
        assert mode == "varlen" and shape == (tokens, TINY["hidden_size"])
    assert roformer_hf.RoFormerModel is type(encoder)


REMOTE = BLOCK_ROFORMER_HF + """
import json, sys
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu", trust_remote_code=True)
print(json.dumps({"module": type(model[0].model).__module__,
                  "embeddings": model.encode(json.loads(sys.argv[2])).tolist()}))
"""


def test_sentence_transformers_without_the_package_reads_the_same_embedding(tmp_path):
    """With `trust_remote_code=True` and no roformer_hf installed, the folder's own code and module files give the
    pooler output too."""
    torch.manual_seed(0)
    model = RoFormerForCausalLM(tiny_config(vocab_size=len(SPECIALS) + len(WORDS), is_decoder=True, prefix_lm=True,
                                            add_pooling_layer=True, initializer_range=0.2)).eval()
    folder = saved(tmp_path / "sim", model)
    result = subprocess.run([PYTHON, "-c", REMOTE, str(folder), json.dumps(SENTENCES)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    assert remote["module"].startswith("transformers_modules.")
    with torch.no_grad():
        expected = model(**padded()).pooler_output
    torch.testing.assert_close(torch.tensor(remote["embeddings"]), expected, atol=1e-5, rtol=0)
