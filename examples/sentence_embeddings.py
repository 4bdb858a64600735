"""Sentence embeddings on Shakespeare, offline: contrastive training with sentence-transformers, then retrieval on
plays the model never saw, against a TF-IDF baseline in the same run.

The task: given a spoken line, find the line that follows it in the same speech among every such line of the
held-out plays. Training pairs are neighbouring lines of one speech in the other plays (`shakespeare.
next_line_splits`); the loss is MultipleNegativesRankingLoss in both directions (each line against the batch's next
lines, each next line against the batch's lines; the other pairs of a batch are the negatives). A line is encoded
with the prompt "query: " and the lines that may follow it with "document: ", so that the line after it can score
above the line before it. The model is a small RoFormer built from scratch with a WordPiece vocabulary trained on
the training plays; the folder it is saved to loads with `SentenceTransformer(folder)`, prompts included.

Besides the validation plays that a run reports on, a tenth of the plays is held out for development and never
trained on: settings are chosen with `--eval_split dev`, which scores those instead.

    python examples/sentence_embeddings.py                    # about 35 CPU-minutes (--threads 1 on a busy machine)
    python examples/sentence_embeddings.py --eval_split dev   # the same run, scored on the development plays
    python examples/sentence_embeddings.py --quick            # a smoke run, seconds
    python examples/sentence_embeddings.py --pool A/retrieval.json B/retrieval.json  # runs on disjoint plays, pooled

It prints recall@1/10/100 and MRR for both, and their differences with the paired standard error over the queries
(both methods rank the same queries), writes them to `OUTPUT_DIR/retrieval.json`, and draws recall@k
(`OUTPUT_DIR/retrieval.png`). The query's own text is never a candidate.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from figures import pyplot, save_figure
from lib.shakespeare import next_line_splits

import roformer_hf
from roformer_hf import RoFormerConfig, RoFormerModel, train_tokenizer

logger = logging.getLogger(__name__)
KS = (1, 10, 100)
# The share of plays held out for development (never trained on, whatever --eval_split).
DEV_FRACTION = 0.1
# sentence-transformers' prompt names (unless --no-prompts): a line is encoded as a query, the lines that may follow
# it as documents (`encode_query`, `encode_document`).
PROMPTS = {"query": "query: ", "document": "document: "}


def ranks(scores: np.ndarray, queries: list[str], candidates: list[str], gold: list[str]) -> np.ndarray:
    """Where each query's gold line falls among `candidates`, by `scores` `(Q, C)`: `(Q, 2)`, the candidates scoring
    above the best-scoring copy of the gold text, and those scoring exactly as high (ties, e.g. TF-IDF's zeros for
    lines without a word in common: the gold line is equally likely anywhere among them). Candidates equal to the
    query's own text are left out."""
    candidate_text = np.array(candidates, dtype=object)
    result = np.empty((len(queries), 2), dtype=np.int64)
    for i, (row, query, target) in enumerate(zip(scores, queries, gold)):
        row = np.where(candidate_text == query, -np.inf, row)
        is_gold = candidate_text == target
        best_gold = row[is_gold].max()
        result[i] = (row > best_gold).sum(), ((row == best_gold) & ~is_gold).sum()
    return result


def hits_at(rank: np.ndarray, k: int) -> np.ndarray:
    """Per query, the chance that its gold line is among the first `k`, ties broken at random."""
    above, ties = rank[:, 0], rank[:, 1]
    return np.clip((k - above) / (ties + 1), 0, 1)


def recall_at(rank: np.ndarray, k: int) -> float:
    """The share of queries whose gold line is among the first `k`, ties broken at random (in expectation)."""
    return float(hits_at(rank, k).mean())


def per_query(rank: np.ndarray) -> dict[str, np.ndarray]:
    """Each query's share of recall@k for `KS` and its expected reciprocal rank, ties broken at random."""
    from scipy.special import digamma

    above, ties = rank[:, 0], rank[:, 1]
    # The mean of 1 / (position + 1) over the positions above .. above + ties: a difference of harmonic numbers.
    reciprocal = (digamma(above + ties + 2) - digamma(above + 1)) / (ties + 1)
    return {**{f"recall@{k}": hits_at(rank, k) for k in KS}, "mrr": reciprocal}


def retrieval_metrics(rank: np.ndarray) -> dict[str, float]:
    """recall@k for `KS` and the mean reciprocal rank, ties broken at random (in expectation)."""
    return {name: float(values.mean()) for name, values in per_query(rank).items()}


def paired_differences(ours: np.ndarray, baseline: np.ndarray) -> dict[str, dict[str, float]]:
    """Each metric's difference between two methods ranked on the same queries, with its paired standard error (the
    spread of the per-query differences over the square root of their count): a difference of two or more standard
    errors is one the queries' sampling alone rarely makes."""
    result = {}
    for (name, a), b in zip(per_query(ours).items(), per_query(baseline).values()):
        difference = a - b
        result[name] = {"difference": float(difference.mean()),
                        "standard_error": float(difference.std(ddof=1) / np.sqrt(len(difference)))}
    return result


def pooled_differences(runs: list[dict]) -> dict[str, dict[str, float]]:
    """The differences of several runs' `retrieval.json` results on disjoint held-out plays, pooled over all their
    queries: each run's difference weighted by its query count, the standard errors combined as those of independent
    samples. Runs that share a held-out play (several seeds of one split, say) do not rank independent queries, and
    are refused."""
    if len(runs) < 2:
        raise ValueError(f"runs: expected at least two results to pool, got {len(runs)}")
    seen: dict[str, int] = {}
    for index, run in enumerate(runs):
        if "roformer_hf_minus_tfidf" not in run:
            raise ValueError(f"runs[{index}] has no 'roformer_hf_minus_tfidf': expected the retrieval.json of a run")
        for play in run["held_out_plays"]:
            if play in seen:
                raise ValueError(f"runs[{seen[play]}] and runs[{index}] both hold out {play!r}: pooling needs runs on "
                                 "disjoint held-out plays (another --split_seed), whose queries are independent")
            seen[play] = index
    counts = np.array([run["queries"] for run in runs], dtype=float)
    pooled = {}
    for name in runs[0]["roformer_hf_minus_tfidf"]:
        differences = np.array([run["roformer_hf_minus_tfidf"][name]["difference"] for run in runs])
        errors = np.array([run["roformer_hf_minus_tfidf"][name]["standard_error"] for run in runs])
        pooled[name] = {"difference": float(counts @ differences / counts.sum()),
                        "standard_error": float(np.sqrt(counts**2 @ errors**2) / counts.sum())}
    return pooled


def tfidf_vectorizer(train_texts: list[str]):
    """TF-IDF of word unigrams and bigrams with sublinear term frequencies, fitted on the training lines."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), min_df=2).fit(train_texts)


def tfidf_scores(train_texts: list[str], queries: list[str], candidates: list[str]) -> np.ndarray:
    """Cosine similarity of the queries' and candidates' TF-IDF vectors (`tfidf_vectorizer`)."""
    vectorizer = tfidf_vectorizer(train_texts)
    return (vectorizer.transform(queries) @ vectorizer.transform(candidates).T).toarray()


def tfidf_negatives(anchors: list[str], positives: list[str], texts: list[str], chunk: int = 2048) -> list[str]:
    """For each anchor, the line of `texts` that TF-IDF (fitted on `texts`) ranks first for it, other than the anchor
    and its positive: the wrong answer a lexical retriever would give, as a hard negative. Ties go to the earlier
    line of `texts`."""
    vectorizer = tfidf_vectorizer(texts)
    index = {text: i for i, text in enumerate(texts)}
    pool = vectorizer.transform(texts).T.tocsc()
    negatives = []
    for start in range(0, len(anchors), chunk):
        scores = (vectorizer.transform(anchors[start:start + chunk]) @ pool).toarray()
        rows = np.arange(scores.shape[0])
        for excluded in (anchors, positives):
            scores[rows, [index[text] for text in excluded[start:start + chunk]]] = -np.inf
        negatives += [texts[i] for i in scores.argmax(axis=1)]
    return negatives


def build_model(train_texts: list[str], folder: Path, args) -> Path:
    """A RoFormer and its WordPiece tokenizer (lowercased unless `args.lowercase` is off), trained on `train_texts`,
    saved where `SentenceTransformer` loads them with `args.pooling`: fresh, or with `args.mlm_steps` first
    pretrained with masked LM on those same texts (`pretrain`)."""
    tokenizer = train_tokenizer(train_texts, vocab_size=args.vocab_size, lowercase=args.lowercase,
                                model_max_length=args.max_seq_length)
    longest = max(args.max_seq_length, args.mlm_seq_length if args.mlm_steps else 0)  # the longest trained on
    config = RoFormerConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                            num_attention_heads=args.hidden_size // 32, intermediate_size=4 * args.hidden_size,
                            max_position_embeddings=longest, hidden_dropout_prob=args.dropout,
                            attention_probs_dropout_prob=0.0, sentence_pooling=args.pooling)
    torch.manual_seed(args.seed)
    model = RoFormerModel(config) if not args.mlm_steps else pretrain(config, tokenizer, train_texts, folder, args)
    model.config.hidden_dropout_prob = args.dropout
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def pretrain(config: RoFormerConfig, tokenizer, train_texts: list[str], folder: Path, args) -> RoFormerModel:
    """The encoder after `args.mlm_steps` steps of masked-LM pretraining (`run_mlm.py`, without dropout, 30% of the
    tokens masked) on `train_texts` in their order, packed into blocks of `args.mlm_seq_length` tokens: the training
    plays only, so the held-out plays stay unread."""
    import run_mlm

    from roformer_hf import RoFormerForMaskedLM

    work = folder.parent / "mlm"
    start, corpus, trained = work / "start", work / "corpus.txt", work / "trained"
    mlm_config = RoFormerConfig(**{**config.to_diff_dict(), "hidden_dropout_prob": 0.0, "sparse_prediction": True})
    RoFormerForMaskedLM(mlm_config).save_pretrained(start)
    tokenizer.save_pretrained(start)
    corpus.write_text("\n".join(train_texts) + "\n")
    run_mlm.main([
        "--model_name_or_path", str(start), "--train_file", str(corpus), "--output_dir", str(trained),
        "--line_by_line", "false", "--max_seq_length", str(args.mlm_seq_length), "--mlm_probability", "0.3",
        "--max_steps", str(args.mlm_steps), "--per_device_train_batch_size", str(args.mlm_batch_size),
        "--learning_rate", "1e-3", "--warmup_steps", str(max(1, args.mlm_steps // 10)), "--weight_decay", "0.01",
        "--do_train", "true", "--do_eval", "false", "--save_strategy", "no", "--report_to", "none",
        "--use_cpu", "true", "--seed", str(args.seed), "--logging_steps", str(max(1, args.mlm_steps // 10)),
        "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--validation_split_percentage", "1"])
    return RoFormerModel.from_pretrained(trained, hidden_dropout_prob=args.dropout)


def training_pairs(pairs, by_play: bool, negatives: list[str] | None = None):
    """The `(anchor, positive)` pairs to train on: one dataset, or with `by_play` one per play, so that every batch
    (sentence-transformers draws each batch from one dataset) holds lines of a single play, whose other lines are
    harder negatives: the same names, the same matters. `negatives` adds a third column, one hard negative per pair,
    which the loss sets against every anchor of the batch."""
    columns = {"source": "anchor", "target": "positive"}
    if negatives is not None:
        pairs = pairs.add_column("negative", negatives)
    if not by_play:
        return pairs.remove_columns("play").rename_columns(columns)
    import datasets

    plays = np.array(pairs["play"])
    return datasets.DatasetDict({
        play: pairs.select(np.flatnonzero(plays == play)).remove_columns("play").rename_columns(columns)
        for play in dict.fromkeys(plays)})


def contrastive_loss(model, args):
    """MultipleNegativesRankingLoss at `args.scale`: each line against the batch's next lines, and with `args.loss ==
    "symmetric"` also each next line against the batch's lines (the two softmaxes averaged). `args.hardness > 0`
    weights the negatives that already score high more (sentence-transformers' `hardness_mode="in_batch_negatives"`).
    """
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    options = {"scale": args.scale}
    if args.loss == "symmetric":
        options.update(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
    if args.hardness:
        options.update(hardness_mode="in_batch_negatives", hardness_strength=args.hardness)
    return MultipleNegativesRankingLoss(model, **options)


def query_map(width: int):
    """A linear map applied to the query's embedding only (sentence-transformers' `Router`: `encode_query` takes the
    "query" route, `encode_document` the "document" route, which passes the embedding on unchanged), starting as
    the identity: the score `cos(W q, d)` need not be symmetric, so the line after a query can score above the line
    before it, which one shared embedding cannot tell apart."""
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sentence_transformer.modules import Dense

    query = Dense(width, width, bias=False, activation_function=None, init_weight=torch.eye(width))
    return Router.for_query_document(query_modules=[query], document_modules=[])


def train(folder: Path, pairs, args, negatives: list[str] | None = None):
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    model = SentenceTransformer(str(folder), device="cpu")
    prompts = None
    if args.prompts:
        model.prompts = dict(PROMPTS)
        prompts = {"anchor": PROMPTS["query"], "positive": PROMPTS["document"]}
    router_mapping = {}
    if args.query_map:
        model.append(query_map(model.get_embedding_dimension()))
        router_mapping = {"anchor": "query", "positive": "document", "negative": "document"}
    training_args = SentenceTransformerTrainingArguments(prompts=prompts, router_mapping=router_mapping,
        output_dir=str(args.output_dir / "checkpoints"), max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate,
        warmup_steps=args.max_steps // 10, weight_decay=0.01, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=max(1, args.max_steps // 10), seed=args.seed, batch_sampler="no_duplicates",
        multi_dataset_batch_sampler="proportional", dataloader_drop_last=True, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=training_args,
                                         train_dataset=training_pairs(pairs, args.batches == "play", negatives),
                                         loss=contrastive_loss(model, args))
    trainer.train()
    return model, trainer.state.log_history


def plot(ranks_by_method: dict[str, np.ndarray], pool: int, path: Path) -> Path:
    plt = pyplot()
    ks = np.unique(np.logspace(0, np.log10(pool), 60).astype(int))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, rank in ranks_by_method.items():
        ax.plot(ks, [recall_at(rank, k) for k in ks], label=name)
    ax.set(xscale="log", xlabel=f"k (candidates: {pool:,} lines of held-out plays)", ylabel="recall@k",
           title="Which line comes next? Retrieval on unseen plays", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, default=Path("runs/sentence_embeddings"))
    parser.add_argument("--max_steps", type=int, default=1400)
    parser.add_argument("--batch_size", type=int, default=256, help="pairs per step; the rest of a batch are negatives")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden dropout")
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=6000)
    parser.add_argument("--max_seq_length", type=int, default=48)
    parser.add_argument("--mlm_steps", type=int, default=0,
                        help="masked-LM pretraining steps on the training plays before the contrastive training")
    parser.add_argument("--mlm_batch_size", type=int, default=16, help="blocks per masked-LM step")
    parser.add_argument("--mlm_seq_length", type=int, default=128, help="tokens per masked-LM block")
    parser.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=True,
                        help="a lowercased WordPiece vocabulary (--no-lowercase: cased)")
    parser.add_argument("--pooling", choices=("mean", "cls"), default="mean")
    parser.add_argument("--loss", choices=("mnrl", "symmetric"), default="symmetric",
                        help="mnrl: line -> next line; symmetric: both directions")
    parser.add_argument("--scale", type=float, default=20.0, help="the loss's scale (1 / temperature)")
    parser.add_argument("--prompts", action=argparse.BooleanOptionalAction, default=True,
                        help="encode lines and the lines that may follow them with different prompts ('query: ', "
                             "'document: '), so that the line after a query can score above the line before it, "
                             "which one encoding for both scores alike (--no-prompts: one encoding)")
    parser.add_argument("--query_map", action="store_true",
                        help="learn a linear map of the query's embedding (a Router), so that the line after a query "
                             "and the line before it need not score alike")
    parser.add_argument("--hardness", type=float, default=0.0,
                        help="weight the in-batch negatives by how close they already are (0: off)")
    parser.add_argument("--tfidf_negatives", action="store_true",
                        help="add to each pair, as a hard negative, the training line TF-IDF ranks first for its "
                             "line (other than the pair's own lines)")
    parser.add_argument("--batches", choices=("mixed", "play"), default="mixed",
                        help="mixed: pairs of all training plays shuffled together; play: each batch from one play")
    parser.add_argument("--eval_split", choices=("validation", "dev"), default="validation",
                        help="dev: score on the development plays (to choose settings), never on the validation ones")
    parser.add_argument("--split_seed", type=int, default=0,
                        help="which plays are held out (validation and dev); --seed fixes the model and batches")
    parser.add_argument("--eval_pairs", type=int, default=None, help="evaluate on the first N held-out pairs only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice); 1 is faster on a machine busy with other work")
    parser.add_argument("--pool", type=Path, nargs="+", metavar="RETRIEVAL_JSON",
                        help="train nothing: pool the differences of earlier runs on disjoint held-out plays "
                             "(their retrieval.json files) over all their queries, and print them")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, a small model and pool")
    args = parser.parse_args(argv)
    if args.pool:
        runs = [json.loads(path.read_text()) for path in args.pool]
        pooled = pooled_differences(runs)
        print(f"{sum(run['queries'] for run in runs):,} queries of {len(runs)} runs on disjoint held-out plays")
        print(f"{'':>12} " + " ".join(f"{name:>10}" for name in pooled))
        print_differences(pooled)
        return {"runs": [str(path) for path in args.pool], "roformer_hf_minus_tfidf": pooled}
    if args.quick:
        args.max_steps, args.batch_size, args.hidden_size, args.layers = 6, 16, 32, 1
        args.vocab_size, args.eval_pairs = 500, args.eval_pairs or 200
        args.mlm_steps, args.mlm_batch_size, args.mlm_seq_length = min(args.mlm_steps, 3), 4, 32
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    start, start_cpu = time.perf_counter(), time.process_time()

    splits = next_line_splits(seed=args.split_seed, dev_fraction=DEV_FRACTION)
    train_pairs = splits["train"]
    held_out = splits[args.eval_split]
    if args.eval_pairs is not None:
        held_out = held_out.select(range(min(args.eval_pairs, len(held_out))))
    queries, gold = list(held_out["source"]), list(held_out["target"])
    candidates = list(dict.fromkeys(gold))
    train_texts = list(dict.fromkeys(list(train_pairs["source"]) + list(train_pairs["target"])))

    folder = build_model(train_texts, args.output_dir / "model", args)
    negatives = None
    if args.tfidf_negatives:
        negatives = tfidf_negatives(list(train_pairs["source"]), list(train_pairs["target"]), train_texts)
    model, log_history = train(folder, train_pairs, args, negatives)
    model.save(str(folder))

    query_embeddings = model.encode_query(queries, batch_size=256, normalize_embeddings=True)
    candidate_embeddings = model.encode_document(candidates, batch_size=256, normalize_embeddings=True)
    ours = ranks(query_embeddings @ candidate_embeddings.T, queries, candidates, gold)
    baseline = ranks(tfidf_scores(train_texts, queries, candidates), queries, candidates, gold)
    results = {
        "eval_split": args.eval_split, "held_out_plays": sorted(set(held_out["play"])), "queries": len(queries),
        "candidates": len(candidates),
        "training_pairs": len(train_pairs), "steps": args.max_steps, "batch_size": args.batch_size,
        "roformer_hf": retrieval_metrics(ours), "tfidf": retrieval_metrics(baseline),
        "roformer_hf_minus_tfidf": paired_differences(ours, baseline),
        "train_loss": [entry["loss"] for entry in log_history if "loss" in entry],
        "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(time.process_time() - start_cpu, 1),
        "threads": torch.get_num_threads(),
        "settings": {name: value for name, value in vars(args).items() if name != "output_dir"},
        "roformer_hf_version": roformer_hf.__version__,
    }
    (args.output_dir / "retrieval.json").write_text(json.dumps(results, indent=2) + "\n")
    label = "roformer_hf, contrastive (MNRL" + (", both directions)" if args.loss == "symmetric" else ")")
    plot({label: ours, "TF-IDF (words and bigrams)": baseline}, len(candidates), args.output_dir / "retrieval.png")
    print(f"{len(queries):,} queries, {len(candidates):,} candidate lines from {len(results['held_out_plays'])} "
          f"held-out plays; {results['seconds']} s ({results['cpu_seconds']} s of CPU)")
    print(f"{'':>12} " + " ".join(f"{name:>10}" for name in results["tfidf"]))
    for method in ("roformer_hf", "tfidf"):
        print(f"{method:>12} " + " ".join(f"{value:>10.4f}" for value in results[method].values()))
    print_differences(results["roformer_hf_minus_tfidf"])
    return results


def print_differences(differences: dict[str, dict[str, float]]):
    print(f"{'difference':>12} " + " ".join(f"{d['difference']:>+10.4f}" for d in differences.values()))
    print(f"{'(paired SE)':>12} " + " ".join(f"{d['standard_error']:>10.4f}" for d in differences.values()))


if __name__ == "__main__":
    main()
