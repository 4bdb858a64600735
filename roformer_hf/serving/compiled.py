"""The encoder (or a sequence classifier) for one input, compiled ahead of time by AOTInductor and kept on disk for
the next start.

`compiled_package` exports the encoder on one input's ids (`OneInput`: no mask, no cache, any length from 2 tokens to
the model's longest), or a sequence classifier on one input's ids and token types (`OneClassifierInput`), compiles it
with inductor's settings for latency on CPU (frozen weights: packed once, the activations fused into their GEMMs; the
kernels called from C++) into a package (`torch._inductor.aoti_compile_and_package`) and loads it. The package is
saved in a cache folder under a key of everything the compiled code depends on (`cache_key`: the weights, the config,
the calibration, the thread count, the CPU, the versions of the code), so a replica that starts again, or a second
replica of the same model, loads it in about a second instead of compiling for tens of seconds; after each save the
least recently used packages beyond `cache_limit` are removed (`prune`). Replicas starting together compile once: the
others wait on the key's lock, then load.

Every package, compiled now or loaded, must first answer a probe input as the eager model does (`check`) before it
serves; one loaded that does not, or cannot be loaded, is compiled again and replaced, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch._inductor
from filelock import FileLock
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling, SequenceClassifierOutput

from ..few_rows import cache_root  # roformer_hf's cache folder, which the few-row kernel is built into too

logger = logging.getLogger(__name__)

FORMAT = 2  # of the cache's packages and keys; a change of what a key covers raises it
# How long a start waits for another process compiling the same key before it compiles for itself, unsaved: longer
# than any compile, short of forever where that process hangs.
LOCK_TIMEOUT_S = 1800.0
PROBE_TEXT = "A short sentence that checks the compiled encoder against the eager one."
# The packages a cache folder keeps, in megabytes in all (`cache_limit`): after each save, the least recently used
# beyond it are removed. 0 keeps every one.
CACHE_LIMIT_ENV, DEFAULT_CACHE_LIMIT_MB = "ROFORMER_HF_COMPILE_CACHE_MB", 4096
_KEY = re.compile(r"[0-9a-f]{32}")  # `cache_key`'s digest, a package's name


class OneInput(nn.Module):
    """The encoder on one input's ids ``(1, L)``, as the compiled encoder takes them: no mask (one input has no
    padding), no cache. Returns the last hidden states ``(1, L, H)`` and, where the encoder has a pooler, its output
    ``(1, H)``: tensors only, which a compiled package returns as they are."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.encoder(input_ids=input_ids, use_cache=False)
        return (out.last_hidden_state,) if out.pooler_output is None else (out.last_hidden_state, out.pooler_output)


class OneClassifierInput(nn.Module):
    """A sequence classifier on one input, as the compiled classifier takes it: its ids and token types ``(1, L)`` (a
    pair's second text of type 1), no mask, no cache. Returns the logits ``(1, num_labels)``, in a tuple."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.classifier(input_ids=input_ids, token_type_ids=token_type_ids).logits,)


class CompiledPackage:
    """A loaded package (AOTInductor's), which takes `inputs`, each ``(1, L)`` with ``2 <= L <= max_length``, the
    lengths it was compiled for (the package itself checks no shape). `path`: the package's file in the cache, None
    where it is not saved; `loaded`: whether it came from the cache rather than from compiling in this process."""

    inputs: tuple[str, ...] = ("input_ids",)  # the package's arguments
    what = "graph"

    def __init__(self, runner: Callable, path: Path | None, max_length: int, loaded: bool):
        self.runner, self.path, self.max_length, self.loaded = runner, path, max_length, loaded

    def outputs(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The package's own outputs for its `inputs`, once their shapes are checked."""
        input_ids = inputs[0]
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or not 2 <= input_ids.shape[1] <= self.max_length:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}: expected (1, L) with "
                             f"2 <= L <= {self.max_length}, the lengths the {self.what} was compiled for")
        for name, tensor in zip(self.inputs[1:], inputs[1:]):
            if tensor.shape != input_ids.shape:
                raise ValueError(f"{name} of shape {tuple(tensor.shape)}: expected input_ids' "
                                 f"{tuple(input_ids.shape)}")
        return self.runner(*inputs)


class CompiledEncoder(CompiledPackage):
    """A loaded package of `OneInput`, called as the encoder is: ``encoder(input_ids=(1, L))``."""

    what = "encoder"

    def __call__(self, input_ids: torch.Tensor) -> BaseModelOutputWithPooling:
        outputs = self.outputs(input_ids)
        return BaseModelOutputWithPooling(last_hidden_state=outputs[0],
                                          pooler_output=outputs[1] if len(outputs) > 1 else None)


class CompiledClassifier(CompiledPackage):
    """A loaded package of `OneClassifierInput`, called as the classifier is: ``classifier(input_ids=(1, L),
    token_type_ids=(1, L))`` (token types default to zeros)."""

    inputs = ("input_ids", "token_type_ids")
    what = "classifier"

    def __call__(self, input_ids: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> SequenceClassifierOutput:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        return SequenceClassifierOutput(logits=self.outputs(input_ids, token_type_ids)[0])


def default_compile_cache() -> Path | None:
    """Where compiled packages are kept unless told: ``$ROFORMER_HF_CACHE/compiled``, else
    ``$XDG_CACHE_HOME/roformer_hf/compiled``, else ``~/.cache/roformer_hf/compiled``; None where none of them is known
    (no home folder), with a warning: each start compiles."""
    try:
        return cache_root() / "compiled"
    except RuntimeError as error:  # Path.home() with no HOME and no user entry
        logger.warning("no compile cache (%s): set ROFORMER_HF_CACHE or pass compile_cache", error)
        return None


def cache_key(model: nn.Module, precision: str, max_length: int,
              calibration: Sequence[dict[str, torch.Tensor]] = ()) -> dict:
    """What the compiled code of `model` (the eager encoder or classifier, before any quantization) depends on, with
    its digest under ``"key"``: its class, the weights' bytes, the config (its attention implementation included),
    `precision`, the longest input, the calibration's batches (int8; `loaded.calibration_batches`), torch's thread
    count (inductor writes it into its kernels), the CPU (its ISA picks the kernels and the packed weights' layout),
    inductor's settings from the environment (``TORCHINDUCTOR_*``) and the versions of torch, transformers, torchao and
    roformer_hf's code."""
    weights = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        weights.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        weights.update(tensor.view(-1).view(torch.uint8).numpy())
    calibrated = hashlib.sha256()
    for batch in calibration:
        calibrated.update(json.dumps({name: tensor.tolist() for name, tensor in sorted(batch.items())}).encode())
    factors = {"format": FORMAT, "model": type(model).__name__, "precision": precision, "max_length": max_length,
               "threads": torch.get_num_threads(), "cpu": _cpu(), "torch": torch.__version__,
               "transformers": _version("transformers"),
               "torchao": _version("torchao") if precision == "int8" else None, "code": _code_digest(),
               "config": _config_digest(model.config),
               "inductor_environment": {name: value for name, value in sorted(os.environ.items())
                                        if name.startswith("TORCHINDUCTOR_")},
               "weights": weights.hexdigest(), "calibration": calibrated.hexdigest() if calibration else None}
    factors["key"] = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:32]
    return factors


def compiled_package(build: Callable[[], nn.Module], example: tuple[torch.Tensor, ...], max_length: int,
                     factors: dict, check: Callable[[CompiledPackage], None], cache: Path | None,
                     kind: type[CompiledPackage] = CompiledEncoder) -> CompiledPackage:
    """The package of the module `build()` returns (`OneInput` or `OneClassifierInput`, or one exported from it) as a
    `kind`, from `cache` under ``factors["key"]`` where it holds one that passes `check` (which raises where the
    package answers wrongly), else compiled now, checked, and saved there. `example`: the inputs ``(1, L)`` to export
    on, as `kind.inputs` names them; any length from 2 to `max_length` runs. A package is read without the lock (it
    is written whole, then moved into place), so a cache that is only readable serves what it holds; one that cannot
    be written is warned of, and the package compiled is not saved."""
    path = None if cache is None else cache / f"{factors['key']}.pt2"
    if path is not None and (found := _load(path, max_length, check, kind)) is not None:
        return found
    lock = None
    if cache is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            lock = FileLock(cache / f"{factors['key']}.lock")
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except OSError as error:  # filelock's Timeout among them
            logger.warning("compile cache %s cannot be written (%s: %s): compiling without it", cache,
                           type(error).__name__, error)
            lock = None
    try:
        if lock is not None and (found := _load(path, max_length, check, kind)) is not None:
            return found  # compiled by another process while this one waited for the lock
        with tempfile.TemporaryDirectory() as folder:
            package = _compile(build, example, max_length, Path(folder) / "package.pt2", kind)
            check(package)
            package.path = _save(package.path, path, factors) if lock is not None else None
        if package.path is not None and (limit := cache_limit()) is not None:
            try:
                for removed in prune(cache, package.path, limit):
                    logger.info("compile cache %s: removed %s, the least recently used beyond %g MB", cache,
                                removed.name, limit / 10**6)
            except OSError as error:  # the package is saved and serves; the folder is only fuller than it should be
                logger.warning("compile cache %s could not be pruned (%s)", cache, error)
        return package
    finally:
        if lock is not None:
            lock.release()


def _load(path: Path, max_length: int, check: Callable[[CompiledPackage], None],
          kind: type[CompiledPackage]) -> CompiledPackage | None:
    """The package at `path` where it is there and passes `check`; None where it is not there, and with a warning
    where it cannot be loaded or fails the check (it is compiled again)."""
    if not path.is_file():
        return None
    try:
        package = kind(torch._inductor.aoti_load_package(str(path)), path, max_length, loaded=True)
        check(package)
    except Exception as error:  # noqa: BLE001 - a corrupt or stale package of any kind is compiled anew
        logger.warning("compiled %s %s could not be used (%s: %s): compiling it again", kind.what, path,
                       type(error).__name__, error)
        return None
    logger.info("compiled %s loaded from %s", kind.what, path)
    try:
        os.utime(path)  # used now: the last a full cache removes (`prune`)
    except OSError:
        pass  # a cache that is only readable
    return package


def cache_limit() -> int | None:
    """The bytes of packages a cache folder keeps (`CACHE_LIMIT_ENV`, in megabytes; default `DEFAULT_CACHE_LIMIT_MB`);
    None where it is 0 (keep every package), or, with a warning, not a number of megabytes."""
    value = os.environ.get(CACHE_LIMIT_ENV)
    try:
        megabytes = float(value) if value is not None else DEFAULT_CACHE_LIMIT_MB
        if not (math.isfinite(megabytes) and megabytes >= 0):
            raise ValueError(value)
    except ValueError:
        logger.warning("%s=%r: expected a number of megabytes (0: keep every package); no package is removed",
                       CACHE_LIMIT_ENV, value)
        return None
    return int(megabytes * 10**6) if megabytes else None


def prune(cache: Path, keep: Path, limit: int) -> list[Path]:
    """Removes the least recently used packages of `cache` (by modification time, which a load renews), each with its
    ``.json``, until the packages left take at most `limit` bytes, or only `keep` (the one just saved) is left; returns
    those removed. Only files named as this module names packages (``KEY.pt2``) are counted or removed, and the copies
    of a save that stopped midway (``KEY.PID.part``, older than `LOCK_TIMEOUT_S`). A package that another process was
    about to load fails to load there and is compiled again; the ``.lock`` files stay (empty, and a process may hold
    one)."""
    def used(package: Path) -> float:
        try:
            return package.stat().st_mtime
        except OSError:  # removed meanwhile
            return float("inf")

    for part in cache.glob("*.part"):  # a save writes its copy in seconds, under the key's lock
        if _KEY.fullmatch(part.name.split(".")[0]) and time.time() - used(part) > LOCK_TIMEOUT_S:
            part.unlink(missing_ok=True)
    others = sorted((package for package in cache.glob("*.pt2") if package != keep and _KEY.fullmatch(package.stem)),
                    key=used)
    sizes = {}
    for package in [keep, *others]:
        try:
            sizes[package] = package.stat().st_size
        except OSError:
            sizes[package] = 0
    total, removed = sum(sizes.values()), []
    for package in others:  # the least recently used first
        if total <= limit:
            break
        try:
            package.unlink()
        except FileNotFoundError:  # another process removed it
            total -= sizes[package]
            continue
        except OSError as error:
            logger.warning("compile cache %s: %s could not be removed (%s)", cache, package.name, error)
            continue
        total -= sizes[package]
        removed.append(package)
        try:
            package.with_suffix(".json").unlink(missing_ok=True)
        except OSError:
            pass  # a few bytes, and nothing reads a key's factors without its package
    return removed


def _save(package: Path, path: Path, factors: dict) -> Path | None:
    """`package` copied to `path` beside the cache's other packages (a copy in the same folder, then moved into place:
    a reader never sees half a package), with the key's factors beside it; None, with a warning, where it cannot be
    (a full disk, say): the package serves unsaved."""
    part = path.with_name(f"{path.stem}.{os.getpid()}.part")
    try:
        shutil.copyfile(package, part)
        os.replace(part, path)
        path.with_suffix(".json").write_text(json.dumps(factors, indent=1) + "\n", encoding="utf-8")
    except OSError as error:
        part.unlink(missing_ok=True)
        logger.warning("compiled package not saved to %s (%s): it serves unsaved", path, error)
        return None
    return path


def _compile(build: Callable[[], nn.Module], example: tuple[torch.Tensor, ...], max_length: int, path: Path,
             kind: type[CompiledPackage]) -> CompiledPackage:
    module = build()
    start = time.perf_counter()
    length = torch.export.Dim("length", min=2, max=max_length)  # one length for every input
    try:
        with torch.no_grad():
            program = torch.export.export(module, example, dynamic_shapes={name: {1: length} for name in kind.inputs})
            torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                     inductor_configs={"freezing": True})
        runner = torch._inductor.aoti_load_package(str(path))
    except Exception as error:  # export's and inductor's errors have no common base class
        raise RuntimeError(f"compile=True: AOTInductor could not export or compile the {kind.what} "
                           f"({type(error).__name__}: {error}); inductor needs a C++ compiler on this machine, the "
                           "first thing to check. Expected a machine where it compiles, or compile=False") from error
    logger.info("%s compiled for one input in %.1f s", kind.what, time.perf_counter() - start)
    return kind(runner, path, max_length, loaded=False)


def _cpu() -> str:
    """The CPU as far as compiled code can tell: architecture, vendor and model, and its feature flags."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features") \
                        and key.strip() not in fields:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    return " | ".join([platform.machine(), torch.backends.cpu.get_cpu_capability(), *fields.values()])


def _config_digest(config) -> str:
    """The digest of the config's fields, but for where it was read from and the transformers that wrote it."""
    fields = {name: value for name, value in config.to_dict().items()
              if name not in ("_name_or_path", "transformers_version")}
    fields["_attn_implementation"] = config._attn_implementation
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _code_digest() -> str:
    """The digest of roformer_hf's source: the model's code and the serving code around it."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for file in sorted(root.rglob("*.py")):
        digest.update(str(file.relative_to(root)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


__all__ = ["CACHE_LIMIT_ENV", "CompiledClassifier", "CompiledEncoder", "CompiledPackage", "DEFAULT_CACHE_LIMIT_MB",
           "LOCK_TIMEOUT_S", "OneClassifierInput", "OneInput", "PROBE_TEXT", "cache_key", "cache_limit",
           "compiled_package", "default_compile_cache", "prune"]
