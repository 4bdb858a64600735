"""The protocols of `roformer-hf serve` as their clients use them, on `ServedModel` (no Ray): OpenAI's token-id
inputs, `dimensions`, models, completions with `n`, `echo` and a stream; text-embeddings-inference's `/rerank`,
`/predict` on pairs, `/tokenize`, `/decode`, `/info`, prompts and truncation; fields refused naming them; a broken
input failing alone; the guards and the health check of a replica. Each answer is checked against the model run
alone (transformers' tokenizer and the model's forward, `encode`), not against the server's own numbers."""

import asyncio
import json
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import save_folder, serving_tokenizer, tiny_config

pytest.importorskip("ray.serve", reason="serving needs Ray Serve: pip install roformer_hf[serve]")

from roformer_hf import RoFormerForCausalLM, RoFormerForSequenceClassification, RoFormerModel  # noqa: E402
from roformer_hf.serving import Item, RequestError, RowError, ServedModel  # noqa: E402
from roformer_hf.similarity import encode  # noqa: E402

SENTENCES = ["the king dies", "a queen loves the crown and the sword at night", "day", "the sword speaks"]
PROMPTS = {"query": "a queen ", "passage": "the night "}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An encoder trained (as its config says) for Matryoshka sizes, with sentence-transformers prompts; a
    cross-encoder (one label); a causal LM."""
    tokenizer = serving_tokenizer()
    root = tmp_path_factory.mktemp("api")
    torch.manual_seed(0)
    vocab = len(tokenizer)
    encoder = save_folder(RoFormerModel(tiny_config(vocab_size=vocab, sentence_dimensions=[32, 16, 8])).eval(),
                          tokenizer, root / "encoder")
    sentence_config = encoder / "config_sentence_transformers.json"
    sentence_config.write_text(json.dumps({**json.loads(sentence_config.read_text()), "prompts": PROMPTS}))
    reranker = save_folder(RoFormerForSequenceClassification(tiny_config(vocab_size=vocab, num_labels=1,
                                                                         initializer_range=0.5)).eval(),
                           tokenizer, root / "reranker")
    lm = save_folder(RoFormerForCausalLM(tiny_config(vocab_size=vocab, is_decoder=True, initializer_range=0.3)).eval(),
                     tokenizer, root / "lm")
    return {"encoder": encoder, "reranker": reranker, "lm": lm}


@pytest.fixture(scope="module")
def served(folders):
    return {name: ServedModel(folder, max_inputs=8) for name, folder in folders.items()}


def _refused(server, path, body=None, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as refused:
        server.answer(path, body, **kwargs)
    assert "expected" in refused.value.message
    return refused.value


# OpenAI's API.


def test_token_ids_are_run_as_given(served):
    server = served["encoder"]
    ids = server.tokenizer(SENTENCES)["input_ids"]  # with [CLS] and [SEP], as the texts are run
    expected = encode(server.model, server.tokenizer, SENTENCES)
    for body in ({"input": ids}, {"input": ids[0]}):
        got = torch.tensor([row["embedding"] for row in server.answer("/v1/embeddings", body)["data"]])
        torch.testing.assert_close(got, expected[:len(got)], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(server.answer("/embed", {"inputs": ids, "normalize": False})), expected,
                               atol=1e-5, rtol=0)
    assert server.answer("/v1/embeddings", {"input": ids})["usage"]["prompt_tokens"] == sum(map(len, ids))
    refusal = _refused(server, "/v1/embeddings", {"input": [[2, 5, 100000]]})
    assert (refusal.status, refusal.param) == (400, "input") and "token id 100000" in refusal.message
    assert _refused(server, "/v1/embeddings", {"input": [[2] * 40]}).status == 413  # longer than the model takes
    cut = server.answer("/v1/embeddings", {"input": [[2] + ids[1][1:-1] * 4 + [3]], "truncate": True})
    assert len(cut["data"]) == 1


@pytest.mark.parametrize("budget", [1, 8, 12, 10_000])
def test_embedding_forwards_of_a_token_budget_give_each_sentence_alone(served, monkeypatch, budget):
    """A request's sentences run sorted by length, `tasks.EMBED_TOKENS` real tokens a forward (a sentence longer than
    the budget alone): each embedding is the sentence's own, whatever the cut."""
    from roformer_hf.serving import tasks

    monkeypatch.setattr(tasks, "EMBED_TOKENS", budget)
    server = served["encoder"]
    sentences = SENTENCES * 2
    alone = torch.cat([encode(server.model, server.tokenizer, [sentence]) for sentence in sentences])
    got = torch.tensor(server.answer("/embed", {"inputs": sentences, "normalize": False}))
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
    lengths = [len(row) for row in server.tokenizer(sentences)["input_ids"]]
    runs = tasks.by_tokens(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, budget)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    assert all(len(run) == 1 or sum(lengths[i] for i in run) <= budget for run in runs)
    expected_runs = {1: (len(lengths), len(lengths)), 10_000: (1, 1)}.get(budget, (2, len(lengths) - 1))
    assert expected_runs[0] <= len(runs) <= expected_runs[1]


def test_dimensions_only_where_the_folder_was_trained_for_them(served):
    server = served["encoder"]
    full = encode(server.model, server.tokenizer, SENTENCES)
    for size in (16, 8):
        got = torch.tensor([row["embedding"] for row in server.answer(
            "/v1/embeddings", {"input": SENTENCES, "dimensions": size})["data"]])
        torch.testing.assert_close(got, full[:, :size], atol=1e-5, rtol=0)  # this folder does not normalize
        tei = torch.tensor(server.answer("/embed", {"inputs": SENTENCES, "dimensions": size}))
        torch.testing.assert_close(tei, F.normalize(full[:, :size], dim=-1), atol=1e-5, rtol=0)
    refusal = _refused(server, "/v1/embeddings", {"input": "day", "dimensions": 12})
    assert (refusal.status, refusal.param) == (400, "dimensions") and "[32, 16, 8]" in refusal.message
    refusal = _refused(served["lm"], "/v1/embeddings", {"input": "day", "dimensions": 16})
    assert (refusal.status, refusal.param) == (400, "dimensions") and "sentence_dimensions" in refusal.message


def test_models_and_the_served_name(folders):
    server = ServedModel(folders["encoder"], name="roformer-base")
    listed = server.answer("/v1/models")
    assert [model["id"] for model in listed["data"]] == ["roformer-base"] and listed["object"] == "list"
    assert server.answer("/v1/models/roformer-base")["id"] == "roformer-base"
    refusal = _refused(server, "/v1/models/gpt-4")
    assert (refusal.status, refusal.param, refusal.code) == (404, "model", "model_not_found")
    refusal = _refused(server, "/v1/embeddings", {"input": "day", "model": "encoder"})
    assert (refusal.status, refusal.param) == (404, "model")
    assert server.answer("/v1/embeddings", {"input": "day", "model": "roformer-base"})["model"] == "roformer-base"
    assert ServedModel(folders["encoder"]).answer("/v1/models")["data"][0]["id"] == "encoder"  # the folder's name


@pytest.mark.parametrize("field, value, status", [
    ("logprobs", 1, 400), ("best_of", 3, 400), ("presence_penalty", 0.5, 400), ("frequency_penalty", -1, 400),
    ("logit_bias", {"17": 5}, 400), ("suffix", "end", 400), ("stream_options", {"include_usage": True}, 400),
    ("n", 0, 422), ("max_tokens", 30, 400), ("functions", [], 422), ("top_k", 5, 422),
])
def test_completion_fields_it_does_not_do_are_refused(served, field, value, status):
    refusal = _refused(served["lm"], "/v1/completions", {"prompt": "the king", field: value})
    assert (refusal.status, refusal.param) == (status, field)


def test_completions_n_echo_and_the_context_left(served):
    server = served["lm"]
    body = {"prompt": ["the king", "day"], "max_tokens": 5, "temperature": 0, "n": 2}
    answer = server.answer("/v1/completions", body)
    texts = [choice["text"] for choice in answer["choices"]]
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the same completion twice per prompt
    assert answer["usage"]["prompt_tokens"] == sum(map(len, server.tokenizer(["the king", "day"])["input_ids"]))
    echoed = server.answer("/v1/completions", {**body, "echo": True})
    assert [choice["text"] for choice in echoed["choices"]] == [p + t for p, t in zip(
        ["the king", "the king", "day", "day"], texts)]
    sampled = server.answer("/v1/completions", {"prompt": "the king", "max_tokens": 8, "n": 3, "seed": 4})
    alone = [server.answer("/v1/completions", {"prompt": "the king", "max_tokens": 8, "seed": 4 + j})["choices"][0]
             ["text"] for j in range(3)]
    assert [choice["text"] for choice in sampled["choices"]] == alone  # choice j samples from stream seed + j
    prompt = len(server.tokenizer("the king")["input_ids"])
    left = server.loaded.max_length - prompt
    assert server.answer("/v1/completions", {"prompt": "the king", "max_tokens": left, "temperature": 0})
    refusal = _refused(server, "/v1/completions", {"prompt": "the king", "max_tokens": left + 1})
    assert (refusal.status, refusal.param) == (400, "max_tokens") and f"at most {left}" in refusal.message


def test_a_stream_is_the_completion_in_pieces(served):
    server = served["lm"]
    body = {"prompt": ["the king", "a crown"], "max_tokens": 8, "temperature": 0, "n": 2}
    whole = server.answer("/v1/completions", body)
    chunks = server.answer("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert all(chunk["object"] == "text_completion" and chunk["id"] == chunks[0]["id"] for chunk in chunks)
    pieces, finish = {}, {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            pieces[choice["index"]] = pieces.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
    assert [pieces[i] for i in range(4)] == [choice["text"] for choice in whole["choices"]]
    assert [finish[i] for i in range(4)] == [choice["finish_reason"] for choice in whole["choices"]]
    assert len(chunks) > 5  # in pieces, not one
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_a_stream_stops_at_a_stop_string(served):
    server = served["lm"]
    whole = server.answer("/v1/completions", {"prompt": "the king", "max_tokens": 12, "temperature": 0})["choices"][0]
    words = whole["text"].split()
    stop = " ".join(words[2:4])  # two words into the completion
    body = {"prompt": "the king", "max_tokens": 12, "temperature": 0, "stop": stop}
    cut = server.answer("/v1/completions", body)["choices"][0]
    chunks = server.answer("/v1/completions", {**body, "stream": True})
    streamed = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
    assert cut["finish_reason"] == "stop" and stop not in cut["text"] and whole["text"].startswith(cut["text"])
    assert streamed == cut["text"] and chunks[-1]["choices"][0]["finish_reason"] == "stop"


# text-embeddings-inference's API.


def test_rerank_is_the_cross_encoder_run_alone(served):
    server = served["reranker"]
    query, texts = "the king", SENTENCES
    with torch.no_grad():
        pairs = server.tokenizer([query] * len(texts), texts, padding=True, return_tensors="pt")
        logits = server.model(**pairs).logits[:, 0]
    ranked = server.answer("/rerank", {"query": query, "texts": texts, "return_text": True})
    assert [entry["index"] for entry in ranked] == logits.argsort(descending=True).tolist()
    assert [entry["text"] for entry in ranked] == [texts[entry["index"]] for entry in ranked]
    torch.testing.assert_close(torch.tensor([entry["score"] for entry in ranked]),
                               logits.sigmoid().sort(descending=True).values, atol=1e-5, rtol=0)
    raw = server.answer("/rerank", {"query": query, "texts": texts, "raw_scores": True})
    torch.testing.assert_close(torch.tensor([entry["score"] for entry in raw]), logits.sort(descending=True).values,
                               atol=1e-5, rtol=0)
    assert "text" not in raw[0]
    assert "/rerank" not in served["encoder"].routes and _refused(served["encoder"], "/rerank", {
        "query": "a", "texts": ["b"]}).status == 404


def test_predict_reads_pairs_as_text_embeddings_inference_does(served):
    server = served["reranker"]
    with torch.no_grad():
        pair = server.model(**server.tokenizer("the king", "a crown", return_tensors="pt")).logits[0, 0]
        single = server.model(**server.tokenizer("day", return_tensors="pt")).logits[0, 0]
    got = server.answer("/predict", {"inputs": ["the king", "a crown"], "raw_scores": True})  # two strings: a pair
    assert len(got) == 1 and abs(got[0]["score"] - pair.item()) < 1e-5
    batch = server.answer("/predict", {"inputs": [["the king", "a crown"], "day", "night"]})
    assert len(batch) == 3 and abs(batch[0][0]["score"] - pair.sigmoid().item()) < 1e-5
    assert abs(batch[1][0]["score"] - single.sigmoid().item()) < 1e-5
    assert _refused(server, "/predict", {"inputs": [["a", "b", "c"], "day", "night"]}).param == "inputs"


def test_tokenize_and_decode_are_the_tokenizer(served):
    server = served["encoder"]
    tokens = server.answer("/tokenize", {"inputs": SENTENCES[:2]})
    assert [[token["id"] for token in row] for row in tokens] == server.tokenizer(SENTENCES[:2])["input_ids"]
    for text, row in zip(SENTENCES, tokens):
        assert row[0]["special"] and row[0]["start"] is None and row[-1]["text"] == "[SEP]"
        assert " ".join(token["text"] for token in row[1:-1]) == " ".join(text[t["start"]:t["stop"]] for t in row[1:-1])
    plain = server.answer("/tokenize", {"inputs": "day", "add_special_tokens": False})
    assert [token["id"] for token in plain[0]] == server.tokenizer("day", add_special_tokens=False)["input_ids"]
    ids = server.tokenizer(SENTENCES)["input_ids"]
    assert server.answer("/decode", {"ids": ids}) == server.tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert server.answer("/decode", {"ids": ids[0], "skip_special_tokens": False}) == [server.tokenizer.decode(ids[0])]
    assert _refused(server, "/decode", {"ids": [1, -3]}).param == "ids"


def test_prompts_and_truncation_direction(served):
    server = served["encoder"]
    expected = encode(server.model, server.tokenizer, [PROMPTS["query"] + s for s in SENTENCES], normalize=True)
    got = torch.tensor(server.answer("/embed", {"inputs": SENTENCES, "prompt_name": "query"}))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    tokenized = server.answer("/tokenize", {"inputs": "day", "prompt_name": "passage"})
    assert [t["id"] for t in tokenized[0]] == server.tokenizer(PROMPTS["passage"] + "day")["input_ids"]
    refusal = _refused(server, "/embed", {"inputs": "day", "prompt_name": "title"})
    assert (refusal.status, refusal.param) == (400, "prompt_name") and "['passage', 'query']" in refusal.message
    long = " ".join(SENTENCES * 3)
    limit = server.loaded.max_length
    for direction in ("Left", "Right"):
        server.tokenizer.truncation_side = "left" if direction == "Left" else "right"
        ids = server.tokenizer(long, truncation=True, max_length=limit)["input_ids"]
        server.tokenizer.truncation_side = "right"
        reference = encode(server.model, server.tokenizer, [server.tokenizer.decode(ids[1:-1])], normalize=True)
        got = torch.tensor(server.answer("/embed", {"inputs": long, "truncate": True,
                                                    "truncation_direction": direction}))
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


def test_info_describes_the_model(served):
    info = served["reranker"].answer("/info")
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    assert info["max_input_length"] == served["reranker"].loaded.max_length and info["max_client_batch_size"] == 8
    assert served["encoder"].answer("/info")["model_type"] == {"embedding": {"pooling": "mean"}}


@pytest.mark.parametrize("path, body, param", [
    ("/embed", {"inputs": "day", "truncation_direction": "middle"}, "truncation_direction"),
    ("/embed", {"inputs": "day", "normalise": True}, "normalise"),
    ("/embed", {"inputs": 3}, "inputs"),
    ("/rerank", {"query": "day", "texts": "night"}, "texts"),
    ("/v1/embeddings", {"input": [1.5]}, "input"),
])
def test_schema_errors_name_the_field(served, path, body, param):
    refusal = _refused(served["reranker"], path, body)
    assert (refusal.status, refusal.param) == (422, param)


# Batching, guards and health.


def test_an_input_that_breaks_the_model_fails_alone(folders, tmp_path):
    """A token whose embedding is NaN: a batch holding it answers the other inputs as they are alone."""
    server = ServedModel(folders["encoder"])
    poisoned = server.tokenizer("crown", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        server.model.embeddings.word_embeddings.weight[poisoned] = float("nan")
    rows = server.tokenizer(["the king dies", "a crown", "day"])["input_ids"]
    results = server.run([Item("embed", (), row, len(row)) for row in rows])
    assert isinstance(results[1], RowError) and "NaN" in str(results[1])
    torch.testing.assert_close(torch.stack([results[0], results[2]]),
                               encode(server.model, server.tokenizer, ["the king dies", "day"]), atol=1e-5, rtol=0)
    with pytest.raises(RowError):
        server.answer("/embed", {"inputs": ["day", "a crown"]})


def test_a_completion_costs_its_prompt_and_max_tokens(served):
    parsed = served["lm"].parse("/v1/completions", {"prompt": ["the king", "day"], "max_tokens": 7, "n": 2})
    prompts = [len(ids) for ids in served["lm"].tokenizer(["the king", "day"])["input_ids"]]
    assert [item.tokens for item in parsed.items] == [prompts[0] + 7] * 2 + [prompts[1] + 7] * 2


def test_a_wedged_model_thread_fails_the_health_check(served):
    from roformer_hf.serving.app import ModelThread

    async def scenario():
        thread = ModelThread(served["encoder"], stall_s=0.5)
        await thread.check()  # idle: a tiny forward runs
        release = threading.Event()
        blocked = asyncio.ensure_future(thread.call(release.wait))
        await asyncio.sleep(0.8)  # busy and no progress for longer than stall_s
        with pytest.raises(RuntimeError, match="wedged"):
            await thread.check()
        assert "wedged" in thread.failure  # /health answers 503 meanwhile
        release.set()
        await blocked
        await thread.check()
        assert thread.failure is None

    asyncio.run(scenario())


def test_guards_refuse_before_the_route(monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from roformer_hf.serving import guards

    async def echo(request):
        return PlainTextResponse(str(len(await request.body())))

    app = Starlette(routes=[Route("/embed", echo, methods=["POST"]), Route("/health", echo, methods=["GET"])])
    app.add_middleware(guards.Guarded)
    monkeypatch.setattr(guards, "GUARD", guards.Guard(api_key="s3cret", payload_limit=100, replica=b"r1"))
    client = TestClient(app)
    missing = client.post("/embed", content=b"{}")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert client.post("/embed", content=b"{}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    key = {"Authorization": "Bearer s3cret"}
    answered = client.post("/embed", content=b"x" * 100, headers=key)
    assert answered.status_code == 200 and answered.headers["x-replica"] == "r1"
    too_big = client.post("/embed", content=b"x" * 101, headers=key)
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "request_too_large"
    assert client.get("/health").status_code == 200  # open without the key

    def chunked():  # no Content-Length: counted as it arrives
        yield b"x" * 60
        yield b"x" * 60

    streamed = client.post("/embed", content=chunked(), headers=key)
    assert "content-length" not in streamed.request.headers
    assert streamed.status_code == 413 and "payload-limit=100" in streamed.text


def test_the_default_ingress_is_haproxy_where_it_runs(monkeypatch):
    from roformer_hf import cli
    from roformer_hf.serving import ingress

    assert cli.choose_ingress("proxy", None) == ("proxy", None)
    assert cli.choose_ingress("auto", "auto") == ("cluster", None)
    monkeypatch.setattr(ingress, "haproxy_binary", lambda: None)
    import roformer_hf.serving as serving

    monkeypatch.setattr(serving, "haproxy_binary", lambda: None)
    chosen, why = cli.choose_ingress("auto", None)
    assert chosen == "proxy" and "no haproxy program runs here" in why
    monkeypatch.setattr(serving, "haproxy_binary", lambda: "/usr/sbin/haproxy")
    assert cli.choose_ingress("auto", None) == ("haproxy", None)


def test_the_docs_table_lists_every_flag_with_its_default():
    """docs/serving.md's settings table and `roformer-hf serve --help` name the same flags and defaults."""
    import re
    from pathlib import Path

    from roformer_hf.cli import _parser

    serve = _parser()._subparsers._group_actions[0].choices["serve"]
    flags = {action.option_strings[-1]: action for action in serve._actions
             if action.option_strings and action.option_strings[-1] != "--help"}
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(--[a-z0-9-]+)[^`]*` \| ([^|]+) \|", page, flags=re.MULTILINE))
    assert set(rows) == set(flags)
    for name, action in flags.items():
        if isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
            assert float(rows[name].strip().strip("`")) == action.default, (name, rows[name])
        elif isinstance(action.default, str) and name != "--api-key":
            assert rows[name].strip().strip("`") == action.default, (name, rows[name])


def test_deployment_settings_reach_ray_serve():
    from roformer_hf.serving import autoscaling, build_app, deployment_options

    options = deployment_options(replicas=2, threads=1, autoscale="0:4", max_ongoing_requests=8,
                                 max_queued_requests=-1)
    assert "num_replicas" not in options  # Ray Serve refuses both
    assert options["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 1,
                                             "target_ongoing_requests": 2}
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (8, -1)
    assert deployment_options(device="cuda")["ray_actor_options"] == {"num_cpus": deployment_options()[
        "ray_actor_options"]["num_cpus"], "num_gpus": 1}
    for spec in ("4", "3:1", "a:b", "0:0"):
        with pytest.raises(ValueError, match="autoscale="):
            autoscaling(spec)
    with pytest.raises(ValueError, match="max_queued_requests=-2: expected an integer of at least 0, or -1"):
        deployment_options(max_queued_requests=-2)
    with pytest.raises(ValueError, match=r"unknown arguments \['replica'\]"):
        build_app({"folder": "x", "replica": "2"})
    with pytest.raises(ValueError, match="int8='maybe': expected true or false"):
        build_app({"folder": "x", "int8": "maybe"})


def test_default_replicas_and_threads_count_the_cores_this_process_may_use(monkeypatch):
    """Under `taskset` or a container's cpuset the replicas and their threads share the cores the process may run on,
    not the machine's: on 2 of 16 cores, two replicas of one thread, or one of two."""
    import os

    from roformer_hf.serving import default_replicas, default_threads
    from roformer_hf.serving.app import MAX_DEFAULT_REPLICAS

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 7}, raising=False)
    assert (default_replicas(), default_threads(1), default_threads(2), default_replicas(threads=2)) == (2, 2, 1, 1)
    monkeypatch.delattr(os, "sched_getaffinity")  # an OS without affinity masks: the machine's count
    assert (default_replicas(), default_threads(1)) == (min(16, MAX_DEFAULT_REPLICAS), 16)


def test_device_and_cli_combinations_are_checked(folders, capsys):
    from roformer_hf.cli import main

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': this machine has 0 CUDA devices"):
            ServedModel(folders["encoder"], device="cuda")
    with pytest.raises(ValueError, match="device='tpu'"):
        ServedModel(folders["encoder"], device="tpu")
    for argv, message in ((["--ingress", "haproxy", "--address", "auto"], "--ingress haproxy with --address"),
                          (["--autoscale", "2"], "--autoscale: autoscale='2': expected MIN:MAX"),
                          (["--max-queued-requests", "-3"], "--max-queued-requests=-3"),
                          (["--payload-limit", "0"], "--payload-limit=0: expected a positive integer")):
        with pytest.raises(SystemExit) as exited:
            main(["serve", str(folders["encoder"]), *argv])
        assert exited.value.code != 0 and message in capsys.readouterr().err


def test_joining_a_cluster_presents_its_token(tmp_path, monkeypatch):
    """`ray start` (Ray 2.60) turns token authentication on and writes ~/.ray/auth_token; `--address` then presents
    it (checked by hand against `ray start --head`: refused without RAY_AUTH_MODE=token, served with it)."""
    from roformer_hf.cli import ray_token_available

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert not ray_token_available()
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t0ken")
    assert ray_token_available()
