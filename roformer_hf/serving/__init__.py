"""A saved folder behind HTTP on Ray Serve (`pip install roformer_hf[serve]`): `roformer-hf serve FOLDER`
(`roformer_hf/cli.py`), or `serve run roformer_hf.serving:build_app folder=FOLDER` on a Ray cluster.

- `loaded`: the folder loaded once (the head its config names, the tokenizer, its sentence embedding's facts).
- `compiled`: the encoder (or a classifier) for one input, compiled ahead of time (AOTInductor) and kept in a cache
  between starts.
- `tasks`: the work on token ids (embed, classify, fill-mask, complete, similar), a list of inputs at a time.
- `protocol`: the table of routes, typed request bodies, and inputs read into token ids; one module per protocol
  fills it: `openai_api` (OpenAI's), `tei_api` (text-embeddings-inference's), `rerank_api` (Jina's and Cohere's
  rerank), `native_api` (this server's own).
- `served`: `ServedModel`, the three together as plain Python, usable without Ray (`answer(path, body)`).
- `app`: the Ray Serve deployment `RoFormerServer`: the FastAPI ingress, batching across requests (`batching`: a
  batch formed when the model thread is free), the guards, the health check. `ingress`: the ways in (HAProxy, direct
  ingress) and their ports.
- `build_app`: the application, for the CLI, `serve run` and a Serve config file.

The package `roformer_hf` does not import this one, so the core install needs no Ray.
"""

from __future__ import annotations

from pathlib import Path

from ray import serve

from .app import RoFormerServer, default_replicas, default_threads
from .errors import RequestError, RowError, error_body
from .ingress import direct_ingress_env, ephemeral_ports, free_ports, haproxy_binary, haproxy_env
from .loaded import LoadedModel
from .served import MAX_INPUTS, ServedModel
from .tasks import Item, Tasks

# build_app's arguments: name -> (type, default). Strings are read as `serve run` passes them.
ARGUMENTS = {
    "replicas": (int, None), "threads": (int, None), "int8": (bool, False), "max_batch_tokens": (int, 4096),
    "batch_wait_ms": (float, 5.0), "max_inputs": (int, MAX_INPUTS), "num_cpus": (float, None),
    "max_ongoing_requests": (int, 64), "max_queued_requests": (int, 256), "device": (str, "cpu"),
    "served_model_name": (str, None), "api_key": (str, None), "payload_limit": (int, 2_000_000),
    "request_timeout_s": (float, None), "autoscale": (str, None), "health_check_timeout_s": (float, 30.0),
    "compile": (bool, False), "calibration": (str, None), "compile_cache": (str, None), "auto_truncate": (bool, False),
}


def autoscaling(spec: str) -> dict:
    """Ray Serve's `autoscaling_config` from `MIN:MAX` replicas (MIN may be 0: no replica while no request comes)."""
    try:
        low, high = (int(part) for part in spec.split(":"))
    except (ValueError, AttributeError) as error:
        raise ValueError(f"autoscale={spec!r}: expected MIN:MAX replicas, such as 1:4") from error
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"autoscale={spec!r}: expected 0 <= MIN <= MAX and MAX >= 1")
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
            "target_ongoing_requests": 2}


def deployment_options(replicas: int = 1, threads: int | None = None, num_cpus: float | None = None,
                       max_ongoing_requests: int = 64, max_queued_requests: int = 256, device: str = "cpu",
                       autoscale: str | None = None, health_check_timeout_s: float = 30.0) -> dict:
    """Ray Serve options of the deployment: `replicas` replicas (or `autoscale`'s MIN:MAX) of `threads` torch threads
    each (default `default_threads`), each reserving `num_cpus` of Ray's CPUs (default `threads`) and a GPU where
    `device` is CUDA. Each replica runs `max_ongoing_requests` at a time; beyond those, `max_queued_requests` wait in
    Ray Serve's queue and the rest get 503 with `Retry-After: 1` (in OpenAI's shape where Ray's processes run with
    `guards.proxy_middlewares`, as the command sets them up)."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r}: expected a positive integer")
    threads = threads or default_threads(replicas)
    actor = {"num_cpus": threads if num_cpus is None else num_cpus}
    if device.startswith("cuda"):
        actor["num_gpus"] = 1
    for name, value, low in (("max_ongoing_requests", max_ongoing_requests, 1),
                             ("max_queued_requests", max_queued_requests, 0)):
        if not isinstance(value, int) or value < low and not (name == "max_queued_requests" and value == -1):
            raise ValueError(f"{name}={value!r}: expected an integer of at least {low}"
                             + (", or -1 for no limit" if name == "max_queued_requests" else ""))
    options = {"ray_actor_options": actor, "max_ongoing_requests": max_ongoing_requests,
               "max_queued_requests": max_queued_requests,
               "health_check_timeout_s": health_check_timeout_s}
    if autoscale is not None:
        options["autoscaling_config"] = autoscaling(autoscale)
    else:
        options["num_replicas"] = replicas
    return options


def build_app(args: dict) -> serve.Application:
    """The application serving `args["folder"]`: `serve run roformer_hf.serving:build_app folder=FOLDER`, or the
    `import_path` and `args` of a Serve config file. The arguments and their defaults are `ARGUMENTS`'s; `replicas`
    defaults to one per core up to 4 (`default_replicas`; 1 on a GPU), `threads` to the cores divided among them,
    `num_cpus` (Ray's CPUs per replica) to `threads`, `served_model_name` to the folder's name."""
    args = dict(args)
    if "folder" not in args:
        raise ValueError(f"args={args!r}: expected a folder (serve run roformer_hf.serving:build_app folder=FOLDER)")
    folder = str(args.pop("folder"))
    unknown = sorted(set(args) - set(ARGUMENTS))
    if unknown:
        raise ValueError(f"unknown arguments {unknown}: expected folder and some of {sorted(ARGUMENTS)}")
    values = {name: _read(name, kind, args.get(name, default)) for name, (kind, default) in ARGUMENTS.items()}
    replicas = values["replicas"] or (1 if values["device"].startswith("cuda") else default_replicas(values["threads"]))
    threads = values["threads"] or default_threads(replicas)
    options = deployment_options(replicas, threads, values["num_cpus"], values["max_ongoing_requests"],
                                 values["max_queued_requests"], values["device"], values["autoscale"],
                                 values["health_check_timeout_s"])
    kwargs = {"threads": threads, "int8": values["int8"], "max_batch_tokens": values["max_batch_tokens"],
              "batch_wait_ms": values["batch_wait_ms"], "max_inputs": values["max_inputs"],
              "device": values["device"], "name": values["served_model_name"], "api_key": values["api_key"],
              "payload_limit": values["payload_limit"], "request_timeout_s": values["request_timeout_s"],
              "stall_s": values["health_check_timeout_s"], "max_ongoing_requests": values["max_ongoing_requests"],
              "compile": values["compile"], "calibration": values["calibration"],
              "compile_cache": values["compile_cache"], "auto_truncate": values["auto_truncate"]}
    for name in ("calibration", "compile_cache"):  # read where the replicas run, whose working folder may be another
        if kwargs[name] is not None:
            kwargs[name] = str(Path(kwargs[name]).expanduser().resolve())
    return RoFormerServer.options(**options).bind(folder, **kwargs)


def _read(name: str, kind: type, value):
    if value is None or isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is bool and isinstance(value, str):
        if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"{name}={value!r}: expected true or false")
        return value.lower() in ("1", "true", "yes")
    try:
        return kind(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}={value!r}: expected {kind.__name__}") from error


__all__ = ["ARGUMENTS", "Item", "LoadedModel", "RequestError", "RoFormerServer", "RowError", "ServedModel", "Tasks",
           "autoscaling", "build_app", "default_replicas", "default_threads", "deployment_options",
           "direct_ingress_env", "ephemeral_ports", "error_body", "free_ports", "haproxy_binary", "haproxy_env"]
