"""The demo's bag-of-words baseline (examples/lib/baseline.py): scikit-learn's TF-IDF + logistic regression."""

import random

from lib.baseline import REGULARISATION, bag_of_words_baseline

WORDS = {0: "merry wedding jest dance song feast".split(), 1: "king crown war battle throne army".split()}


def _texts(n: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    labels = [rng.randint(0, 1) for _ in range(n)]
    texts = [" ".join(rng.choice(WORDS[y] + ["the", "and", "of"]) for _ in range(12)) for y in labels]
    return texts, labels


def test_learns_words_that_tell_the_classes_apart():
    (train, y_train), (val, y_val), (test, y_test) = _texts(200, 0), _texts(50, 1), _texts(50, 2)
    result = bag_of_words_baseline(train, y_train, val, y_val, test, y_test)
    assert result.validation_accuracy == result.test_accuracy == 1.0
    assert result.C in REGULARISATION
    assert list(result.test_predictions) == y_test


def test_cannot_see_word_order():
    """Two classes with the same words in another order: a bag of words has nothing to go on."""
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        a, b = rng.sample(WORDS[1], 2)
        rows += [(f"{a} before {b}", 0), (f"{b} before {a}", 1)]
    texts, labels = [t for t, _ in rows], [y for _, y in rows]
    result = bag_of_words_baseline(texts, labels, texts, labels, texts, labels)
    assert result.test_accuracy == 0.5  # each pair of texts gets one prediction, one of them wrong
