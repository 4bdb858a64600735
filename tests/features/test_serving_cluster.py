"""The application on a Ray cluster of two nodes (both on this machine, `ray.cluster_utils.Cluster`): one replica per
node, both answering what the library gives offline, each naming itself in `X-Replica`; then a clean shutdown."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import SERVING_CORPUS, embedding_folder, free_port, ray_environment, replica_processes

pytest.importorskip("ray.serve", reason="serving needs Ray Serve: pip install roformer_hf[serve]")
requests = pytest.importorskip("requests", reason="the HTTP tests talk to the server with requests")

from roformer_hf.similarity import encode  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster of two nodes

APP = "cluster"
DEADLINE_S = 30  # both replicas seen answering
CLIENTS = 4
SHUTDOWN_S = 60  # the replicas gone after serve.shutdown() returns


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node and a worker node of one CPU each; the application's 2 replicas reserve one CPU each, so each node
    runs one. Ray Serve's proxy runs on the head only (both nodes share this machine's ports); it sends a request to
    a replica of its own node while that one has room, so each replica takes one request at a time and the test's
    concurrent clients overflow to the other node. Any Ray this process was connected to is shut down first: a
    process holds one driver connection."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from roformer_hf.serving import build_app

    folder, model, tokenizer = embedding_folder(tmp_path_factory.mktemp("cluster") / "encoder")
    ray.shutdown()
    with ray_environment():
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        with ray_environment():
            nodes.add_node(num_cpus=1)
        ray.init(address=nodes.address, log_to_driver=False)
        nodes.wait_for_nodes()
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"folder": str(folder), "replicas": "2", "threads": "1", "num_cpus": "1",
                             "max_ongoing_requests": "1"}), name=APP,
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}", model, tokenizer, [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        serve.shutdown()
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_one_replica_per_node_both_answering(cluster):
    import ray

    url, model, tokenizer, node_ids = cluster
    assert len(node_ids) == 2
    replicas = replica_processes(APP)
    assert sorted(node for _, node in replicas.values()) == sorted(node_ids)  # one replica on each node
    expected = encode(model, tokenizer, SERVING_CORPUS)
    start = time.monotonic()

    def client(k: int) -> list[str]:
        """Requests until the deadline or until both replicas answered this client's; the replicas that answered."""
        seen = []
        with requests.Session() as session:
            while time.monotonic() - start < DEADLINE_S and (len(set(seen)) < 2 or len(seen) < 8):
                i = (k + len(seen)) % len(SERVING_CORPUS)
                response = session.post(f"{url}/v1/embeddings", json={"input": SERVING_CORPUS[i]}, timeout=30)
                assert response.status_code == 200, response.text[:500]
                torch.testing.assert_close(torch.tensor(response.json()["data"][0]["embedding"]), expected[i],
                                           atol=1e-5, rtol=0)
                seen.append(response.headers["x-replica"])
        return seen

    with ThreadPoolExecutor(CLIENTS) as pool:
        answered = [replica for seen in pool.map(client, range(CLIENTS)) for replica in seen]
    assert set(answered) == set(replicas)
    assert ray.is_initialized()


def test_shutdown_is_clean(cluster):
    """Last in the module: Ray Serve shuts down, the application's replicas with it."""
    from ray import serve

    serve.shutdown()  # it gives up waiting for the controller after 30 s, with a warning, on a machine under load
    deadline = time.monotonic() + SHUTDOWN_S
    while (live := replica_processes(APP)) and time.monotonic() < deadline:
        time.sleep(1)
    assert live == {}
