"""What loading and saving a RoFormer checkpoint guarantees, on top of transformers' `from_pretrained`.

- Weights load only from safetensors files, never from pickles (unpickling can run code); a checkpoint holding only
  pickled weights gets an error that says so and how to convert them.
- A truncated or corrupted safetensors file raises an `OSError` naming the checkpoint.
- Task heads missing from a checkpoint start fresh (fine-tuning starts that way); missing encoder weights (those
  under the model's `base_model_prefix`) raise, unless `allow_missing_encoder_weights=True`. Cross-attention, new by
  definition when a decoder is warm-started from an encoder's checkpoint (BERT2BERT:
  `EncoderDecoderModel.from_encoder_decoder_pretrained(encoder_folder, encoder_folder)`), starts fresh too (logged)
  when the checkpoint has none of it; a checkpoint with only part of it is refused.
- Weights that disagree with the config (`check_checkpoint_weights`: RoFormer's norm weights and biases under a
  RoFormer-V2 config, or their absence under a RoFormer config) raise, naming the mismatch.
- A saved folder loads with every Auto class through `trust_remote_code=True` (`auto_map` in config.json).
- Tools plug into saving, loading and pushing by registering hooks (`register_hook`, `HOOK_POINTS`) at their import;
  this module names none of them. Transformers copies into a saved folder the files that the modeling file imports
  relatively, so a tool imports this module, never the reverse: a model loaded as remote code (without the package)
  has no hooks, and saves and pushes as any transformers model does.
- A layer that a checkpoint cannot hold declares why (`RefusesSaving`); `save_pretrained` and `push_to_hub` of a
  model holding one raise, quoting it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from safetensors import SafetensorError
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, has_file

logger = logging.getLogger(__name__)

# Where a tool plugs in: the point's name, and how its hooks are called.
HOOK_POINTS = {
    "save": "hook(model, save_directory), after transformers' save_pretrained wrote the folder; every hook, in the "
            "order registered",
    "load": "hook(model, folder), after from_pretrained loaded a local folder (the subfolder, if given) and checked "
            "the weights; every hook, in the order registered",
    "push": "hook(model, repo_id, **kwargs) -> CommitInfo, in place of transformers' push_to_hub (it uploads); at most "
            "one",
}
_HOOKS: dict[str, list[Callable]] = {point: [] for point in HOOK_POINTS}


def register_hook(point: str, hook: Callable) -> None:
    """Calls `hook` at `point` of every RoFormer model's saving, loading or pushing (`HOOK_POINTS` says how). A tool
    registers its hooks at its import; registering a hook twice registers it once.

    Example:

    ```python
    >>> import tempfile
    >>> from roformer_hf import RoFormerConfig, RoFormerModel
    >>> from roformer_hf.loading import register_hook, unregister_hook
    >>> saved = []
    >>> def note(model, save_directory):
    ...     saved.append(type(model).__name__)
    >>> model = RoFormerModel(RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
    ...                                      num_attention_heads=2, intermediate_size=64))
    >>> register_hook("save", note)
    >>> model.save_pretrained(tempfile.mkdtemp())
    >>> unregister_hook("save", note)
    >>> saved
    ['RoFormerModel']
    ```
    """
    hooks = _hooks(point)
    if hook in hooks:
        return
    if point == "push" and hooks:
        raise ValueError(f"register_hook(point='push', hook={_name(hook)}): {_name(hooks[0])} already replaces "
                         "transformers' push_to_hub, and one upload is all a push makes: unregister it first")
    hooks.append(hook)


def unregister_hook(point: str, hook: Callable) -> None:
    """Stops calling `hook` at `point`; raises if it was not registered there."""
    hooks = _hooks(point)
    if hook not in hooks:
        raise ValueError(f"unregister_hook(point={point!r}, hook={_name(hook)}): not registered at {point!r}")
    hooks.remove(hook)


def _hooks(point: str) -> list[Callable]:
    if point not in _HOOKS:
        raise ValueError(f"point={point!r}: expected one of {tuple(HOOK_POINTS)}")
    return _HOOKS[point]


def _name(hook: Callable) -> str:
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"


@runtime_checkable
class RefusesSaving(Protocol):
    """A layer that no checkpoint can hold in a form `from_pretrained` reads back (a quantized layer whose buffers it
    would not find, say): `save_pretrained` and `push_to_hub` of a model holding one raise, quoting `save_refusal`,
    which says why and what to do instead.

    Example:

    ```python
    >>> from torch import nn
    >>> from roformer_hf.loading import RefusesSaving
    >>> class Frozen(nn.Linear):
    ...     save_refusal = "its weights live elsewhere: save the model it was made from"
    >>> isinstance(Frozen(2, 2), RefusesSaving), isinstance(nn.Linear(2, 2), RefusesSaving)
    (True, False)
    ```
    """

    save_refusal: str


class CheckpointPolicy:
    """Mixin for `PreTrainedModel` subclasses; `auto_map` (class attribute) is what `save_pretrained` writes."""

    auto_map: dict[str, str] = {}
    # Modules that a checkpoint may lack as a whole: new by definition when warm-starting from an encoder's checkpoint.
    warm_start_modules: tuple[str, ...] = ("crossattention",)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, allow_missing_encoder_weights: bool = False,
                        **kwargs):
        """transformers' `from_pretrained` with the guarantees of this module."""
        # None: transformers' way to build from `config` and `state_dict` alone (no folder, no Hub repository)
        name = "state_dict" if pretrained_model_name_or_path is None else os.fspath(pretrained_model_name_or_path)
        want_info = kwargs.pop("output_loading_info", False)
        if kwargs.setdefault("use_safetensors", True) is not True:
            raise ValueError("use_safetensors must be True: roformer_hf never unpickles weights (pickle can run code)")
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  **kwargs)
        except SafetensorError as error:
            raise OSError(f"The safetensors weights of {name!r} are truncated or corrupted and cannot be read "
                          f"({error}); re-download or re-save them") from error
        except OSError as error:
            pickled = None if pretrained_model_name_or_path is None else _pickled_weights_only(name, kwargs)
            if pickled is None:
                raise
            raise OSError(
                f"{name!r} holds its weights only as a pickle ({pickled}), which from_pretrained refuses to load: "
                "unpickling can run arbitrary code. Convert the folder once with `python -m roformer_hf.convert "
                f"{name} DST` (a Hub repository: download it first, `hf download REPO --local-dir SRC`): it reads "
                "the pickle with torch's restricted loader (torch.load(weights_only=True): tensors and plain "
                "containers only) into the roformer_hf class its config names (RoFormer, RoFormer-V2 or "
                "RoFormer-Sim with its pooler) and writes safetensors; then load DST") from error
        missing = sorted(key for key in info["missing_keys"] if model.is_encoder_weight(key))
        fresh = model.warm_started_weights(missing)
        if fresh:
            logger.info("%r has no %s weights (an encoder's checkpoint): %d initialised, as a warm start does",
                        name, "/".join(model.warm_start_modules), len(fresh))
            missing = [key for key in missing if key not in fresh]
        model.check_checkpoint_weights(name, [] if allow_missing_encoder_weights else missing, info["unexpected_keys"])
        if missing and not allow_missing_encoder_weights:
            raise ValueError(
                f"{name!r} lacks {len(missing)} encoder weight(s), e.g. {missing[:3]}: the model would be half "
                "random. Check the checkpoint, or pass allow_missing_encoder_weights=True to initialise them "
                "randomly on purpose (through EncoderDecoderModel.from_encoder_decoder_pretrained: "
                "decoder_allow_missing_encoder_weights=True for its decoder, "
                "encoder_allow_missing_encoder_weights=True for its encoder)")
        if pretrained_model_name_or_path is not None and os.path.isdir(name):
            for hook in _HOOKS["load"]:
                hook(model, os.path.join(name, kwargs.get("subfolder") or ""))
        return (model, info) if want_info else model

    def warm_started_weights(self, missing_keys: list[str]) -> set[str]:
        """The weights of `warm_start_modules` among `missing_keys`, when the checkpoint lacks every one of them
        (it was written without such modules); none when it has some (then the rest are missing by accident)."""
        own = {key for key in self.state_dict() if set(key.split(".")) & set(self.warm_start_modules)}
        return own if own and own <= set(missing_keys) else set()

    def refuse_unsaveable_layers(self, action: str) -> None:
        """Raises for a model holding a layer that declares a `save_refusal` (`RefusesSaving`)."""
        for module_name, module in self.named_modules():
            if isinstance(module, RefusesSaving) and (refusal := module.save_refusal):
                raise ValueError(f"{type(self).__name__}.{action}: {module_name} is a {type(module).__name__}; "
                                 f"{refusal}")

    def check_checkpoint_weights(self, name: str, missing_keys: list[str], unexpected_keys: list[str]) -> None:
        """Refuses a checkpoint of the other member of the family: norm weights or dense-layer biases that this
        model's config has no place for (a RoFormer checkpoint read with a RoFormer-V2 config), or a checkpoint that
        lacks exactly its encoder's norm weights and biases (the reverse). `missing_keys`: the encoder weights the
        checkpoint lacks."""
        modules = dict(self.named_modules())

        def kind(key: str) -> str | None:
            module_name, _, parameter = key.rpartition(".")
            # A head's checkpoint read by the bare model names the encoder's weights with the head's prefix.
            module = modules.get(module_name, modules.get(module_name.removeprefix(f"{self.base_model_prefix}.")))
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                return "norm"
            return "bias" if isinstance(module, nn.Linear) and parameter == "bias" else None

        described = {"norm": ("LayerNorm weights", f"norm_type={self.config.norm_type!r}"),
                     "bias": ("biases of the encoder's dense layers", f"use_bias={self.config.use_bias}")}
        if not all(kind(key) for key in missing_keys):  # more than norms and biases missing: not a matter of family
            missing_keys = []
        problems = []
        for keys, verb in ((unexpected_keys, "holds"), (missing_keys, "lacks")):
            for what, (weights, setting) in described.items():
                if found := sorted(key for key in keys if kind(key) == what):
                    problems.append(f"it {verb} {len(found)} {weights} (e.g. {found[:2]}), but its config says "
                                    f"{setting}")
        if problems:
            raise ValueError(
                f"{name!r} does not match its config: {'; '.join(problems)}. RoFormer-V2 checkpoints have no "
                "LayerNorm weights and no encoder biases, and their config.json says use_bias: false, norm_type: "
                "\"rms_norm\"; RoFormer (V1) checkpoints have both, with use_bias: true, norm_type: \"layer_norm\" "
                "(the defaults). Fix config.json to describe the weights")

    def is_encoder_weight(self, name: str) -> bool:
        """Whether parameter `name` belongs to the encoder: all of the bare model's, a head model's under its
        `base_model_prefix`."""
        return self.base_model is self or name.startswith(f"{self.base_model_prefix}.")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, then the registered save hooks; config.json maps every Auto class to this
        package's classes. Refused for a model holding layers that declare a `save_refusal` (`RefusesSaving`): it
        would not load back."""
        self.refuse_unsaveable_layers(f"save_pretrained({os.fspath(save_directory)!r})")
        self.config.auto_map = dict(self.auto_map)
        super().save_pretrained(save_directory, *args, **kwargs)
        for hook in _HOOKS["save"]:
            hook(self, save_directory)

    def push_to_hub(self, repo_id: str, **kwargs):
        """The registered push hook, else transformers' `push_to_hub`; refused, before anything is uploaded, where
        `save_pretrained` is."""
        self.refuse_unsaveable_layers(f"push_to_hub({repo_id!r})")
        if not _HOOKS["push"]:
            return super().push_to_hub(repo_id, **kwargs)
        return _HOOKS["push"][0](self, repo_id, **kwargs)


def _pickled_weights_only(name: str, kwargs: dict) -> str | None:
    """The pickled weight file of checkpoint `name` (a folder or a Hub repository) when it has no safetensors."""
    subfolder = kwargs.get("subfolder") or ""
    download = {key: kwargs[key] for key in ("revision", "proxies", "token", "cache_dir", "local_files_only")
                if kwargs.get(key) is not None}

    def present(filename: str) -> bool:
        try:
            return has_file(name, f"{subfolder}/{filename}" if subfolder else filename, **download)
        except Exception:  # an invalid repository or revision: the original error says more
            return False

    if any(present(filename) for filename in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)):
        return None
    return next((filename for filename in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) if present(filename)), None)
