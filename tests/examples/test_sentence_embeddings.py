"""examples/sentence_embeddings.py: the retrieval ranks and metrics against brute force, and a smoke run end to end
(training, the saved folder, the figure, both methods scored)."""

import json

import numpy as np
import pytest
import torch
from lib.shakespeare import next_line_splits
from sentence_embeddings import (
    DEV_FRACTION,
    main,
    paired_differences,
    per_query,
    pooled_differences,
    ranks,
    recall_at,
    retrieval_metrics,
    tfidf_negatives,
)
from sentence_transformers import SentenceTransformer

from roformer_hf import RoFormerModel


def test_ranks_count_the_candidates_above_the_gold_line_and_skip_the_query_itself():
    candidates = ["a", "b", "c", "b", "q", "d"]
    queries, gold = ["q", "x"], ["b", "c"]
    scores = np.array([[0.9, 0.1, 0.5, 0.3, 1.0, 0.3],  # "q" itself scores 1.0 but is no candidate; best "b" is 0.3
                       [0.2, 0.8, 0.7, 0.1, 0.0, 0.0]])
    rank = ranks(scores, queries, candidates, gold)
    assert rank.tolist() == [[2, 1], [1, 0]]  # above the gold line, and tied with it ("d" at 0.3)
    # Ties broken at random: the first query's gold line is 3rd or 4th, each with probability 1/2.
    metrics = retrieval_metrics(rank)
    assert metrics["recall@1"] == 0 and metrics["recall@10"] == 1
    assert recall_at(rank, 2) == pytest.approx(0.5) and recall_at(rank, 3) == pytest.approx((0.5 + 1) / 2)
    assert recall_at(rank, 4) == 1
    assert metrics["mrr"] == pytest.approx(((1 / 3 + 1 / 4) / 2 + 1 / 2) / 2)
    brute = retrieval_metrics(np.array([[0, 0], [2, 0], [150, 0]]))
    assert brute["recall@1"] == pytest.approx(1 / 3) and brute["recall@10"] == pytest.approx(2 / 3)
    assert brute["recall@100"] == pytest.approx(2 / 3)
    assert brute["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 151) / 3)


def test_paired_differences_are_the_mean_and_standard_error_of_per_query_differences():
    ours = np.array([[0, 0], [0, 0], [3, 0], [0, 1]])       # hit, hit, 4th, 1st or 2nd
    baseline = np.array([[1, 0], [0, 0], [0, 0], [0, 3]])   # 2nd, hit, hit, 1st to 4th
    hits = np.array([1, 1, 0, 1 / 2]) - np.array([0, 1, 1, 1 / 4])
    reciprocal = np.array([1, 1, 1 / 4, (1 + 1 / 2) / 2]) - np.array([1 / 2, 1, 1, (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4])
    result = paired_differences(ours, baseline)
    for name, differences in (("recall@1", hits), ("mrr", reciprocal)):
        assert result[name]["difference"] == pytest.approx(differences.mean())
        assert result[name]["standard_error"] == pytest.approx(differences.std(ddof=1) / 2)
    assert result["recall@1"]["difference"] == pytest.approx(
        retrieval_metrics(ours)["recall@1"] - retrieval_metrics(baseline)["recall@1"])
    assert result["recall@10"] == {"difference": 0.0, "standard_error": 0.0}


def test_pooled_differences_weigh_runs_by_queries_and_refuse_shared_plays(tmp_path):
    rng = np.random.default_rng(0)
    runs, per_run = [], []
    for index, count in enumerate((40, 25, 60)):
        ours, baseline = rng.integers(0, 12, (count, 2)), rng.integers(0, 12, (count, 2))
        per_run.append(per_query(ours)["mrr"] - per_query(baseline)["mrr"])  # checked against brute force above
        runs.append({"held_out_plays": [f"play-{index}-a", f"play-{index}-b"], "queries": count,
                     "roformer_hf_minus_tfidf": paired_differences(ours, baseline)})
    pooled = pooled_differences(runs)
    every = np.concatenate(per_run)
    assert pooled["mrr"]["difference"] == pytest.approx(every.mean())
    # independent samples: the variance of the pooled mean is sum(n_i * s_i^2) / N^2
    within = sum(len(d) * d.var(ddof=1) for d in per_run)
    assert pooled["mrr"]["standard_error"] == pytest.approx(np.sqrt(within) / len(every))

    paths = []
    for index, run in enumerate(runs):
        paths.append(tmp_path / f"run{index}.json")
        paths[-1].write_text(json.dumps(run))
    printed = main(["--pool", *map(str, paths)])
    assert printed["roformer_hf_minus_tfidf"] == pooled

    shared = dict(runs[2], held_out_plays=["play-0-b", "play-2-b"])
    with pytest.raises(ValueError, match=r"runs\[0\] and runs\[1\] both hold out 'play-0-b'"):
        pooled_differences([runs[0], shared])
    with pytest.raises(ValueError, match="at least two"):
        pooled_differences(runs[:1])


def test_tfidf_negatives_are_the_closest_line_in_words_other_than_the_pair_itself():
    texts = ["the cat sat on the mat", "the cat sat on the mat today", "a dog ran", "a dog ran far",
             "the cat sat", "birds fly", "birds fly south", "the mat"]
    anchors = ["the cat sat on the mat", "a dog ran", "birds fly"]
    positives = ["the cat sat on the mat today", "birds fly", "a dog ran"]
    # The pair's own lines score highest (identical words) but are skipped; the next closest line is the negative.
    assert tfidf_negatives(anchors, positives, texts, chunk=2) == ["the cat sat", "a dog ran far", "birds fly south"]


def test_quick_run_trains_saves_and_scores_both_methods(tmp_path):
    results = main(["--quick", "--output_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "retrieval.json").read_text())
    assert saved == results
    for method in ("roformer_hf", "tfidf"):
        assert set(results[method]) == {"recall@1", "recall@10", "recall@100", "mrr"}
        assert all(0 <= value <= 1 for value in results[method].values())
    for name, paired in results["roformer_hf_minus_tfidf"].items():
        assert paired["difference"] == pytest.approx(results["roformer_hf"][name] - results["tfidf"][name])
    assert results["queries"] == 200 and 0 < results["candidates"] <= 200
    assert len(results["train_loss"]) >= 1
    assert (tmp_path / "retrieval.png").stat().st_size > 10_000
    model = SentenceTransformer(str(tmp_path / "model"), device="cpu")
    lines = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"]
    embeddings = model.encode(lines, convert_to_tensor=True)
    assert embeddings.shape == (2, 32) and torch.isfinite(embeddings).all()
    assert [m["type"].rpartition(".")[2] for m in json.loads((tmp_path / "model" / "modules.json").read_text())] == [
        "Transformer", "Pooling"]


def test_dev_run_scores_the_development_plays_and_never_the_validation_ones(tmp_path):
    """Settings are chosen with `--eval_split dev`: the plays scored are held out of training too, and are not the
    validation plays that the default run reports on."""
    results = main(["--quick", "--eval_split", "dev", "--loss", "symmetric", "--output_dir", str(tmp_path)])
    splits = next_line_splits(seed=0, dev_fraction=DEV_FRACTION)
    assert results["eval_split"] == "dev" and results["queries"] == 200
    assert set(results["held_out_plays"]) <= set(splits["dev"]["play"])
    assert not set(splits["dev"]["play"]) & (set(splits["validation"]["play"]) | set(splits["train"]["play"]))
    assert results["training_pairs"] == len(splits["train"])
    assert all(0 <= value <= 1 for value in results["roformer_hf"].values())


def test_masked_lm_start_reads_the_training_plays_only_and_prompts_reach_the_saved_folder(tmp_path):
    """--mlm_steps pretrains the encoder on the training plays' lines (never a held-out play's) before the
    contrastive training; by default the run trains and scores with sentence-transformers' query and document
    prompts, which the saved folder keeps."""
    results = main(["--quick", "--mlm_steps", "2", "--output_dir", str(tmp_path)])
    splits = next_line_splits(seed=0, dev_fraction=DEV_FRACTION)
    corpus = set((tmp_path / "mlm" / "corpus.txt").read_text().splitlines())
    assert corpus == set(splits["train"]["source"]) | set(splits["train"]["target"])
    trainer_state = json.loads((tmp_path / "mlm" / "trained" / "trainer_state.json").read_text())
    assert trainer_state["global_step"] == 2
    assert results["settings"]["mlm_steps"] == 2 and results["settings"]["prompts"] is True
    model = SentenceTransformer(str(tmp_path / "model"), device="cpu")
    assert model.prompts == {"query": "query: ", "document": "document: "}
    line = ["Now is the winter of our discontent"]
    assert not np.allclose(model.encode_query(line), model.encode_document(line))


def test_query_map_scores_a_linear_map_of_the_query_against_the_plain_document_embedding(tmp_path):
    """--query_map appends a Router whose query route is a learnt linear map (from the identity) and whose document
    route is empty: the saved folder loads with it, `encode_query` is `encode_document` times that map's transpose,
    and the encoder underneath still loads alone."""
    results = main(["--quick", "--query_map", "--no-prompts", "--output_dir", str(tmp_path)])
    assert results["settings"]["query_map"] is True and results["settings"]["prompts"] is False
    folder = tmp_path / "model"
    assert [m["type"].rpartition(".")[2] for m in json.loads((folder / "modules.json").read_text())] == [
        "Transformer", "Pooling", "Router"]
    model = SentenceTransformer(str(folder), device="cpu")
    assert not any(model.prompts.values())  # the Router names both tasks, with empty prompts
    weight = model[2].sub_modules["query"][0].linear.weight.detach()
    assert weight.shape == (32, 32) and not torch.allclose(weight, torch.eye(32))
    lines = ["Now is the winter of our discontent", "Made glorious summer by this sun of York"]
    documents = model.encode_document(lines, convert_to_tensor=True)
    torch.testing.assert_close(model.encode_query(lines, convert_to_tensor=True), documents @ weight.T)
    torch.testing.assert_close(model.encode(lines, convert_to_tensor=True), documents)
    assert RoFormerModel.from_pretrained(folder).config.hidden_size == 32
