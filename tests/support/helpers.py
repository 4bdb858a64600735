"""Small shared builders for the tests: tiny configs, transformers' RoFormer and the closed-form rotary math as
references, and a stand-in flash-attn kernel."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import roformer_hf

TINY = {
    "vocab_size": 97,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def tiny_config(**overrides) -> roformer_hf.RoFormerConfig:
    return roformer_hf.RoFormerConfig(**{**TINY, **overrides})


def padded_batch(lengths: list[int], vocab_size: int = TINY["vocab_size"], seed: int = 0, left: bool = False):
    """Random ids (never the pad id 0) and the matching attention mask, right-padded unless `left`."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    ids = torch.randint(1, vocab_size, (len(lengths), seq_len), generator=gen)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, seq_len - n:] = 1
        else:
            mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def reference_and_ours(head: str, folder, **overrides):
    """transformers' RoFormer `head` with random weights, saved to `folder`, and roformer_hf's model loaded from
    that folder: the same weights in both implementations."""
    torch.manual_seed(0)
    reference = getattr(transformers, head)(transformers.RoFormerConfig(**{**TINY, **overrides})).eval()
    reference.save_pretrained(folder)
    ours = getattr(roformer_hf, head).from_pretrained(folder).eval()
    return reference, ours


def block_imports(*names: str) -> str:
    """Python source to put at the top of a subprocess script: there, the packages `names` behave as if they were not
    installed. `import name` (or of a submodule) raises ModuleNotFoundError and `importlib.util.find_spec(name)`
    returns None, which is what transformers' availability checks ask; a `None` entry in `sys.modules` does both."""
    return f"import sys\nsys.modules.update(dict.fromkeys({sorted(names)!r}))\n"


BLOCK_ROFORMER_HF = block_imports("roformer_hf")
"""Prepend to a subprocess script to simulate a machine where roformer_hf is not installed."""

PYTHON = sys.executable

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""

EXAMPLES = ROOT / "examples"
"""The example scripts; conftest.py puts this folder on sys.path."""

BENCHMARKS = ROOT / "benchmarks"
"""The benchmark scripts and their shared modules."""

FIXTURES = Path(__file__).resolve().parent / "fixtures"
"""Checkpoints and outputs written by JunnYu's `roformer` 0.4.3 (make_v2_fixtures.py, make_sim_fixtures.py)."""


WORDS = "the king queen speaks and dies loves a crown sword night day".split()
"""A tiny vocabulary for tokenizer-backed tests (pipelines, collators)."""

STAND_IN = "test_varlen_stand_in"  # a name with "flash" in it would make transformers look for the real kernel
stand_in_calls: list[str] = []  # what varlen_stand_in was called with: "varlen" or "padded"


def varlen_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A flash-attn kernel for CPU: attends with SDPA, asserting what transformers' flash-attn wrapper requires, and
    causal when `module.is_causal`, as flash-attn is (the queries aligned to the last keys, as after a cache)."""
    causal = getattr(module, "is_causal", False)
    if "cu_seq_lens_q" in kwargs:  # packed: (1, nh, N, d), one run of tokens per sequence (of queries: a subset)
        query_offsets, key_offsets = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        assert attention_mask is None and query.shape[0] == 1 and query.shape[2] > 0
        assert query_offsets.dtype == key_offsets.dtype == torch.int32
        for side, offsets in (("q", query_offsets), ("k", key_offsets)):
            longest = kwargs[f"max_length_{side}"]
            assert isinstance(longest, int) and longest == offsets.diff().max().item()
        assert not causal or torch.equal(query_offsets, key_offsets)
        queries, keys = query_offsets.tolist(), key_offsets.tolist()
        output = torch.cat([F.scaled_dot_product_attention(query[:, :, q_start:q_end],
                                                           *(t[:, :, k_start:k_end] for t in (key, value)),
                                                           scale=scaling, is_causal=causal)
                            for q_start, q_end, k_start, k_end in zip(queries, queries[1:], keys, keys[1:])
                            if q_end > q_start], dim=2)
        stand_in_calls.append("varlen")
    else:  # padded: (B, nh, L, d) with the (B, L) mask flash-attn unpads by itself
        assert attention_mask is None or attention_mask.dim() == 2
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool)
        if causal:
            mask = mask.tril(key.shape[2] - query.shape[2])
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :].bool()
        mask = mask | mask.logical_not().all(-1, keepdim=True)  # a query with no key (padding) attends to all
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        stand_in_calls.append("padded")
    return output.transpose(1, 2), None  # (B, L, nh, d), as transformers' attention functions return


# The closed-form rotary math, written independently of `roformer_hf.rotary`, as the tests' reference: pair i of a
# d-vector at position m turns by m * base ** (-2i / d): out = x * cos + rotate_pairs(x) * sin, where rotate_pairs
# maps each pair (a, b) to (-b, a).


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0,
                   layout: str = "interleaved") -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of every dimension's angle, float32 (angles formed in float64). Shape (*P, d)."""
    if layout not in ("interleaved", "half"):
        raise ValueError(f"layout={layout!r}: expected one of ('interleaved', 'half')")
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq  # (*P, d/2)
    if layout == "interleaved":
        angles = angles.repeat_interleave(2, dim=-1)  # theta_0, theta_0, theta_1, theta_1, ...
    else:
        angles = torch.cat((angles, angles), dim=-1)  # theta_0 ... theta_{d/2-1}, theta_0 ...
    return angles.cos().float(), angles.sin().float()


def rotate_pairs(x: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Each pair (a, b) -> (-b, a): a quarter turn."""
    if layout == "interleaved":
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotates every pair of x by its angle, in float32; returned in x.dtype."""
    xf = x.float()
    return (xf * cos + rotate_pairs(xf, layout) * sin).to(x.dtype)


class KernelModule(torch.nn.Module):
    """Stands in for the attention module of a kernel call: the kernels only read `training` (and, where set,
    `is_causal` and `num_key_value_groups`)."""


def random_qkv(batch=2, heads=3, length=600, dim=8, seed=0):
    """Query, key and value ``(B, nh, L, d)`` that require grad."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=generator, requires_grad=True) for _ in range(3)]


# Serving: a tokenizer trained on a few sentences, saved folders, a free port, a real Ray Serve and its replicas.

SERVING_CORPUS = ["the king speaks and the queen dies", "a crown and a sword at night", "the queen loves the king",
                  "day and night the sword speaks", "a king loves a crown", "the night dies and the day speaks"]


def serving_tokenizer():
    """A WordPiece tokenizer of `SERVING_CORPUS`'s words, their letters and the letters as word pieces (inputs of up to
    32 tokens), the same in every process. The words are the pieces a trained vocabulary ends with, but tokenizers'
    WordPiece trainer numbers the word pieces in hash-map order, so a trained vocabulary's ids (and the pieces between
    letters and words) change from one process to the next, and with them every model built on it."""
    words = sorted({word for line in SERVING_CORPUS for word in line.split()})
    letters = sorted({letter for word in words for letter in word})
    pieces = dict.fromkeys([*roformer_hf.tokenization.SPECIAL_TOKENS, *letters,
                            *(f"##{letter}" for letter in letters), *words])  # "a" is a letter and a word
    return roformer_hf.RoFormerHFTokenizer(vocab={piece: i for i, piece in enumerate(pieces)}, model_max_length=32)


def save_folder(model, tokenizer, folder: Path) -> Path:
    """`folder` holding the model and its tokenizer, as `ServedModel` loads it."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def embedding_folder(folder: Path):
    """A tiny `RoFormerModel` (mean pooling) saved with `serving_tokenizer()` in `folder`: (folder, model, tokenizer)."""
    tokenizer = serving_tokenizer()
    torch.manual_seed(0)
    model = roformer_hf.RoFormerModel(tiny_config(vocab_size=len(tokenizer))).eval()
    return save_folder(model, tokenizer, folder), model, tokenizer


def free_port() -> int:
    """A port nothing listens on now. Below the system's ephemeral ports where Ray Serve is installed
    (`roformer_hf.serving.free_ports`): there no outgoing connection, of which Ray opens many while it starts, can
    take the port before the test's server listens on it."""
    import socket

    try:
        from roformer_hf.serving import free_ports

        return free_ports(1)
    except (ImportError, RuntimeError):  # no Ray Serve, or no room below the ephemeral ports
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]


@contextmanager
def ray_environment(**env: str) -> Iterator[None]:
    """This process's environment plus `env`, and its import path as ``PYTHONPATH`` (so that Ray's workers import
    this checkout and the tests' helpers), for the Ray processes started inside the block (`ray.init`, a
    `Cluster`'s nodes): they read it once, when they start. Restored after. Unlike a ``runtime_env``, it starts no
    setup process for each worker. Ray's workers (the replicas, Ray Serve's controller and proxy) run at the tests'
    own priority, where Ray starts them at niceness 15: beside other workers' compiles, a replica's start (mostly
    importing torch and transformers, 8 CPU-s) took two minutes. Ray Serve's proxy gets 30 s to start, not 5: on a
    machine busy with other tests, a proxy slower than that was killed and `serve.start` failed. Ray Serve's own errors
    come in OpenAI's shape, as `roformer-hf serve` sets it up (`roformer_hf.serving.ingress.command_env`)."""
    import os

    env = {"PYTHONPATH": os.pathsep.join(sys.path), "RAY_worker_niceness": "0",
           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
           "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "roformer_hf.serving.guards:proxy_middlewares", **env}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def shut_down_serve_and_ray() -> None:
    """Ray Serve and Ray of this process, where it is still connected to its Ray. A module fixture's teardown can
    come after a later test shut its Ray down and started another (pytest tears a module fixture down when the
    module ends); `serve.shutdown()` from a process with no Ray connects to whichever cluster it finds on this
    machine (another worker's `ray.cluster_utils.Cluster`) and shuts Ray Serve down there."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
    ray.shutdown()


def replica_processes(app: str, wait_s: float = 10.0) -> dict[str, tuple[int, str]]:
    """The live replicas of application `app` on the connected Ray Serve: their replica id (what the `X-Replica`
    response header names) -> (the worker's PID, its Ray node id). Asked of each replica actor itself; a replica
    that is dead, or still being created (its actor cannot answer yet), within `wait_s` is not live."""
    import os

    import ray

    asked = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].startswith(f"SERVE_REPLICA::{app}#"):
            try:
                handle = ray.get_actor(actor["name"], namespace="serve")
            except ValueError:  # gone since it was listed
                continue
            where = handle.__ray_call__.remote(lambda _: (os.getpid(), ray.get_runtime_context().get_node_id()))
            asked[where] = actor["name"].rsplit("#", 1)[1]
    answered, _ = ray.wait(list(asked), num_returns=len(asked), timeout=wait_s) if asked else ([], [])
    found = {}
    for where in answered:
        try:
            found[asked[where]] = tuple(ray.get(where))
        except ray.exceptions.RayActorError:
            pass
    return found
