"""Loading and saving (roformer_hf/loading.py): truncated or incomplete checkpoints fail loudly; weights load only
through safetensors; tools plug in by registering hooks."""

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from helpers import padded_batch, tiny_config

import roformer_hf
from roformer_hf import RoFormerForMaskedLM, RoFormerForSequenceClassification, hub
from roformer_hf.loading import register_hook, unregister_hook


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(tiny_config()).eval()
    model.save_pretrained(tmp_path / "ok")
    return model, tmp_path


def test_truncated_safetensors_raise_a_clear_error(saved):
    _, root = saved
    shutil.copytree(root / "ok", root / "cut")
    weights = root / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OSError, match="truncated or corrupted"):
        RoFormerForMaskedLM.from_pretrained(root / "cut")


def test_missing_encoder_weights_raise_unless_allowed(saved):
    model, root = saved
    shutil.copytree(root / "ok", root / "partial")
    state = safetensors.torch.load_file(root / "ok" / "model.safetensors")
    state = {k: v for k, v in state.items() if ".layer.1." not in k}
    safetensors.torch.save_file(state, root / "partial" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 16 encoder weight\(s\)"):
        RoFormerForMaskedLM.from_pretrained(root / "partial")
    loaded = RoFormerForMaskedLM.from_pretrained(root / "partial", allow_missing_encoder_weights=True)
    assert torch.equal(loaded.roformer.encoder.layer[0].output.dense.weight,
                       model.roformer.encoder.layer[0].output.dense.weight)


def test_a_new_head_on_a_pretrained_encoder_is_fine(saved):
    model, root = saved
    classifier, info = RoFormerForSequenceClassification.from_pretrained(root / "ok", num_labels=3,
                                                                         output_loading_info=True)
    assert all(key.startswith("classifier.") for key in info["missing_keys"]) and info["missing_keys"]
    assert torch.equal(classifier.roformer.embeddings.word_embeddings.weight,
                       model.roformer.embeddings.word_embeddings.weight)


def test_pickle_weights_are_never_loaded(saved, tmp_path):
    """A folder holding only a pickled pytorch_model.bin is refused (torch.load could run arbitrary code)."""
    model, _ = saved
    folder = tmp_path / "pickled"
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        RoFormerForMaskedLM.from_pretrained(folder)


def test_save_and_reload_keep_outputs(saved):
    model, root = saved
    ids, mask = padded_batch([5, 3])
    reloaded = RoFormerForMaskedLM.from_pretrained(root / "ok").eval()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, reloaded(ids, attention_mask=mask).logits)


def test_from_a_config_and_a_state_dict_without_a_folder(saved):
    """transformers' `from_pretrained(None, config=..., state_dict=...)` builds the model the state dict describes,
    as building it and calling `load_state_dict` does, with the same guarantees as a folder."""
    model, _ = saved
    config, state = model.config, model.state_dict()
    loaded = RoFormerForMaskedLM.from_pretrained(None, config=config, state_dict=state).eval()
    built = RoFormerForMaskedLM(config).eval()
    built.load_state_dict(state)
    assert loaded.state_dict().keys() == built.state_dict().keys()
    for name, value in built.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids, mask = padded_batch([5, 3])
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits, built(ids, attention_mask=mask).logits)
    partial = {name: value for name, value in state.items() if ".layer.1." not in name}
    with pytest.raises(ValueError, match=r"'state_dict' lacks 16 encoder weight\(s\)"):
        RoFormerForMaskedLM.from_pretrained(None, config=config, state_dict=partial)


@pytest.mark.parametrize("head", [roformer_hf.RoFormerForMaskedLM, roformer_hf.RoFormerForSequenceClassification,
                                  roformer_hf.RoFormerForTokenClassification,
                                  roformer_hf.RoFormerForQuestionAnswering, roformer_hf.RoFormerForMultipleChoice])
def test_a_head_missing_from_the_checkpoint_starts_fresh(tmp_path, head, caplog):
    """Every parameter of a head loaded onto a bare encoder's checkpoint is initialised as in a new model (no
    uninitialised memory), and the load raises no "corrupted checkpoint" alarm."""
    torch.manual_seed(0)
    config = tiny_config(num_labels=3, initializer_range=0.05)
    roformer_hf.RoFormerModel(config).save_pretrained(tmp_path)
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            model = head.from_pretrained(tmp_path, num_labels=3)
    finally:
        transformers.logging.disable_propagation()
    assert "corrupted" not in caplog.text
    for name, parameter in model.named_parameters():
        if name.startswith("roformer."):
            continue
        value = parameter.detach()
        if name.endswith("LayerNorm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
        elif name != "cls.predictions.decoder.weight":  # tied to the (loaded) word embeddings
            assert 0.5 * 0.05 < value.std() < 1.5 * 0.05, name
    if head is roformer_hf.RoFormerForMaskedLM:
        predictions = model.cls.predictions
        assert predictions.decoder.bias is predictions.bias
        assert predictions.decoder.weight is model.roformer.embeddings.word_embeddings.weight
    ids, mask = padded_batch([5, 3])
    logits = model(ids[:, None] if head is roformer_hf.RoFormerForMultipleChoice else ids,
                   attention_mask=mask[:, None] if head is roformer_hf.RoFormerForMultipleChoice else mask)[0]
    assert torch.isfinite(logits).all()




# --- tools: hooks registered from outside loading.py -----------------------------------------------------------------


@pytest.fixture
def hooked():
    """Registers hooks as a new tool would at its import, and unregisters them after the test."""
    registered = []

    def register(point: str, hook) -> None:
        register_hook(point, hook)
        registered.append((point, hook))

    yield register
    for point, hook in registered:
        unregister_hook(point, hook)


def test_a_save_hook_runs_after_the_folder_is_written_until_unregistered(tmp_path):
    seen = []

    def record(model, save_directory):
        seen.append((type(model), {path.name for path in Path(save_directory).iterdir()}))

    model = RoFormerForMaskedLM(tiny_config())
    register_hook("save", record)
    register_hook("save", record)  # a second registration changes nothing
    try:
        model.save_pretrained(tmp_path / "with")
    finally:
        unregister_hook("save", record)
    model.save_pretrained(tmp_path / "without")
    assert len(seen) == 1 and seen[0][0] is RoFormerForMaskedLM
    # after transformers' files and the package's own hooks (the card, sentence-transformers' modules)
    assert {"config.json", "model.safetensors", "modeling.py", "README.md", "modules.json"} <= seen[0][1]
    with pytest.raises(ValueError, match=r"unregister_hook\(point='save', hook=.*record\): not registered"):
        unregister_hook("save", record)


def test_a_load_hook_sees_the_model_and_its_local_folder(saved, hooked):
    model, root = saved
    seen = []
    hooked("load", lambda loaded, folder: seen.append((type(loaded), Path(folder))))
    model.save_pretrained(root / "nested" / "sub")
    RoFormerForMaskedLM.from_pretrained(root / "ok")
    RoFormerForMaskedLM.from_pretrained(root / "nested", subfolder="sub")
    RoFormerForMaskedLM.from_pretrained(None, config=model.config, state_dict=model.state_dict())  # no folder
    assert seen == [(RoFormerForMaskedLM, root / "ok"), (RoFormerForMaskedLM, root / "nested" / "sub")]


def test_a_push_hook_replaces_the_upload_and_there_is_one_at_most():
    pushed = []

    def upload(model, repo_id, **kwargs):
        pushed.append((type(model), repo_id, kwargs))
        return "commit"

    with pytest.raises(ValueError, match=r"hub\.push_to_hub_with_card already replaces transformers' push_to_hub"):
        register_hook("push", upload)
    unregister_hook("push", hub.push_to_hub_with_card)
    try:
        register_hook("push", upload)
        assert RoFormerForMaskedLM(tiny_config()).push_to_hub("user/model", private=True) == "commit"
    finally:
        unregister_hook("push", upload)
        register_hook("push", hub.push_to_hub_with_card)
    assert pushed == [(RoFormerForMaskedLM, "user/model", {"private": True})]


def test_an_unknown_hook_point_is_refused_by_name():
    with pytest.raises(ValueError, match=r"point='saved': expected one of \('save', 'load', 'push'\)"):
        register_hook("saved", print)
