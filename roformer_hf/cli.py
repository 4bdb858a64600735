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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roformer-hf", description="RoFormer as a Hugging Face transformers model.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a saved folder over HTTP on Ray Serve (a local Ray)",
                                description="Serve a saved folder over HTTP on Ray Serve, on a local Ray.")
    serve.add_argument("folder", help="written by save_pretrained, the converter or sentence-transformers")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    ingress = serve.add_mutually_exclusive_group()
    ingress.add_argument("--haproxy", action="store_true",
                         help="Ray Serve's HAProxy on --port in place of its Python proxy, each replica answering "
                              "behind it (Linux; default: the Python proxy)")
    ingress.add_argument("--direct-port", type=int, default=None,
                         help="each replica also answers HTTP itself on a port from this one up, without a proxy "
                              "(Ray Serve's direct ingress; default: off)")
    serve.add_argument("--replicas", type=int, default=1, help="model replicas (default: %(default)s)")
    serve.add_argument("--threads", type=int, default=None,
                       help="torch threads per replica (default: the cores divided among the replicas)")
    serve.add_argument("--int8", action="store_true", help="quantize the linear layers to int8 (default: fp32)")
    serve.add_argument("--max-batch-tokens", type=int, default=4096,
                       help="real tokens per batch at most (default: %(default)s)")
    serve.add_argument("--batch-wait-ms", type=float, default=5.0,
                       help="how long a batch waits to fill (default: %(default)s)")
    serve.add_argument("--max-inputs", type=int, default=256,
                       help="inputs one request may carry at most (default: %(default)s)")
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
                f"Another server holds it, or the HAProxy of a `roformer-hf serve --haproxy` that was killed "
                f"(`pkill haproxy` stops it)")
    return None


def serve_folder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        from .serving import ServedModel, build_app, default_threads, direct_ingress_env, haproxy_env
    except ImportError as error:
        parser.exit(2, f"roformer-hf serve needs Ray Serve ({error}): pip install roformer_hf[serve]\n")
    for name in ("replicas", "threads", "max_batch_tokens", "max_inputs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value}: expected a positive integer")
    try:
        served = ServedModel(args.folder, int8=args.int8, max_inputs=args.max_inputs)
    except (ValueError, OSError) as error:
        parser.exit(1, f"roformer-hf serve: cannot serve {args.folder}: {error}\n")
    if args.max_batch_tokens < served.max_length:
        parser.error(f"--max-batch-tokens={args.max_batch_tokens}: expected at least the model's longest input, "
                     f"{served.max_length} tokens")
    del served
    env = {}  # for Ray's processes, which `ray.init` below starts: they read it once
    if "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S" not in os.environ:  # 5 s by default: on a busy machine Ray Serve
        env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "30"  # killed a slower proxy, and `serve.start` failed
    if args.direct_port is not None:
        try:
            env.update(direct_ingress_env(args.direct_port, args.replicas))
        except ValueError as error:
            parser.error(f"--direct-port={args.direct_port}: {error}")
        if args.direct_port <= args.port < args.direct_port + 2 * args.replicas:
            parser.error(f"--port={args.port}: expected a port outside the replicas' ports, {args.direct_port} to "
                         f"{args.direct_port + 2 * args.replicas - 1}")
    if args.haproxy:
        try:
            env.update(haproxy_env())
        except ValueError as error:
            parser.error(f"--haproxy: {error}")
    if (refusal := port_refusal(args.host, args.port)) is not None:  # Ray's proxy would fail after Ray started
        parser.exit(1, f"roformer-hf serve: {refusal}\n")
    os.environ.update(env)

    import ray
    from ray import serve

    threads = args.threads or default_threads(args.replicas)
    ray.init(address="local", include_dashboard=False)  # its own, even where `ray start` runs one
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app({"folder": args.folder, "replicas": args.replicas, "threads": threads, "int8": args.int8,
                     "max_batch_tokens": args.max_batch_tokens, "batch_wait_ms": args.batch_wait_ms,
                     "max_inputs": args.max_inputs})
    log = logging.getLogger(__name__)
    log.info("serving %s on http://%s:%d%s", args.folder, args.host, args.port, " (HAProxy)" if args.haproxy else "")
    if args.direct_port is not None:
        log.info("each replica also on its own port, from http://%s:%d up", args.host, args.direct_port)
    serve.run(app, name="roformer", route_prefix="/", blocking=True)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve_folder(args, parser)


if __name__ == "__main__":
    main(sys.argv[1:])
