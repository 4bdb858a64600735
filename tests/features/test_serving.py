"""roformer_hf.serving and `roformer-hf serve`: each route answers what the library gives offline (`encode`,
`generate`, transformers' pipelines, `generate_similar`), alone and batched with other requests, on the wrapper and
over HTTP on a real Ray Serve; bad requests get a 4xx JSON naming the field while the server keeps serving; a folder
that cannot be served is refused before the port opens."""

import base64
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    PYTHON,
    SERVING_CORPUS,
    free_port,
    ray_environment,
    save_folder,
    serving_tokenizer,
    shut_down_serve_and_ray,
    tiny_config,
)

pytest.importorskip("ray.serve", reason="serving needs Ray Serve: pip install roformer_hf[serve]")
requests = pytest.importorskip("requests", reason="the HTTP tests talk to the server with requests")

from roformer_hf import (  # noqa: E402
    RoFormerForCausalLM,
    RoFormerForMaskedLM,
    RoFormerForSequenceClassification,
    fused,
)
from roformer_hf.cli import main  # noqa: E402
from roformer_hf.serving import RequestError, RowError, ServedModel  # noqa: E402
from roformer_hf.serving.tasks import Completion  # noqa: E402
from roformer_hf.similarity import encode, generate_similar  # noqa: E402

SENTENCES = ["the king dies", "a queen loves the crown and the sword at night", "day", "the sword speaks"]
TIMEOUT = 30
KEY = "s3cret"


@pytest.fixture(scope="module")
def tokenizer():
    return serving_tokenizer()


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """Four saved folders: a masked LM, a classifier, a causal LM and a RoFormer-Sim, each with its tokenizer."""
    root = tmp_path_factory.mktemp("serving")
    vocab = len(tokenizer)
    torch.manual_seed(0)
    built = {
        "mlm": RoFormerForMaskedLM(tiny_config(vocab_size=vocab)),
        "clf": RoFormerForSequenceClassification(tiny_config(vocab_size=vocab, num_labels=3,
                                                             id2label={0: "comedy", 1: "history", 2: "tragedy"},
                                                             label2id={"comedy": 0, "history": 1, "tragedy": 2})),
        "lm": RoFormerForCausalLM(tiny_config(vocab_size=vocab, is_decoder=True, initializer_range=0.3)),
        "sim": RoFormerForCausalLM(tiny_config(vocab_size=vocab, is_decoder=True, prefix_lm=True,
                                               add_pooling_layer=True, initializer_range=0.3)),
    }
    return {name: save_folder(model.eval(), tokenizer, root / name) for name, model in built.items()}


@pytest.fixture(scope="module")
def served(folders):
    return {name: ServedModel(folder) for name, folder in folders.items()}


def _greedy(model, tokenizer, prompt, max_new_tokens):
    """`model.generate` on the prompt alone, up to [SEP]."""
    with torch.no_grad():
        out = model.generate(**tokenizer([prompt], return_tensors="pt"), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.sep_token_id,
                             pad_token_id=tokenizer.pad_token_id)[0, -max_new_tokens:].tolist()
    return out[:out.index(tokenizer.sep_token_id)] if tokenizer.sep_token_id in out else out


# The wrapper, without Ray.


EVERY_MODEL = {"/health", "/v1/embeddings", "/v1/models", "/v1/models/{model:path}", "/embed", "/tokenize", "/decode",
               "/info", "/", "/ping", "/invocations", "/embeddings", "/similarity", "/embed_all"}


def test_routes_follow_the_folder(served):
    assert set(served["mlm"].routes) == EVERY_MODEL | {"/fill-mask"}
    assert set(served["clf"].routes) == EVERY_MODEL | {"/predict"}  # three labels: not a reranker
    assert set(served["lm"].routes) == EVERY_MODEL | {"/v1/completions"}
    assert set(served["sim"].routes) == EVERY_MODEL | {"/v1/completions", "/similar"}
    with pytest.raises(RequestError) as refused:
        served["mlm"].parse("/predict", {"inputs": "the king"})
    assert refused.value.status == 404 and refused.value.body()["routes"] == served["mlm"].routes


@pytest.mark.parametrize("name", ["mlm", "sim"])
def test_embeddings_are_what_encode_gives(served, name):
    server = served[name]
    expected = encode(server.model, server.tokenizer, SENTENCES)  # mean pooling; the pooler for RoFormer-Sim
    answer = server.answer("/v1/embeddings", {"input": SENTENCES})
    got = torch.tensor([row["embedding"] for row in answer["data"]])
    assert [row["index"] for row in answer["data"]] == [0, 1, 2, 3]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert answer["usage"]["prompt_tokens"] == sum(len(ids) for ids in server.tokenizer(SENTENCES)["input_ids"])
    packed = server.answer("/v1/embeddings", {"input": SENTENCES[1], "encoding_format": "base64"})
    vector = torch.frombuffer(bytearray(base64.b64decode(packed["data"][0]["embedding"])), dtype=torch.float32)
    torch.testing.assert_close(vector, expected[1], atol=1e-5, rtol=0)
    unit = torch.tensor(server.answer("/embed", {"inputs": SENTENCES}))  # text-embeddings-inference normalizes
    torch.testing.assert_close(unit, encode(server.model, server.tokenizer, SENTENCES, normalize=True), atol=1e-5,
                               rtol=0)


def test_predict_is_the_text_classification_pipeline(served):
    server = served["clf"]
    classify = transformers.pipeline("text-classification", model=server.model, tokenizer=server.tokenizer,
                                     top_k=None)
    for got, expected in zip(server.answer("/predict", {"inputs": SENTENCES}), classify(SENTENCES)):
        assert [entry["label"] for entry in got] == [entry["label"] for entry in expected]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(got, expected)) < 1e-5
    assert len(server.answer("/predict", {"inputs": "the king"})) == 3  # one input: one list of labels


def test_root_answers_as_the_folders_own_route(served, reranker):
    """text-embeddings-inference's `POST /` (and SageMaker's `/invocations`): embeddings for an encoder, the
    classifier's scores for a classifier, a ranking for a cross-encoder; `GET /` and `/ping` are the health check."""
    mlm, clf, cross = served["mlm"], served["clf"], ServedModel(reranker)
    unit = encode(mlm.model, mlm.tokenizer, SENTENCES, normalize=True)
    for path in ("/", "/invocations"):
        torch.testing.assert_close(torch.tensor(mlm.answer(path, {"inputs": SENTENCES})), unit, atol=1e-5, rtol=0)
        assert clf.answer(path, {"inputs": SENTENCES}) == clf.answer("/predict", {"inputs": SENTENCES})
        ranked = cross.answer(path, {"query": "the king", "texts": SENTENCES})
        assert ranked == cross.answer("/rerank", {"query": "the king", "texts": SENTENCES})
    scores = cross.model(**cross.tokenizer(["the king"] * 4, SENTENCES, padding=True, return_tensors="pt")).logits
    assert [entry["index"] for entry in ranked] == scores[:, 0].argsort(descending=True).tolist()
    with pytest.raises(RequestError) as refused:  # a reranker's body sent to an encoder
        mlm.answer("/", {"query": "the king", "texts": SENTENCES})
    assert refused.value.status == 422 and "POST /embed" in refused.value.message
    assert mlm.answer("/", method="GET")["status"] == mlm.answer("/ping")["status"] == "ok"


@pytest.mark.parametrize("name", ["mlm", "clf", "sim"])
def test_embed_all_is_each_tokens_last_hidden_state(served, name):
    """`/embed_all`, batched, against the encoder's forward on each input alone (the model's own padding-free run)."""
    server = served[name]
    got = server.answer("/embed_all", {"inputs": SENTENCES})
    for sentence, states in zip(SENTENCES, got):
        ids = server.tokenizer(sentence, return_tensors="pt")
        alone = server.model.base_model(**ids).last_hidden_state[0].detach()
        assert states.shape == (ids["input_ids"].shape[1], server.model.config.hidden_size)
        torch.testing.assert_close(torch.from_numpy(states), alone, atol=1e-5, rtol=0)


def test_documents_rerank_is_jina_and_cohere_shaped(reranker):
    """`/v1/rerank` and `/v2/rerank` (what Jina's and Cohere's clients send, as vLLM serves it) against the
    cross-encoder's logit of each pair alone."""
    cross = ServedModel(reranker, name="bge-reranker")
    documents = ["day", {"text": "the king dies"}, "a crown", "the sword speaks at night"]
    texts = [d if isinstance(d, str) else d["text"] for d in documents]
    alone = [cross.model(**cross.tokenizer("the king", text, return_tensors="pt")).logits[0, 0].sigmoid().item()
             for text in texts]
    best = sorted(range(len(texts)), key=lambda i: -alone[i])
    for path in ("/v1/rerank", "/v2/rerank"):
        answer = cross.answer(path, {"model": "bge-reranker", "query": "the king", "documents": documents, "top_n": 3})
        assert [result["index"] for result in answer["results"]] == best[:3]
        assert [result["relevance_score"] for result in answer["results"]] == pytest.approx(
            [alone[i] for i in best[:3]], abs=1e-5)
        assert [result["document"]["text"] for result in answer["results"]] == [texts[i] for i in best[:3]]
        assert answer["model"] == "bge-reranker" and answer["id"].startswith("rerank-")
        assert answer["usage"]["total_tokens"] == sum(len(cross.tokenizer("the king", text)["input_ids"])
                                                      for text in texts)
    bare = cross.answer("/v1/rerank", {"query": "the king", "documents": texts, "return_documents": False, "top_n": 0})
    assert [result["index"] for result in bare["results"]] == best and "document" not in bare["results"][0]
    # `/rerank` takes this shape too (vLLM and Infinity answer it there), and text-embeddings-inference's.
    legacy = cross.answer("/rerank", {"query": "the king", "documents": texts})
    assert [result["index"] for result in legacy["results"]] == best
    assert [result["index"] for result in cross.answer("/rerank", {"query": "the king", "texts": texts})] == best
    with pytest.raises(RequestError) as refused:
        cross.answer("/rerank", {"query": "the king"})
    assert (refused.value.status, refused.value.param) == (422, "texts") and "documents" in refused.value.message
    with pytest.raises(RequestError) as refused:
        cross.answer("/v1/rerank", {"model": "rerank-english-v3.0", "query": "the king", "documents": texts})
    assert (refused.value.status, refused.value.param) == (404, "model")
    with pytest.raises(RequestError) as refused:
        cross.answer("/v1/rerank", {"query": "the king", "documents": texts, "max_tokens_per_doc": 64})
    assert (refused.value.status, refused.value.param) == (422, "max_tokens_per_doc")


def test_similarity_is_the_cosine_of_the_embeddings(served):
    """`/similarity`, as the huggingface_hub client's `sentence_similarity` sends it, against `encode`."""
    for name in ("mlm", "sim"):  # mean pooling, and RoFormer-Sim's pooler
        server = served[name]
        unit = encode(server.model, server.tokenizer, SENTENCES, normalize=True)
        got = server.answer("/similarity", {"inputs": {"source_sentence": SENTENCES[0], "sentences": SENTENCES[1:]},
                                            "parameters": {}})
        torch.testing.assert_close(torch.tensor(got), unit[1:] @ unit[0], atol=1e-5, rtol=0)
    cut = served["mlm"].answer("/similarity", {"inputs": {"source_sentence": "the king " * 20, "sentences": ["day"]},
                                               "parameters": {"truncate": True, "truncation_direction": "Left"}})
    assert len(cut) == 1 and -1 <= cut[0] <= 1


def test_predict_takes_the_text_classification_parameters(served):
    """The `parameters` the huggingface_hub client's `text_classification` sends: `function_to_apply` in place of
    the default softmax, `top_k` best labels."""
    server = served["clf"]
    logits = server.model(**server.tokenizer(SENTENCES, padding=True, return_tensors="pt")).logits.detach()
    labels = server.model.config.id2label
    for function, expected in (("none", logits), ("sigmoid", logits.sigmoid()), ("softmax", logits.softmax(-1))):
        got = server.answer("/predict", {"inputs": SENTENCES, "parameters": {"function_to_apply": function}})
        for row, scores in zip(got, expected):
            assert {entry["label"]: entry["score"] for entry in row} == pytest.approx(
                {labels[k]: score for k, score in enumerate(scores.tolist())}, abs=1e-5)
    best = server.answer("/predict", {"inputs": "the king", "parameters": {"top_k": 1}})
    assert [entry["label"] for entry in best] == [labels[logits[0].argmax().item()]]
    assert server.answer("/predict", {"inputs": SENTENCES, "parameters": {}}) == \
        server.answer("/predict", {"inputs": SENTENCES})
    with pytest.raises(RequestError) as refused:
        server.answer("/predict", {"inputs": "day", "raw_scores": True, "parameters": {"function_to_apply": "softmax"}})
    assert (refused.value.status, refused.value.param) == (422, "parameters")


def test_fill_mask_is_the_fill_mask_pipeline(served):
    server = served["mlm"]
    fill = transformers.pipeline("fill-mask", model=server.model, tokenizer=server.tokenizer, top_k=3)
    inputs = ["the king [MASK] a crown", "[MASK] and [MASK]"]  # one mask, then two
    got = server.answer("/fill-mask", {"inputs": inputs, "top_k": 3})
    expected = fill(inputs)
    assert len(got[1]) == 2 and len(got[0]) == 3
    for got_row, expected_row in zip([got[0], *got[1]], [expected[0], *expected[1]]):
        assert [(e["token"], e["token_str"], e["sequence"]) for e in got_row] == \
            [(e["token"], e["token_str"], e["sequence"]) for e in expected_row]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(got_row, expected_row)) < 1e-5


@pytest.mark.parametrize("name", ["lm", "sim"])
def test_completions_batched_equal_each_alone(served, name):
    server = served[name]
    prompts = ["the king", "a queen loves the crown and the sword", "day"]
    ids = server.tokenizer(prompts)["input_ids"]
    greedy = server.complete([Completion(row, 0) for row in ids], 8, 0.0, 1.0)
    assert greedy == [_greedy(server.model, server.tokenizer, prompt, 8) for prompt in prompts]
    rows = [Completion(row, seed) for row in ids for seed in (1, 2)]
    sampled = server.complete(rows, 8, 1.0, 0.9)
    assert sampled == [server.complete([row], 8, 1.0, 0.9)[0] for row in rows]
    assert sampled[0] != sampled[1] or sampled[2] != sampled[3]  # the seed matters
    answer = server.answer("/v1/completions", {"prompt": prompts[0], "max_tokens": 8, "temperature": 0})
    assert answer["choices"][0]["text"] == server.tokenizer.decode(greedy[0], skip_special_tokens=True)
    assert answer["usage"]["completion_tokens"] == len(greedy[0])


def test_similar_is_generate_similar(served):
    server = served["sim"]
    answer = server.answer("/similar", {"sentences": SENTENCES[:2], "n": 4, "seed": 3, "max_new_tokens": 6})
    expected = generate_similar(server.model, server.tokenizer, SENTENCES[:2], 4, seed=3, max_new_tokens=6)
    assert [[(s["text"], round(s["score"], 5)) for s in row["similar"]] for row in answer["data"]] == \
        [[(s.text, round(s.score, 5)) for s in ranked] for ranked in expected]


BAD_REQUESTS = [  # (route, body, status, field)
    ("/v1/embeddings", {"input": 3}, 422, "input"),
    ("/v1/embeddings", {"input": []}, 422, "input"),
    ("/v1/embeddings", {"input": ["the king", "  "]}, 422, "input"),
    ("/v1/embeddings", {"input": ["day"] * 9}, 413, "input"),
    ("/v1/embeddings", {"input": "the king " * 20}, 413, "input"),
    ("/v1/embeddings", {"input": "day", "encoding_format": "int8"}, 422, "encoding_format"),
    ("/embed", {"inputs": "day", "normalize": "yes"}, 422, "normalize"),
    ("/v1/completions", {"prompt": "day", "max_tokens": 0}, 422, "max_tokens"),
    ("/v1/completions", {"prompt": "day", "temperature": "hot"}, 422, "temperature"),
    ("/similar", {"sentences": "day", "n": 0}, 422, "n"),
    ("/similarity", {"inputs": {"source_sentence": "day", "sentences": []}}, 422, "inputs.sentences"),
    ("/similarity", {"inputs": {"source_sentence": " ", "sentences": ["day"]}}, 422, "inputs.source_sentence"),
    ("/similarity", {"inputs": {"source_sentence": "day", "sentences": ["a"]}, "parameters": {"top_k": 2}}, 422,
     "parameters"),
    ("/", {"inputs": "day", "raw_scores": True}, 422, "raw_scores"),
    ("/", ["day"], 422, None),
]


@pytest.fixture(scope="module")
def strict(folders):
    return ServedModel(folders["sim"], max_inputs=8)


@pytest.mark.parametrize("route, body, status, param", BAD_REQUESTS)
def test_bad_requests_are_refused_naming_the_field(strict, route, body, status, param):
    with pytest.raises(RequestError) as refused:
        strict.answer(route, body)
    assert (refused.value.status, refused.value.body()["error"]["param"]) == (status, param)
    assert "expected" in refused.value.message


def test_truncate_cuts_a_long_input(strict):
    long = "the king " * 20
    got = strict.answer("/embed", {"inputs": long, "truncate": True, "normalize": False})
    expected = encode(strict.model, strict.tokenizer, [long])  # encode truncates at model_max_length
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=0)


def test_auto_truncate_cuts_what_a_request_leaves_unsaid(folders):
    """`--auto-truncate` (text-embeddings-inference's): a long input is cut where its request does not set
    `truncate`, and still refused where it sets `truncate: false`; every route that reads texts follows it."""
    from roformer_hf.serving import build_app

    sim, clf = (ServedModel(folders[name], auto_truncate=True) for name in ("sim", "clf"))
    long = "the king " * 20
    expected = encode(sim.model, sim.tokenizer, [long])  # encode truncates at model_max_length
    for route, body, read in (("/embed", {"inputs": long, "normalize": False}, torch.tensor),
                              ("/v1/embeddings", {"input": long}, lambda a: torch.tensor([a["data"][0]["embedding"]]))):
        torch.testing.assert_close(read(sim.answer(route, body)), expected, atol=1e-5, rtol=0)
        with pytest.raises(RequestError) as refused:
            sim.answer(route, {**body, "truncate": False})
        assert refused.value.status == 413
    assert len(sim.answer("/embed_all", {"inputs": long})[0]) == sim.tokenizer.model_max_length
    assert clf.answer("/predict", {"inputs": long}) == clf.answer("/predict", {"inputs": long, "truncate": True})
    assert sim.answer("/info")["auto_truncate"] is True and ServedModel(folders["sim"]).answer("/info")[
        "auto_truncate"] is False
    assert build_app({"folder": str(folders["sim"]), "auto_truncate": "true"})._bound_deployment.init_kwargs[
        "auto_truncate"] is True


def test_the_command_and_build_app_share_their_defaults(monkeypatch):
    """`roformer-hf serve`'s flags default to what `build_app` (and `serve run`) takes without them."""
    from roformer_hf.cli import _parser
    from roformer_hf.serving import ARGUMENTS

    monkeypatch.delenv("ROFORMER_HF_API_KEY", raising=False)
    serve = next(action for action in _parser()._actions if action.dest == "command").choices["serve"]
    flags = {action.dest: action.default for action in serve._actions}
    renamed = {"request_timeout_s": "request_timeout"}
    shared = {name: default for name, (_, default) in ARGUMENTS.items() if renamed.get(name, name) in flags}
    assert len(shared) >= 15
    assert {name: flags[renamed.get(name, name)] for name in shared} == shared
    page = (Path(__file__).parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
    listed = re.search(r"^`build_app`: (.*?)\.$", page, flags=re.MULTILINE | re.DOTALL).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == set(ARGUMENTS)  # the page names every argument, and no other


# The folders that cannot be served: refused at start by the CLI, before the port opens.


def _unservable(folders, tmp_path):
    no_tokenizer = tmp_path / "no_tokenizer"
    RoFormerForMaskedLM.from_pretrained(folders["mlm"]).save_pretrained(no_tokenizer)
    pickled = tmp_path / "pickled"
    model = RoFormerForMaskedLM.from_pretrained(folders["mlm"])
    pickled.mkdir()
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    (pickled / "vocab.txt").write_text((folders["mlm"] / "vocab.txt").read_text())
    unknown = tmp_path / "unknown"
    model.save_pretrained(unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["RoFormerForPoetry"]}))
    (unknown / "vocab.txt").write_text((folders["mlm"] / "vocab.txt").read_text())
    return [(no_tokenizer, "holds no tokenizer"), (pickled, "only as a pickle"), (unknown, "RoFormerForPoetry")]


def test_cli_refuses_an_unservable_folder_before_the_port_opens(folders, tmp_path, capsys):
    unservable = _unservable(folders, tmp_path)
    for folder, message in unservable[:-1]:  # in this process: it exits before Ray starts
        with pytest.raises(SystemExit) as exited:
            main(["serve", str(folder), "--port", str(free_port())])
        assert exited.value.code != 0 and message in capsys.readouterr().err
    import ray

    assert not ray.is_initialized()
    folder, message = unservable[-1]  # the command itself
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([PYTHON, "-m", "roformer_hf.cli", "serve", str(folder), "--port", str(port)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens


def test_haproxy_pages_get_ports_free_on_every_address(monkeypatch):
    """HAProxy's Prometheus and stats pages listen on every address (0.0.0.0), so `free_ports` probes them there: a
    port that another program holds on another of the machine's addresses is passed over, where a probe on the
    loopback alone would hand it out and HAProxy would stop at "cannot bind socket"."""
    from roformer_hf.serving import ingress

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect(("192.0.2.1", 9))  # sends nothing: the address the machine would send from
            address = udp.getsockname()[0]
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this machine has no address but the loopback")
    held_port = ingress.free_ports(1)
    choose = ingress.random.choice
    chosen = []

    def held_first(starts):  # the held port first, then as free_ports chooses
        chosen.append(choose(starts) if chosen else held_port)
        return chosen[-1]

    for name in ingress.HAPROXY_PORTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ingress.random, "choice", held_first)
    with socket.socket() as held:
        held.bind((address, held_port))
        held.listen()
        ports = {int(port) for port in ingress.haproxy_ports_env().values()}
    assert len(chosen) >= 2 and held_port not in ports and len(ports) == len(ingress.HAPROXY_PORTS), (chosen, ports)


def test_direct_ports_are_checked_before_ray_starts(folders, capsys, caplog, monkeypatch, tmp_path):
    from roformer_hf.serving import direct_ingress_env, ephemeral_ports
    from roformer_hf.serving import ingress as serving

    assert direct_ingress_env(9000, replicas=2) == {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "9000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "9004", "RAY_SERVE_PORT_QUARANTINE_S": "0"}
    assert ephemeral_ports(str(tmp_path / "absent")) is None
    (tmp_path / "range").write_text("32768\t60999\n", encoding="ascii")
    assert ephemeral_ports(str(tmp_path / "range")) == (32768, 60999)
    monkeypatch.setattr(serving, "ephemeral_ports", lambda: (32768, 60999))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roformer_hf.serving"):
        direct_ingress_env(32760, replicas=4)  # 32760 to 32767: below them
        assert not caplog.records
        direct_ingress_env(32762, replicas=4)  # 32762 to 32769
    assert "ports 32762 to 32769 overlap the system's ephemeral ports, 32768 to 60999" in caplog.text
    first = serving.free_ports(6)  # below the (patched) ephemeral ports, outside Ray Serve's own, all six free
    assert 20000 <= first <= 32768 - 6 and not 30000 - 6 < first < 31000
    monkeypatch.setattr(serving, "ephemeral_ports", lambda: (30010, 60999))  # room only below Ray Serve's ports
    assert all(20000 <= serving.free_ports(6) < 30000 - 6 for _ in range(20))
    for port in range(first, first + 6):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
    monkeypatch.setattr(serving, "ephemeral_ports", lambda: (1024, 65535))  # a system that gives out every port
    with pytest.raises(RuntimeError, match="count=6: no range of that many ports between Ray's worker ports"):
        serving.free_ports(6)
    for name in direct_ingress_env(9000):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever the command set
    for argv, message in ((["--port", "9001", "--direct-port", "9000"], "--port=9001: expected a port outside"),
                          (["--direct-port", "0"], "--direct-port=0: port=0: expected a port number")):
        with pytest.raises(SystemExit) as exited:
            main(["serve", str(folders["sim"]), *argv])
        assert exited.value.code != 0 and message in capsys.readouterr().err
    import ray

    assert not ray.is_initialized()


def test_cli_gives_the_proxy_time_to_start(folders, monkeypatch):
    """Ray's processes read their settings once, when `ray.init` starts them: by then the command has given Ray
    Serve's proxy 30 s to become ready (with Ray's 5 s, a proxy starting on a busy machine was killed and
    `serve.start` failed), unless the user chose a value."""
    import ray

    class Started(Exception):
        pass

    seen = []

    def init(*args, **kwargs):
        seen.append(os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"))
        raise Started

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)  # restored after the test
    for chosen in (None, "12"):
        if chosen is not None:
            monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", chosen)
        with pytest.raises(Started):
            main(["serve", str(folders["sim"]), "--port", str(free_port())])
    assert seen == ["30", "12"]


def test_cli_refuses_a_port_in_use_before_ray_starts(folders, capsys):
    from roformer_hf.cli import port_refusal

    with socket.socket() as holder:  # a server on the port, as a killed run's HAProxy would be
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            main(["serve", str(folders["sim"]), "--port", str(port)])
        assert exited.value.code == 1
        assert f"--port={port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in capsys.readouterr().err
    assert port_refusal("127.0.0.1", port) is None  # free again once that server stopped
    import ray

    assert not ray.is_initialized()


@pytest.fixture
def every_length(monkeypatch):
    """The compiled encoder or classifier takes one input of any length (the test sentences have 3 to 12 tokens),
    whatever this CPU kind's rule sends it (`fused.DenseRule.compiled_max_tokens`: 8 on CPUs with AVX2 only)."""
    monkeypatch.setattr(fused, "RULE", dataclasses.replace(fused.RULE, compiled_max_tokens=math.inf))


def _compiled_inputs(served) -> str:
    """What `LoadedModel.describe` says of the inputs the compiled encoder or classifier takes: one at a time, up to
    the model's longest or the CPU kind's rule's, the shorter."""
    longest = min(served.loaded.max_length, fused.RULE.compiled_max_tokens)
    return f"one input of at most {longest:.0f} tokens at a time compiled"


def _ran(served, body):
    """The answer to an embeddings request, and whether it ran the compiled encoder and eager ops (the profiler's
    events: aten's embedding lookup, which the compiled encoder's own kernel does instead)."""
    compiled, calls = served.loaded.compiled, []
    runner = compiled.runner if compiled is not None else None
    if compiled is not None:
        compiled.runner = lambda ids: calls.append(ids) or runner(ids)
    try:
        with torch.profiler.profile() as profiler:
            answer = served.answer("/v1/embeddings", body)
    finally:
        if compiled is not None:
            compiled.runner = runner
    names = {event.name for event in profiler.events()}
    got = torch.stack([torch.as_tensor(row["embedding"]) for row in answer["data"]])
    return got, bool(calls), "aten::embedding" in names


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sim", "mlm"])
def test_compiled_encoder_embeds_one_input_as_encode_does_and_loads_from_its_cache_next_time(folders, name, tmp_path,
                                                                                             monkeypatch, every_length):
    eager = ServedModel(folders[name])
    before = encode(eager.model, eager.tokenizer, SENTENCES)
    served = ServedModel(folders[name], compile=True, compile_cache=tmp_path)  # compiles here, before any request
    package = served.loaded.compiled.path
    assert served.loaded.describe().endswith(f"{_compiled_inputs(served)}, saved to {package})")
    assert package.parent == tmp_path and package.suffix == ".pt2"
    factors = json.loads(package.with_suffix(".json").read_text())
    assert factors["key"] == package.stem and factors["threads"] == torch.get_num_threads()
    for i, sentence in enumerate(SENTENCES):  # lengths 3 to 12: one package for every length
        got, compiled, eager_ops = _ran(served, {"input": sentence})
        assert compiled and not eager_ops
        torch.testing.assert_close(got[0], before[i], atol=1e-5, rtol=0)
    # An input longer than this CPU kind's rule sends to the package runs eagerly: there the eager model is faster.
    rule = fused.RULE
    monkeypatch.setattr(fused, "RULE", dataclasses.replace(rule, compiled_max_tokens=6))
    lengths = [len(ids) for ids in served.tokenizer(SENTENCES)["input_ids"]]
    assert min(lengths) <= 6 < max(lengths)
    for i, (sentence, length) in enumerate(zip(SENTENCES, lengths)):
        got, compiled, eager_ops = _ran(served, {"input": sentence})
        assert (compiled, eager_ops) == ((True, False) if length <= 6 else (False, True))
        torch.testing.assert_close(got[0], before[i], atol=1e-5, rtol=0)
    monkeypatch.setattr(fused, "RULE", rule)
    got, compiled, eager_ops = _ran(served, {"input": SENTENCES})  # several inputs: the eager model, unpadded
    assert eager_ops and not compiled
    torch.testing.assert_close(got, before, atol=1e-5, rtol=0)
    # One token, a length the package does not take: it runs eagerly.
    token = served.tokenizer.cls_token_id
    got, compiled, eager_ops = _ran(served, {"input": [[token]]})
    assert eager_ops and not compiled
    with torch.no_grad():
        alone = eager.embed_batch({"input_ids": torch.tensor([[token]]), "attention_mask": torch.ones(1, 1).long()})
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    # Compiling froze a copy of the weights: the eager model is as it was.
    torch.testing.assert_close(encode(served.model, served.tokenizer, SENTENCES), before, atol=0, rtol=0)

    # The next start loads the package: nothing compiles, and it answers as the one that compiled it.
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", _no_compiler)
    again = ServedModel(folders[name], compile=True, compile_cache=tmp_path)
    assert again.loaded.compiled.loaded and again.loaded.compiled.path == package
    assert again.loaded.describe().endswith(f"{_compiled_inputs(again)}, loaded from {package})")
    for sentence in SENTENCES[:3]:
        got, compiled, _ = _ran(again, {"input": sentence})
        assert compiled
        torch.testing.assert_close(got, _ran(served, {"input": sentence})[0], atol=0, rtol=0)


def _no_compiler(*args, **kwargs):
    raise OSError("g++: not found")


def test_compile_cache_keys_hold_what_the_compiled_code_depends_on(folders, tmp_path):
    import shutil

    from roformer_hf.serving.compiled import cache_key

    model = ServedModel(folders["mlm"]).model.base_model
    key = cache_key(model, "float32", 32)
    assert cache_key(model, "float32", 32) == key  # the same model, the same key
    ids = torch.tensor([[2, 5, 6, 3]])
    others = [cache_key(model, "bfloat16", 32), cache_key(model, "float32", 16),
              cache_key(model, "int8", 32, [{"input_ids": ids}]),
              cache_key(model, "int8", 32, [{"input_ids": ids + 1}]),
              cache_key(model, "int8", 32, [{"input_ids": ids, "token_type_ids": torch.ones_like(ids)}])]
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight[0, 0] += 1e-3  # one weight of one layer
    others.append(cache_key(model, "float32", 32))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # inductor writes the thread count into its kernels
        others.append(cache_key(model, "float32", 32))
    finally:
        torch.set_num_threads(threads)
    keys = [key["key"]] + [other["key"] for other in others]
    assert len(set(keys)) == len(keys)
    moved = Path(shutil.copytree(folders["mlm"], tmp_path / "moved"))  # where the folder lies is no part of the key
    assert cache_key(ServedModel(moved).model.base_model, "float32", 32)["key"] == key["key"]
    assert {name for name in key if key[name] != others[-2][name]} == {"weights", "key"}


@pytest.mark.slow
def test_a_compile_cache_entry_that_is_broken_or_answers_wrongly_is_compiled_again(folders, tmp_path, caplog):
    import shutil

    served = ServedModel(folders["sim"], compile=True, compile_cache=tmp_path / "cache")
    package = served.loaded.compiled.path
    expected = _ran(served, {"input": SENTENCES[0]})[0]
    # Another model's package under this model's key: the same architecture, other weights.
    retrained = Path(shutil.copytree(folders["sim"], tmp_path / "retrained"))
    model = RoFormerForCausalLM.from_pretrained(retrained)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std().nan_to_num())
    model.save_pretrained(retrained)
    other = ServedModel(retrained, compile=True, compile_cache=tmp_path / "other").loaded.compiled.path
    for broken, why in ((other, "answers a probe input unlike the eager model"),
                        (b"not a package", "RuntimeError")):  # a copy cut short, a disk's fault
        if isinstance(broken, Path):
            shutil.copy(broken, package)
        else:
            package.write_bytes(broken)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="roformer_hf.serving.compiled"):
            again = ServedModel(folders["sim"], compile=True, compile_cache=tmp_path / "cache")
        assert f"compiled encoder {package} could not be used" in caplog.text and why in caplog.text
        assert not again.loaded.compiled.loaded and again.loaded.compiled.path == package  # compiled and replaced
        torch.testing.assert_close(_ran(again, {"input": SENTENCES[0]})[0], expected, atol=1e-5, rtol=0)
        third = ServedModel(folders["sim"], compile=True, compile_cache=tmp_path / "cache")
        assert third.loaded.compiled.loaded and third.loaded.compiled.path == package  # what replaced it serves


def test_a_full_compile_cache_removes_the_least_recently_used_packages(folders, tmp_path, caplog, monkeypatch):
    import time

    from roformer_hf.serving import compiled

    cache = tmp_path / "cache"
    cache.mkdir()
    now = time.time()
    key = {name: name * 32 for name in "abcd"}  # as `cache_key` names packages
    for age, name in enumerate("abcd"):  # d used longest ago
        (cache / f"{key[name]}.pt2").write_bytes(b"x" * 1000)
        (cache / f"{key[name]}.json").write_text("{}")
        (cache / f"{key[name]}.lock").touch()
        os.utime(cache / f"{key[name]}.pt2", (now - 60 * age, now - 60 * age))
    (cache / "mine.pt2").write_bytes(b"x" * 10_000)  # not a package of this cache's: never counted or removed
    os.utime(cache / "mine.pt2", (now - 7200, now - 7200))
    stale, fresh = cache / f"{key['b']}.123.part", cache / f"{key['c']}.456.part"  # saves that stopped midway
    for part, age in ((stale, compiled.LOCK_TIMEOUT_S + 60), (fresh, 10)):
        part.write_bytes(b"x" * 10_000)
        os.utime(part, (now - age, now - age))
    a, b, c, d = (cache / f"{key[name]}.pt2" for name in "abcd")
    os.utime(a, (now - 3600, now - 3600))  # a: the package just saved, though its file is older
    assert compiled.prune(cache, a, 2500) == [d, c]
    assert sorted(path.name for path in cache.iterdir()) == sorted(
        [f"{key['a']}.json", f"{key['a']}.lock", f"{key['a']}.pt2", f"{key['b']}.json", f"{key['b']}.lock",
         f"{key['b']}.pt2", f"{key['c']}.lock", f"{key['d']}.lock", "mine.pt2", fresh.name])  # the stale copy went
    assert compiled.prune(cache, a, 10) == [b]  # never the one just saved
    assert compiled.prune(cache, a, 10) == [] and (cache / "mine.pt2").is_file()

    monkeypatch.setenv(compiled.CACHE_LIMIT_ENV, "0")
    assert compiled.cache_limit() is None
    monkeypatch.setenv(compiled.CACHE_LIMIT_ENV, "1.5")
    assert compiled.cache_limit() == 1_500_000
    for bad in ("lots", "-1", "inf"):
        monkeypatch.setenv(compiled.CACHE_LIMIT_ENV, bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="roformer_hf.serving.compiled"):
            assert compiled.cache_limit() is None
        assert f"ROFORMER_HF_COMPILE_CACHE_MB={bad!r}: expected a number of megabytes" in caplog.text
    monkeypatch.delenv(compiled.CACHE_LIMIT_ENV)
    assert compiled.cache_limit() == compiled.DEFAULT_CACHE_LIMIT_MB * 10**6

    # Starts that save packages keep the folder within the limit; a load makes its package the last to go.
    def writes_a_package(build, example, max_length, path, kind):  # 400 kB, answering as the eager model
        path.write_bytes(b"x" * 400_000)
        return kind(build(), path, max_length, loaded=False)

    sim = compiled.OneInput(ServedModel(folders["sim"]).model.base_model).eval()
    monkeypatch.setattr(compiled, "_compile", writes_a_package)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: sim)  # loads RoFormer-Sim's, below
    monkeypatch.setenv(compiled.CACHE_LIMIT_ENV, "1")  # two packages of 400 kB fit, three do not
    folder = tmp_path / "lru"
    first = ServedModel(folders["sim"], compile=True, compile_cache=folder).loaded.compiled.path
    second = ServedModel(folders["mlm"], compile=True, compile_cache=folder).loaded.compiled.path
    os.utime(first, (now - 60, now - 60))
    os.utime(second, (now - 30, now - 30))
    loaded = ServedModel(folders["sim"], compile=True, compile_cache=folder).loaded.compiled
    assert loaded.loaded and loaded.path == first and first.stat().st_mtime > second.stat().st_mtime
    with caplog.at_level(logging.INFO, logger="roformer_hf.serving.compiled"):
        third = ServedModel(folders["clf"], compile=True, compile_cache=folder).loaded.compiled.path
    assert sorted(folder.glob("*.pt2")) == sorted([first, third])  # the mlm's, least recently used, went
    assert f"removed {second.name}, the least recently used beyond 1 MB" in caplog.text


def test_a_compile_cache_that_cannot_be_written_or_stays_locked_compiles_without_it(folders, tmp_path, caplog,
                                                                                     monkeypatch):
    from filelock import FileLock

    from roformer_hf.serving import compiled

    # compiled as the eager encoder it is built from: this test is about where it goes
    monkeypatch.setattr(compiled, "_compile", lambda build, example, max_length, path, kind: kind(
        build(), path, max_length, loaded=False))
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    with caplog.at_level(logging.WARNING, logger="roformer_hf.serving.compiled"):
        served = ServedModel(folders["sim"], compile=True, compile_cache=blocked / "cache")
    assert f"compile cache {blocked / 'cache'} cannot be written" in caplog.text
    assert served.loaded.compiled.path is None and served.loaded.describe().endswith("compiled, not saved)")

    # Another process holds the key's lock and never lets go (a hung compile): after the timeout, compiled unsaved.
    factors = compiled.cache_key(served.model.base_model, "float32", served.loaded.max_length)
    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(compiled, "LOCK_TIMEOUT_S", 0.5)
    holder = FileLock(tmp_path / "cache" / f"{factors['key']}.lock", thread_local=False)
    with holder, ThreadPoolExecutor(1) as other:  # a lock of another thread: as another process's, it blocks
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="roformer_hf.serving.compiled"):
            waited = other.submit(ServedModel, folders["sim"], compile=True, compile_cache=tmp_path / "cache").result()
    assert "Timeout" in caplog.text and waited.loaded.compiled.path is None
    assert not list((tmp_path / "cache").glob("*.pt2"))


# Two replicas starting at once: each waits for the other to be ready, then loads the folder with `compile`.
_STARTING_TOGETHER = """
import json, sys, time
from pathlib import Path
from roformer_hf.serving import ServedModel
folder, cache, ready, me = sys.argv[1:5]
Path(ready, me).touch()
deadline = time.monotonic() + 60
while len(list(Path(ready).iterdir())) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
served = ServedModel(folder, compile=True, compile_cache=cache)
embedding = [float(x) for x in served.answer("/v1/embeddings", {"input": "the king dies"})["data"][0]["embedding"]]
print(json.dumps({"loaded": served.loaded.compiled.loaded, "path": str(served.loaded.compiled.path),
                  "embedding": embedding}))
"""


@pytest.mark.slow
def test_replicas_starting_together_compile_once_and_serve_the_same_package(folders, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    logs = [(tmp_path / f"out{i}", tmp_path / f"err{i}") for i in range(2)]  # files: no pipe fills and blocks
    starts = []
    try:
        for i, (out, err) in enumerate(logs):
            with open(out, "w", encoding="utf-8") as stdout, open(err, "w", encoding="utf-8") as stderr:
                starts.append(subprocess.Popen([PYTHON, "-c", _STARTING_TOGETHER, str(folders["sim"]),
                                                str(tmp_path / "cache"), str(ready), str(i)],
                                               stdout=stdout, stderr=stderr, env=env))
        for start, (out, err) in zip(starts, logs):
            assert start.wait(timeout=300) == 0, err.read_text()[-2000:]
    finally:
        for start in starts:
            start.kill()
            start.wait()
    answers = [json.loads(out.read_text().strip().splitlines()[-1]) for out, _ in logs]
    # one compiled and saved; the other waited on the key's lock and loaded what it saved
    assert sorted(answer["loaded"] for answer in answers) == [False, True]
    assert answers[0]["path"] == answers[1]["path"]
    assert [path.name for path in (tmp_path / "cache").glob("*.pt2")] == [Path(answers[0]["path"]).name]
    assert answers[0]["embedding"] == answers[1]["embedding"]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """A calibration file: inputs like those the server embeds, one per line, blank lines among them, and one longer
    than the tokenizer's 32 tokens (truncated)."""
    path = tmp_path_factory.mktemp("calibration") / "inputs.txt"
    lines = [sentence for line in SERVING_CORPUS for sentence in line.split(" and ")] + [" ".join(SERVING_CORPUS)]
    path.write_text("\n\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def static_sim(folders, calibration):
    """RoFormer-Sim served with int8 and compile: one input at a time through the encoder quantized statically."""
    pytest.importorskip("torchao", reason="the compiled int8 encoder is quantized with torchao")
    return ServedModel(folders["sim"], int8=True, compile=True, calibration=calibration)


def test_a_classifiers_calibration_holds_pairs_and_probes_with_one(tokenizer, calibration):
    from roformer_hf.serving.loaded import calibration_batches, calibration_probe, calibration_rows

    lines = [line for line in calibration.read_text().splitlines() if line]
    for pairs in (True, False):
        rows = calibration_rows(tokenizer, lines, 32, pairs)
        expected = [tokenizer(line, truncation=True, max_length=32)["input_ids"] for line in lines]
        if pairs:
            expected += [tokenizer(a, b, truncation=True, max_length=32)["input_ids"]
                         for a, b in zip(lines[0::2], lines[1::2])]
        assert [row["input_ids"] for row in rows] == expected
        probe = calibration_probe(calibration_batches(rows, 64))
        assert probe["input_ids"].shape[0] == 1
        # a classifier's probe is a pair, though the batches put the lines alone before the pairs of their length
        assert set(probe) == ({"input_ids", "token_type_ids"} if pairs else {"input_ids"})
        assert not pairs or probe["token_type_ids"].any()


@pytest.mark.parametrize("seed", range(5))
def test_calibration_batches_hold_every_row_once_by_length_within_the_budget(seed):
    from roformer_hf.serving.loaded import calibration_batches

    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 100, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 12, (40,), generator=generator)]
    types = [torch.randint(0, 2, (len(row),), generator=generator).tolist() for row in rows]  # a classifier's rows
    budget = int(torch.randint(5, 40, (1,), generator=generator))
    batches = calibration_batches([{"input_ids": row, "token_type_ids": kinds} for row, kinds in zip(rows, types)],
                                  budget)
    assert sorted((row, kinds) for batch in batches for row, kinds in zip(batch["input_ids"].tolist(),
                                                                          batch["token_type_ids"].tolist())) == \
        sorted((row, kinds) for row, kinds in zip(rows, types) if len(row) >= 2)  # each row with its own types
    batches = [batch["input_ids"] for batch in batches]
    for batch in batches:  # one length, no padding; within the budget unless one row alone exceeds it
        assert batch.dim() == 2 and (batch.numel() <= budget or len(batch) == 1)
    assert [len(batch) for batch in batches] == sorted((len(batch) for batch in batches), reverse=True)
    lengths = {len(row) for row in rows if len(row) >= 2}
    needed = sum(-(-sum(len(row) == n for row in rows) // max(1, budget // n)) for n in lengths)
    assert len(batches) == needed  # as few forwards as the budget allows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sim", "mlm"])
def test_compiled_int8_encoder_is_quantized_statically_and_embeds_one_input_near_fp32(folders, calibration, static_sim,
                                                                                     name, tmp_path, every_length):
    from roformer_hf.serving.compiled import CompiledEncoder, OneInput
    from roformer_hf.serving.loaded import (
        CALIBRATION_TOKENS,
        calibration_batches,
        calibration_rows,
        static_int8_encoder,
    )

    fp32, dynamic = ServedModel(folders[name]), ServedModel(folders[name], int8=True)
    expected = encode(fp32.model, fp32.tokenizer, SENTENCES)
    if name == "sim":  # calibration lines of one length run together: several rows a forward
        served = static_sim
    else:  # every line of another length: one row a forward
        calibration = tmp_path / "distinct.txt"
        calibration.write_text("the king\nthe queen loves\na crown and a sword at night\n")
        served = ServedModel(folders[name], int8=True, compile=True, calibration=calibration)
    lines = [line for line in calibration.read_text().splitlines() if line]
    rows = served.tokenizer(lines, truncation=True, max_length=served.loaded.max_length)["input_ids"]
    assert (len({len(ids) for ids in rows}) < len(rows)) == (name == "sim")
    assert re.search(rf"{_compiled_inputs(served)} \(int8 static, calibrated on {len(lines)} inputs\), "
                     r"(saved to|loaded from) .*\.pt2\)$", served.loaded.describe())
    # What the package was compiled from is torchao's static quantization of the encoder: every dense layer's input
    # quantized with a fixed scale (query/key/value share theirs), its weight per channel; run uncompiled, it is the
    # reference. The same calibration gives the same scales.
    batches = calibration_batches(calibration_rows(served.tokenizer, lines, served.loaded.max_length, pairs=False),
                                  CALIBRATION_TOKENS)
    graph = static_int8_encoder(OneInput(fp32.model.base_model).eval(), batches, served.loaded.max_length)
    targets = [str(node.target) for node in graph.graph.nodes]
    linears = sum(type(module) is torch.nn.Linear for module in fp32.model.base_model.modules())
    assert sum(t == "quantized_decomposed.dequantize_per_channel.default" for t in targets) == linears
    assert (sum(t == "quantized_decomposed.quantize_per_tensor.default" for t in targets)
            >= 4 * served.config.num_hidden_layers)
    reference = embedder_of(served, CompiledEncoder(graph, None, served.loaded.max_length, loaded=False))
    for i, sentence in enumerate(SENTENCES):
        got, compiled, eager_ops = _ran(served, {"input": sentence})
        assert compiled and not eager_ops
        ids = torch.tensor([served.tokenizer(sentence)["input_ids"]])
        with torch.no_grad():
            expected_static = reference({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        # The quantization itself: int8 near fp32, not equal to it. The reference computes in fp32, so its error is the
        # quantization's on any CPU: at worst 0.9992 on these sentences with 8-bit activations, 0.9986 with the 7 bits
        # of CPUs without VNNI (`quantization.static_int8`).
        assert torch.cosine_similarity(expected_static[0], expected[i], dim=0) > 0.998
        assert not torch.allclose(got[0], expected[i], atol=1e-6, rtol=0)
        # The kernels: inductor's fused int8 kernels round as the reference does but for values on a rounding boundary,
        # where an activation moves one step (0.03 here, seen on one CI run). Their error adds to the quantization's.
        assert torch.cosine_similarity(got[0], expected_static[0], dim=0) > 0.999
        torch.testing.assert_close(got[0], expected_static[0], atol=0.1, rtol=0)
    got, compiled, eager_ops = _ran(served, {"input": SENTENCES})  # several inputs: quantize_int8's eager model
    assert eager_ops and not compiled
    torch.testing.assert_close(got, encode(dynamic.model, dynamic.tokenizer, SENTENCES), atol=1e-5, rtol=0)
    # One token, a length the package does not take: quantize_int8's eager model too.
    token = served.tokenizer.cls_token_id
    got, compiled, eager_ops = _ran(served, {"input": [[token]]})
    assert eager_ops and not compiled
    torch.testing.assert_close(got, _ran(dynamic, {"input": [[token]]})[0], atol=1e-6, rtol=0)


def _scored(served, path, body):
    """The answer to a `/predict` or `/rerank` request, and whether the compiled classifier ran."""
    compiled, calls = served.loaded.compiled, []
    runner = compiled.runner if compiled is not None else None
    if compiled is not None:
        compiled.runner = lambda *tensors: calls.append(tensors) or runner(*tensors)
    try:
        answer = served.answer(path, body)
    finally:
        if compiled is not None:
            compiled.runner = runner
    return answer, bool(calls)


def _scored_rows(served, rows):
    """`Tasks.run` of classify items of token-id rows, and whether the compiled classifier ran."""
    from roformer_hf.serving.tasks import Item

    compiled, calls = served.loaded.compiled, []
    runner = compiled.runner
    compiled.runner = lambda *tensors: calls.append(tensors) or runner(*tensors)
    try:
        return served.run([Item("classify", (), row, len(row["input_ids"])) for row in rows]), bool(calls)
    finally:
        compiled.runner = runner


@pytest.fixture(scope="module")
def reranker(tokenizer, tmp_path_factory):
    """A cross-encoder's folder: a sequence classifier of one label, whose logit moves with its input."""
    torch.manual_seed(1)
    model = RoFormerForSequenceClassification(tiny_config(vocab_size=len(tokenizer), num_labels=1,
                                                          initializer_range=0.3))
    return save_folder(model.eval(), tokenizer, tmp_path_factory.mktemp("reranker") / "reranker")


@pytest.mark.slow
def test_compiled_classifier_scores_one_input_or_pair_as_the_eager_model(reranker, calibration, tmp_path,
                                                                         monkeypatch, every_length):
    from roformer_hf.serving.compiled import CompiledClassifier, OneClassifierInput
    from roformer_hf.serving.loaded import (
        CALIBRATION_TOKENS,
        calibration_batches,
        calibration_rows,
        static_int8_encoder,
    )

    eager = ServedModel(reranker)
    served = ServedModel(reranker, compile=True, compile_cache=tmp_path)  # the classifier, not the encoder
    assert isinstance(served.loaded.compiled, CompiledClassifier) and served.embed_alone is None
    package = served.loaded.compiled.path
    assert served.loaded.describe().endswith(f"{_compiled_inputs(served)}, saved to {package})")

    def logits(value):  # the eager model's, a sentence or a pair
        with torch.no_grad():
            return eager.model(**eager.tokenizer(*([value] if isinstance(value, str) else value),
                                                 return_tensors="pt")).logits[0, 0]

    # sentences of 3 to 12 tokens, and pairs, whose second text has token type 1
    inputs = SENTENCES + [[SENTENCES[0], SENTENCES[1]], [SENTENCES[3], SENTENCES[2]]]
    expected = torch.stack([logits(value) for value in inputs])
    assert expected.std() > 0.1  # the logit tells the inputs apart
    for value, want in zip(inputs, expected):
        answer, compiled = _scored(served, "/predict", {"inputs": value, "raw_scores": True})
        assert compiled
        torch.testing.assert_close(torch.tensor(answer[0]["score"]), want, atol=1e-5, rtol=0)
    answer, compiled = _scored(served, "/rerank", {"query": SENTENCES[0], "texts": [SENTENCES[1]],
                                                    "raw_scores": True})
    assert compiled
    torch.testing.assert_close(torch.tensor(answer[0]["score"]), expected[4], atol=1e-5, rtol=0)
    answer, compiled = _scored(served, "/rerank", {"query": SENTENCES[0], "texts": SENTENCES, "raw_scores": True})
    assert not compiled  # several pairs: the eager model, one padded batch
    assert answer == eager.answer("/rerank", {"query": SENTENCES[0], "texts": SENTENCES, "raw_scores": True})
    with pytest.raises(ValueError, match=r"token_type_ids of shape \(1, 3\): expected input_ids' \(1, 4\)"):
        served.loaded.compiled(torch.tensor([[2, 5, 6, 3]]), torch.zeros(1, 3, dtype=torch.long))
    # Ids or token types the model has no embedding for: the eager model's error, by name, not the package's bounds
    # check (inductor's message, a C++ stack)
    for row in ({"input_ids": [2, 5, served.config.vocab_size, 3], "token_type_ids": [0, 0, 0, 0]},
                {"input_ids": [2, 5, 6, 3], "token_type_ids": [0, 0, served.config.type_vocab_size, 0]}):
        (error,), compiled = _scored_rows(served, [row])
        assert not compiled and isinstance(error, RowError)
        assert re.search(r"(input_ids|token_type_ids) contains \d+; expected values in \[0, \d+\)", str(error)), error

    # The next start loads the package; nothing compiles.
    with monkeypatch.context() as patch:
        patch.setattr(torch._inductor, "aoti_compile_and_package", _no_compiler)
        again = ServedModel(reranker, compile=True, compile_cache=tmp_path)
    assert again.loaded.compiled.loaded and again.loaded.compiled.path == package
    body = {"inputs": inputs[-1], "raw_scores": True}
    assert _scored(again, "/predict", body) == _scored(served, "/predict", body)

    # int8: the classifier quantized statically on the calibration file's lines, alone and in pairs, near fp32 and not
    # equal to it.
    pytest.importorskip("torchao", reason="the compiled int8 classifier is quantized with torchao")
    quantized = ServedModel(reranker, int8=True, compile=True, calibration=calibration, compile_cache=tmp_path)
    assert quantized.loaded.compiled.path != package
    lines = [line for line in calibration.read_text().splitlines() if line]
    rows = calibration_rows(quantized.tokenizer, lines, quantized.loaded.max_length, pairs=True)
    assert len(rows) == len(lines) + len(lines) // 2
    assert sum(any(row["token_type_ids"]) for row in rows) == len(lines) // 2
    assert re.search(rf"\(int8 static, calibrated on {len(rows)} inputs\)", quantized.loaded.describe())
    reference = static_int8_encoder(OneClassifierInput(eager.model).eval(),
                                    calibration_batches(rows, CALIBRATION_TOKENS), quantized.loaded.max_length)
    got = []
    for value in inputs:
        answer, compiled = _scored(quantized, "/predict", {"inputs": value, "raw_scores": True})
        assert compiled
        got.append(answer[0]["score"])
        features = eager.tokenizer(*([value] if isinstance(value, str) else value), return_tensors="pt")
        with torch.no_grad():
            static = reference(input_ids=features["input_ids"], token_type_ids=features["token_type_ids"])[0][0, 0]
        # as the uncompiled graph, but for an activation on a rounding boundary (see the int8 encoder's test)
        torch.testing.assert_close(torch.tensor(got[-1]), static, atol=0.05, rtol=0)
    # int8's error on this small random model: up to 0.2 on logits of 1 to 3 (0.3 on pairs without pairs among the
    # calibration inputs; quantize_int8's eager model's as large)
    torch.testing.assert_close(torch.tensor(got), expected, atol=0.5, rtol=0)
    assert not torch.allclose(torch.tensor(got), expected, atol=1e-4, rtol=0)


def test_the_calibration_runs_with_the_default_prompt_and_a_failing_export_says_so(folders, tmp_path, monkeypatch):
    import shutil

    from roformer_hf.serving import loaded

    folder = Path(shutil.copytree(folders["mlm"], tmp_path / "prompted"))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "the queen : "},
                                                                          "default_prompt_name": "query"}))
    lines = ["the king dies", "a sword", "the crown at night"]
    (tmp_path / "inputs.txt").write_text("\n".join(lines))
    seen = []

    def failing(module, calibration, dynamic_shapes):
        seen.extend(row for inputs in calibration for row in inputs["input_ids"].tolist())
        raise KeyError("boom")

    monkeypatch.setattr(loaded, "static_int8", failing)
    with pytest.raises(RuntimeError, match=r"compile=True with int8=True: the encoder could not be exported and "
                                           r"quantized statically on the calibration inputs \(KeyError: 'boom'\); "
                                           r"expected a calibration file of inputs like those the server will embed"):
        ServedModel(folder, int8=True, compile=True, calibration=tmp_path / "inputs.txt",
                    compile_cache=tmp_path / "cache")
    tokenizer = ServedModel(folder).tokenizer
    assert sorted(seen) == sorted(tokenizer(["the queen : " + line for line in lines])["input_ids"])


@pytest.mark.parametrize("vnni", [False, True])
def test_int8_compile_without_vnni_says_it_runs_slower_than_eager_int8(folders, calibration, monkeypatch, caplog,
                                                                       capsys, vnni):
    from roformer_hf.serving import loaded

    monkeypatch.setattr(loaded, "_cpu_has_vnni", lambda: vnni)
    assert loaded.compile_caution(True, False) is None and loaded.compile_caution(False, True) is None
    caution = loaded.compile_caution(True, True)
    assert (caution is None) == vnni
    assert vnni or re.search(r"compile=True with int8=True on a CPU without VNNI: .* slower here than the eager int8 "
                             r"layers .* Expected int8 without compile on this CPU", caution)

    def refused(module, batches, max_length):  # the caution comes before the compile, which is not the point here
        raise RuntimeError("not compiled")

    monkeypatch.setattr(loaded, "static_int8_encoder", refused)
    with caplog.at_level(logging.WARNING, logger=loaded.__name__), pytest.raises(RuntimeError, match="not compiled"):
        ServedModel(folders["mlm"], int8=True, compile=True, calibration=calibration)
    assert [record.getMessage() for record in caplog.records if record.name == loaded.__name__] == \
        ([] if vnni else [caution])
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit):  # the command says it at its start
        main(["serve", str(folders["mlm"]), "--int8", "--compile", "--calibration", str(calibration),
              "--max-batch-tokens", "1"])
    assert "--max-batch-tokens=1" in capsys.readouterr().err  # it stopped there, after the caution, before Ray
    said = [record.getMessage() for record in caplog.records if "VNNI" in record.getMessage()]
    assert said == ([] if vnni else [f"--int8 --compile: {caution}"])


def test_build_app_hands_the_replicas_the_calibration_file_and_compile_cache_whole_paths(folders, monkeypatch,
                                                                                          tmp_path):
    from roformer_hf.serving import build_app

    monkeypatch.chdir(tmp_path)
    app = build_app({"folder": str(folders["sim"]), "int8": "true", "compile": "true", "calibration": "inputs.txt",
                     "compile_cache": "cache"})
    arguments = app._bound_deployment.init_kwargs
    assert arguments["calibration"] == str(tmp_path / "inputs.txt")
    assert arguments["compile_cache"] == str(tmp_path / "cache")
    assert build_app({"folder": str(folders["sim"]), "compile": "true"})._bound_deployment.init_kwargs[
        "compile_cache"] is None  # each replica's default


def embedder_of(served, encoder):
    """`served`'s embedding of a batch with `encoder` (called with the ids of one input) in place of its own."""
    from roformer_hf.serving.tasks import _one_input
    from roformer_hf.similarity import embedder

    return embedder(served.model, served.loaded.pooling, _one_input(encoder))


def test_compile_is_refused_where_it_cannot_apply(folders, calibration, tmp_path, capsys):
    from roformer_hf.serving.loaded import compile_refusal

    with pytest.raises(ValueError, match=r"compile=True with int8=True and no calibration: .* expected "
                                         r"calibration=FILE, a text file of inputs"):
        ServedModel(folders["sim"], compile=True, int8=True)
    for compile, int8 in ((False, True), (True, False), (False, False)):
        with pytest.raises(ValueError, match=rf"calibration='.*inputs.txt' with compile={compile} and int8={int8}: .* "
                                             "expected it with compile=True and int8=True only"):
            ServedModel(folders["sim"], compile=compile, int8=int8, calibration=calibration)
    empty, binary = tmp_path / "empty.txt", tmp_path / "binary.txt"
    empty.write_text("\n  \n")
    binary.write_bytes(b"\xff\xfe\x00")
    for path, why in ((empty, "holds no input"), (binary, "expected a readable UTF-8 text file"),
                      (tmp_path / "missing.txt", "expected a readable UTF-8 text file")):
        with pytest.raises(ValueError, match=why):
            ServedModel(folders["sim"], compile=True, int8=True, calibration=path)
    assert "expected device='cpu'" in compile_refusal(True, False, "cuda:1")
    assert compile_refusal(True, False, "cpu") is None and compile_refusal(False, True, "cuda") is None
    assert compile_refusal(True, True, "cpu", calibration) is None
    with pytest.MonkeyPatch.context() as patch:  # torch 2.5 has aoti_compile_and_package, with other arguments
        patch.setattr(torch, "__version__", "2.5.1+cpu")
        assert "expected torch 2.6 or later" in compile_refusal(True, False, "cpu")
    with pytest.raises(ValueError, match=r"compile_cache='.*cache' with compile=False: .* expected it with "
                                         r"compile=True only"):
        ServedModel(folders["sim"], compile_cache=tmp_path / "cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("importlib.util.find_spec", lambda name, *rest: None)
        assert "expected pip install roformer_hf[quantization]" in compile_refusal(True, True, "cpu", calibration)
    for flags, said in ((["--compile", "--int8"], "--compile: compile=True with int8=True and no calibration"),
                        (["--calibration", str(calibration)], "--calibration: calibration="),
                        (["--compile", "--int8", "--calibration", str(empty)], "--calibration: calibration="),
                        (["--compile", "--device", "cuda"], "--compile: compile=True with device='cuda'"),
                        (["--compile-cache", str(tmp_path)], "--compile-cache: compile_cache=")):
        with pytest.raises(SystemExit) as exited:
            main(["serve", str(folders["sim"]), *flags])
        assert exited.value.code == 2
        assert said in capsys.readouterr().err
    import ray

    assert not ray.is_initialized()


def test_a_compile_that_fails_says_so_and_saves_nothing(folders, monkeypatch, tmp_path):
    def half_a_compiler(program, package_path, **options):
        Path(package_path).write_bytes(b"half a package")  # what a compiler that dies midway leaves
        raise OSError("g++: not found")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", half_a_compiler)
    with pytest.raises(RuntimeError, match=r"compile=True: AOTInductor could not export or compile the encoder "
                                           r"\(OSError: g\+\+: not found\); inductor needs a C\+\+ compiler"):
        ServedModel(folders["sim"], compile=True, compile_cache=tmp_path)
    assert [path.suffix for path in tmp_path.rglob("*")] == [".lock"]  # nothing that a later start could load


def test_a_package_compiled_now_that_answers_wrongly_stops_the_start_and_is_not_saved(folders, monkeypatch,
                                                                                       tmp_path):
    from roformer_hf.serving import compiled

    def halved(build, example, max_length, path, kind):  # a compiler that computes something else
        module = build()
        return kind(lambda *inputs: tuple(0.5 * out for out in module(*inputs)), path, max_length, loaded=False)

    monkeypatch.setattr(compiled, "_compile", halved)
    with pytest.raises(RuntimeError, match=r"compile=True: the compiled classifier \(compiled now\) answers a probe "
                                           r"input unlike the eager model: its logits differ by up to .*; expected "
                                           r"each logit within 0.1% of the largest one's magnitude"):
        ServedModel(folders["clf"], compile=True, compile_cache=tmp_path)
    for name in ("mlm", "sim"):  # last hidden states; RoFormer-Sim's pooler output too
        with pytest.raises(RuntimeError, match=r"compile=True: the compiled encoder \(compiled now\) answers a probe "
                                               r"input unlike the eager model: its last hidden states differ by up "
                                               r"to .*; expected a cosine of at least 0.9999"):
            ServedModel(folders[name], compile=True, compile_cache=tmp_path)
    assert not list(tmp_path.glob("*.pt2"))


def test_probe_agreement_holds_rounding_and_refuses_another_answer():
    from roformer_hf.serving.loaded import probe_agrees

    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(1, 9, 32, generator=generator)
    assert probe_agrees(expected + 1e-6 * torch.randn(expected.shape, generator=generator), expected, fp32=True)
    assert not probe_agrees(expected * 1.01, expected, fp32=True)  # the same directions, another scale
    quantized = expected + 0.05 * torch.randn(expected.shape, generator=generator)
    assert probe_agrees(quantized, expected, fp32=False) and not probe_agrees(quantized, expected, fp32=True)
    assert not probe_agrees(expected * 1.5, expected, fp32=False)
    assert not probe_agrees(torch.randn(expected.shape, generator=generator), expected, fp32=False)


def test_logits_agreement_is_relative_to_the_largest_logit_or_to_one():
    from roformer_hf.serving.loaded import logits_agree

    logits = torch.tensor([[4.0, -2.0, 0.5]])
    assert logits_agree(logits + 0.003, logits, fp32=True) and not logits_agree(logits + 0.005, logits, fp32=True)
    assert logits_agree(logits + 0.9, logits, fp32=False) and not logits_agree(logits + 1.1, logits, fp32=False)
    near_zero = torch.tensor([[0.002]])  # one label's logit near zero: judged on the scale of 1, not on its own
    assert logits_agree(near_zero + 5e-4, near_zero, fp32=True) and not logits_agree(near_zero + 0.3, near_zero, False)


def test_the_default_compile_cache_follows_the_environment(monkeypatch, tmp_path):
    from roformer_hf.serving.compiled import default_compile_cache

    monkeypatch.setenv("ROFORMER_HF_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compile_cache() == tmp_path / "mine" / "compiled"
    monkeypatch.delenv("ROFORMER_HF_CACHE")
    assert default_compile_cache() == tmp_path / "xdg" / "roformer_hf" / "compiled"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_compile_cache() == tmp_path / "home" / ".cache" / "roformer_hf" / "compiled"


# Over HTTP, on a real Ray Serve.


@pytest.fixture(scope="module")
def server(folders, calibration, reranker):
    """Ray Serve on 127.0.0.1, one application per folder under its own route prefix; its base URL."""
    import ray
    from ray import serve

    from roformer_hf.serving import build_app

    port = free_port()
    with ray_environment():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name in ("mlm", "clf", "sim"):
            serve.run(build_app({"folder": str(folders[name]), "threads": "1", "num_cpus": "0.25",
                                 "max_batch_tokens": "64", "batch_wait_ms": "20", "max_inputs": "8"}),
                      name=name, route_prefix=f"/{name}", blocking=False)
        # One input at a time through the compiled encoder: the replica compiles before it serves (one replica,
        # reserving none of Ray's 2 CPUs, which the others hold).
        serve.run(build_app({"folder": str(folders["sim"]), "replicas": "1", "threads": "1", "num_cpus": "0",
                             "compile": "true"}),
                  name="compiled", route_prefix="/compiled", blocking=False)
        serve.run(build_app({"folder": str(reranker), "replicas": "1", "threads": "1", "num_cpus": "0",
                             "compile": "true"}),  # a cross-encoder: the classifier compiled
                  name="reranker", route_prefix="/reranker", blocking=False)
        if importlib.util.find_spec("torchao") is not None:  # its static quantization
            serve.run(build_app({"folder": str(folders["sim"]), "replicas": "1", "threads": "1", "num_cpus": "0",
                                 "int8": "true", "compile": "true", "calibration": str(calibration)}),
                      name="static", route_prefix="/static", blocking=False)
        # One request at a time and one waiting: the third is refused. Behind an API key, bodies of 4 kB at most.
        serve.run(build_app({"folder": str(folders["sim"]), "threads": "1", "num_cpus": "0.25",
                             "max_ongoing_requests": "1", "max_queued_requests": "1", "api_key": KEY,
                             "payload_limit": "4096"}),
                  name="busy", route_prefix="/busy", blocking=False)
        for name in serve.status().applications:
            serve.get_app_handle(name)  # waits until the application is running
        yield f"http://127.0.0.1:{port}"
    finally:
        shut_down_serve_and_ray()


def _post(url, body, headers=None):
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(url, data=data, headers={"content-type": "application/json", **(headers or {})},
                         timeout=TIMEOUT)


@pytest.mark.slow
def test_http_routes_answer_what_the_library_gives(server, served):
    assert requests.get(f"{server}/sim/health", timeout=TIMEOUT).status_code == 200
    sim = served["sim"]
    # Concurrent requests batch together (a budget of 64 tokens) and each gets its own rows back.
    with ThreadPoolExecutor(8) as pool:
        embeddings = list(pool.map(lambda s: _post(f"{server}/sim/v1/embeddings", {"input": [s]}), SENTENCES))
        prompts = [("the king", seed) for seed in (1, 2, 3)] + [("a crown and a sword", 4), ("day", None)]
        completions = list(pool.map(lambda p: _post(f"{server}/sim/v1/completions", {
            "prompt": p[0], "max_tokens": 6, **({"seed": p[1], "top_p": 0.9} if p[1] else {"temperature": 0})}),
            prompts))
    expected = encode(sim.model, sim.tokenizer, SENTENCES)
    got = torch.tensor([response.json()["data"][0]["embedding"] for response in embeddings])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # One request of more tokens than a batch takes runs in chunks, its rows in order.
    many = SENTENCES[1:2] * 6 + SENTENCES[:2]
    assert sum(len(ids) for ids in sim.tokenizer(many)["input_ids"]) > 64
    answer = _post(f"{server}/sim/v1/embeddings", {"input": many}).json()
    assert [row["index"] for row in answer["data"]] == list(range(len(many)))
    torch.testing.assert_close(torch.tensor([row["embedding"] for row in answer["data"]]), expected[[1] * 6 + [0, 1]],
                               atol=1e-5, rtol=0)
    for (prompt, seed), response in zip(prompts, completions):
        ids = sim.tokenizer(prompt)["input_ids"]
        tokens = sim.complete([Completion(ids, seed or 0)], 6, 1.0 if seed else 0.0, 0.9 if seed else 1.0)[0]
        assert response.status_code == 200, response.text[:500]
        assert response.json()["choices"][0]["text"] == sim.tokenizer.decode(tokens, skip_special_tokens=True)
    assert completions[-1].json()["choices"][0]["text"] == sim.tokenizer.decode(
        _greedy(sim.model, sim.tokenizer, "day", 6), skip_special_tokens=True)

    similar = _post(f"{server}/sim/similar", {"sentences": ["the king dies"], "n": 3, "seed": 5, "max_new_tokens": 5})
    reference = generate_similar(sim.model, sim.tokenizer, ["the king dies"], 3, seed=5, max_new_tokens=5)[0]
    assert [s["text"] for s in similar.json()["data"][0]["similar"]] == [s.text for s in reference]

    predicted = _post(f"{server}/clf/predict", {"inputs": SENTENCES}).json()
    for got, expected in zip(predicted, served["clf"].answer("/predict", {"inputs": SENTENCES})):
        assert [e["label"] for e in got] == [e["label"] for e in expected]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(got, expected)) < 1e-5
    filled = _post(f"{server}/mlm/fill-mask", {"inputs": "the king [MASK] a crown", "top_k": 2}).json()
    assert [e["token"] for e in filled] == \
        [e["token"] for e in served["mlm"].answer("/fill-mask", {"inputs": "the king [MASK] a crown", "top_k": 2})]


@pytest.mark.slow
def test_http_compiled_replica_answers_what_encode_gives(server, served):
    sim = served["sim"]
    expected = encode(sim.model, sim.tokenizer, SENTENCES)
    for i, sentence in enumerate(SENTENCES):  # each alone: the compiled graph
        response = _post(f"{server}/compiled/v1/embeddings", {"input": sentence})
        assert response.status_code == 200, response.text[:500]
        torch.testing.assert_close(torch.tensor(response.json()["data"][0]["embedding"]), expected[i], atol=1e-5,
                                   rtol=0)
    together = _post(f"{server}/compiled/v1/embeddings", {"input": SENTENCES}).json()  # a batch: the eager model
    torch.testing.assert_close(torch.tensor([row["embedding"] for row in together["data"]]), expected, atol=1e-5,
                               rtol=0)


@pytest.mark.slow
def test_http_compiled_reranker_answers_what_the_library_gives(server, reranker):
    eager = ServedModel(reranker)
    for body in ({"query": SENTENCES[0], "texts": [SENTENCES[1]], "raw_scores": True},  # one pair: the package
                 {"query": SENTENCES[0], "texts": SENTENCES, "raw_scores": True, "return_text": True}):  # eager
        got = _post(f"{server}/reranker/rerank", body)
        assert got.status_code == 200, got.text
        expected = eager.answer("/rerank", body)
        assert [row["index"] for row in got.json()] == [row["index"] for row in expected]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(got.json(), expected)) < 1e-5
    got = _post(f"{server}/reranker/predict", {"inputs": [SENTENCES[2], SENTENCES[3]], "raw_scores": True})  # a pair
    assert got.status_code == 200, got.text
    assert abs(got.json()[0]["score"] - eager.answer("/predict", {"inputs": [SENTENCES[2], SENTENCES[3]],
                                                                  "raw_scores": True})[0]["score"]) < 1e-5


def test_http_static_int8_replica_answers_what_the_library_gives(server, folders, static_sim):
    """`calibration` reaches the replica: one input at a time it answers as the same folder quantized statically in
    this process, several at a time as `quantize_int8`'s model."""
    for sentence in SENTENCES:
        response = _post(f"{server}/static/v1/embeddings", {"input": sentence})
        assert response.status_code == 200, response.text[:500]
        got = torch.tensor(response.json()["data"][0]["embedding"])
        expected = torch.tensor(static_sim.answer("/v1/embeddings", {"input": sentence})["data"][0]["embedding"])
        # the same graph on another thread count: equal but where an activation on a rounding boundary moves one step
        assert torch.cosine_similarity(got, expected, dim=0) > 0.999
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0)
    dynamic = ServedModel(folders["sim"], int8=True)
    together = _post(f"{server}/static/v1/embeddings", {"input": SENTENCES}).json()
    torch.testing.assert_close(torch.tensor([row["embedding"] for row in together["data"]]),
                               encode(dynamic.model, dynamic.tokenizer, SENTENCES), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_http_openai_client_shape(server, served):
    """What the `openai` client reads: base64 little-endian float32, decoded as it decodes them."""
    response = _post(f"{server}/mlm/v1/embeddings", {"input": ["the king", "day"], "encoding_format": "base64",
                                                     "model": "mlm"}).json()
    vectors = [torch.frombuffer(bytearray(base64.b64decode(row["embedding"])), dtype=torch.float32)
               for row in response["data"]]
    mlm = served["mlm"]
    torch.testing.assert_close(torch.stack(vectors), encode(mlm.model, mlm.tokenizer, ["the king", "day"]),
                               atol=1e-5, rtol=0)
    tokens = sum(len(ids) for ids in mlm.tokenizer(["the king", "day"])["input_ids"])
    assert response["model"] == "mlm" and response["usage"]["prompt_tokens"] == tokens


@pytest.mark.slow
@pytest.mark.parametrize("route, body, status, param", [
    ("/sim/v1/embeddings", "{not json", 400, None),
    ("/clf/fill-mask", {"inputs": "the [MASK]"}, 404, "path"),
    ("/mlm/v1/completions", {"prompt": "day"}, 404, "path"),
    ("/mlm/fill-mask", {"inputs": "the king"}, 422, "inputs"),
    *((f"/sim{route}", body, status, param) for route, body, status, param in BAD_REQUESTS),
])
def test_http_bad_requests_get_a_json_4xx_and_the_server_keeps_serving(server, route, body, status, param):
    response = _post(f"{server}{route}", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and "expected" in error["message"]
    if status == 404:
        assert "/v1/embeddings" in response.json()["routes"]
    assert _post(f"{server}/sim/embed", {"inputs": "day"}).status_code == 200


@pytest.mark.slow
def test_http_overload_answers_503_with_retry_after(server):
    body = {"prompt": "the king", "max_tokens": 24, "temperature": 0}
    key = {"authorization": f"Bearer {KEY}"}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: _post(f"{server}/busy/v1/completions", body, headers=key), range(8)))
    statuses = sorted(response.status_code for response in responses)
    assert statuses[0] == 200 and statuses[-1] == 503, statuses
    assert set(statuses) == {200, 503}
    for refused in (r for r in responses if r.status_code == 503):  # in OpenAI's shape, from the replica
        assert refused.headers.get("retry-after") == "1", refused.text
        assert refused.headers["content-type"] == "application/json", refused.text
        assert refused.json()["error"]["code"] == "overloaded", refused.text
    assert _post(f"{server}/busy/v1/completions", body, headers=key).status_code == 200  # and it serves again


@pytest.mark.slow
def test_http_api_key_and_payload_limit(server):
    missing = _post(f"{server}/busy/v1/embeddings", {"input": "day"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{server}/busy/v1/models", timeout=TIMEOUT).status_code == 401
    assert requests.get(f"{server}/busy/health", timeout=TIMEOUT).status_code == 200  # a probe needs no key
    key = {"authorization": f"Bearer {KEY}"}
    assert _post(f"{server}/busy/v1/embeddings", {"input": "day"}, headers=key).status_code == 200
    big = _post(f"{server}/busy/v1/embeddings", {"input": ["day"] * 1000}, headers=key)
    assert big.status_code == 413 and "payload-limit" in big.json()["error"]["message"]


@pytest.mark.slow
def test_http_the_openai_client(server, served):
    """The `openai` client as users point it at the server: models, token-id inputs (its default encoding, base64),
    a refused `dimensions`, a wrong model, and a completion streamed as server-sent events."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/sim/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    assert [model.id for model in client.models.list().data] == ["sim"]
    sim = served["sim"]
    ids = sim.tokenizer(SENTENCES[:3])["input_ids"]
    got = client.embeddings.create(model="sim", input=ids)
    torch.testing.assert_close(torch.tensor([row.embedding for row in got.data]),
                               encode(sim.model, sim.tokenizer, SENTENCES[:3]), atol=1e-5, rtol=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="sim", input="day", dimensions=16)
    assert refused.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="day")
    whole = client.completions.create(model="sim", prompt="the king", max_tokens=6, temperature=0)
    stream = client.completions.create(model="sim", prompt="the king", max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.slow
def test_http_the_huggingface_hub_client(server, served):
    """huggingface_hub's `InferenceClient` as text-embeddings-inference's guide points it at a server: at a route, or
    at the server's root, which answers as the folder's own route; the health routes open without the API key."""
    from huggingface_hub import InferenceClient

    client = InferenceClient(timeout=TIMEOUT)
    sim, clf = served["sim"], served["clf"]
    unit = encode(sim.model, sim.tokenizer, SENTENCES, normalize=True)
    for url in (f"{server}/sim", f"{server}/sim/embed", f"{server}/sim/invocations"):
        torch.testing.assert_close(torch.from_numpy(client.feature_extraction(SENTENCES[1], model=url)), unit[1:2],
                                   atol=1e-5, rtol=0)
    similar = client.sentence_similarity(SENTENCES[0], SENTENCES[1:], model=f"{server}/sim/similarity")
    torch.testing.assert_close(torch.tensor(similar), unit[1:] @ unit[0], atol=1e-5, rtol=0)
    expected = clf.answer("/predict", {"inputs": "the king"})
    for url in (f"{server}/clf", f"{server}/clf/predict"):  # the client keeps the first of TEI's answer: the best
        best = client.text_classification("the king", model=url, top_k=2, function_to_apply="softmax")
        assert (best.label, best.score) == (expected[0]["label"], pytest.approx(expected[0]["score"], abs=1e-6))
    openai = pytest.importorskip("openai")  # a client given the root as its base URL posts to /embeddings
    answer = openai.OpenAI(base_url=f"{server}/sim", api_key="none", max_retries=0).embeddings.create(
        model="sim", input=SENTENCES[1], encoding_format="float")
    torch.testing.assert_close(torch.tensor(answer.data[0].embedding), encode(sim.model, sim.tokenizer, SENTENCES[1:2])[0],
                               atol=1e-5, rtol=0)
    for path in ("/", "/ping", "/health"):
        assert requests.get(f"{server}/busy{path}", timeout=TIMEOUT).status_code == 200  # no key asked
    assert _post(f"{server}/busy/", {"inputs": "day"}).status_code == 401
    assert _post(f"{server}/busy/", {"inputs": "day"}, {"authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.slow
def test_http_langchain_openai_embeddings(server, served):
    """LangChain's `OpenAIEmbeddings` as docs/serving.md sets it up (texts, not its cl100k token ids): documents in
    several requests of `chunk_size`, and a query; the server's default `--max-inputs` takes its default chunk."""
    from langchain_openai import OpenAIEmbeddings

    from roformer_hf.serving.served import MAX_INPUTS

    assert OpenAIEmbeddings.model_fields["chunk_size"].default <= MAX_INPUTS
    sim = served["sim"]
    documents = [f"{a} {b}" for a in SENTENCES for b in SENTENCES]  # 16, in requests of 8 (the app's --max-inputs)
    client = OpenAIEmbeddings(model="sim", base_url=f"{server}/sim/v1", api_key="unused", chunk_size=8,
                              check_embedding_ctx_length=False, max_retries=0)
    expected = encode(sim.model, sim.tokenizer, documents)
    torch.testing.assert_close(torch.tensor(client.embed_documents(documents)), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(client.embed_query(documents[5])), expected[5], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_http_documents_rerank(server, reranker):
    cross = ServedModel(reranker, name="reranker")
    body = {"model": "reranker", "query": "the king", "documents": SENTENCES, "top_n": 2}
    response = _post(f"{server}/reranker/v1/rerank", body)
    assert response.status_code == 200, response.text[:500]
    got, expected = response.json(), cross.answer("/v1/rerank", body)
    assert [r["index"] for r in got["results"]] == [r["index"] for r in expected["results"]]
    assert [r["relevance_score"] for r in got["results"]] == pytest.approx(
        [r["relevance_score"] for r in expected["results"]], abs=1e-5)
    assert _post(f"{server}/sim/v1/rerank", body).status_code == 404  # not a cross-encoder


@pytest.mark.slow
def test_http_text_embeddings_inference_routes(server, served):
    clf = served["clf"]
    info = requests.get(f"{server}/clf/info", timeout=TIMEOUT).json()
    assert info["model_type"]["classifier"]["id2label"] == {"0": "comedy", "1": "history", "2": "tragedy"}
    response = _post(f"{server}/clf/embed", {"inputs": SENTENCES[:2], "truncation_direction": "Left"})
    assert {"x-compute-time", "x-tokenization-time", "x-queue-time", "x-inference-time"} <= set(response.headers)
    assert int(response.headers["x-batch-size"]) >= 2  # the request's two inputs ran in one batch
    torch.testing.assert_close(torch.tensor(response.json()), encode(clf.model, clf.tokenizer, SENTENCES[:2],
                                                                     normalize=True), atol=1e-5, rtol=0)
    states = _post(f"{server}/clf/embed_all", {"inputs": SENTENCES[:2]}).json()
    for got, expected in zip(states, clf.answer("/embed_all", {"inputs": SENTENCES[:2]})):
        torch.testing.assert_close(torch.tensor(got), torch.from_numpy(expected), atol=1e-5, rtol=0)
    tokens = _post(f"{server}/clf/tokenize", {"inputs": "the king"}).json()
    assert [token["id"] for token in tokens[0]] == clf.tokenizer("the king")["input_ids"]
    assert _post(f"{server}/clf/decode", {"ids": tokens[0][0]["id"]}).status_code == 422  # not a list of ids
    pair = _post(f"{server}/clf/predict", {"inputs": ["the king", "a crown"]}).json()
    alone = clf.answer("/predict", {"inputs": ["the king", "a crown"]})  # one pair: one list of labels
    assert [entry["label"] for entry in pair] == [entry["label"] for entry in alone]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(pair, alone)) < 1e-5


def test_non_finite_outputs_are_an_error_not_null(folders):
    served = ServedModel(folders["sim"])
    with torch.no_grad():
        next(served.model.parameters()).fill_(float("nan"))
    with pytest.raises(RowError, match="NaN or infinite"):
        served.answer("/v1/embeddings", {"input": "the king"})


def test_a_request_is_cut_into_chunks_within_the_budget():
    from roformer_hf.serving import Item
    from roformer_hf.serving.app import chunks

    items = [Item("embed", (), [0] * n, n) for n in (30, 30, 10, 64, 5, 100)]
    assert [[item.tokens for item in chunk.items] for chunk in chunks(items, 64)] == [[30, 30], [10], [64], [5], [100]]
    assert [chunk.tokens for chunk in chunks(items, 64)] == [60, 10, 64, 5, 64]  # a batch counts at most the budget
    assert [[item.tokens for item in chunk.items] for chunk in chunks(items, 4096)] == [[30, 30, 10, 64, 5, 100]]


def test_docstring_example_runs():
    import doctest
    import re

    import roformer_hf.serving

    blocks = re.findall(r"```python\n(.*?)```", ServedModel.__doc__, flags=re.DOTALL)
    test = doctest.DocTestParser().get_doctest("".join(blocks), vars(roformer_hf.serving).copy(), "ServedModel",
                                               None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
