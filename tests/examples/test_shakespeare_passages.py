"""The demo's task data: passages of consecutive lines or speeches of one play (word order, genre), split by play."""

import pytest
from lib.shakespeare import (
    DEFAULT_GENRES,
    WORD_ORDER_LABELS,
    genre_classification_splits,
    genre_classification_test_plays,
    list_plays,
    speeches,
    spoken_lines,
    word_order_splits,
)


@pytest.fixture(scope="module")
def passages():
    return genre_classification_splits(seed=0, passage_words=190)


def test_passages_are_consecutive_speeches_of_one_play(passages):
    train = passages["train"]
    assert min(len(text.split()) for text in train["text"]) >= 190
    first_play = train["play"][0]
    play = next(p for p in list_plays(DEFAULT_GENRES) if p.name == first_play)
    opening = [s.text for s in speeches(plays=[play])]
    joined = " ".join(opening[:next(i for i in range(1, len(opening) + 1)
                                     if len(" ".join(opening[:i]).split()) >= 190)])
    assert train["text"][0] == joined
    assert train.features["label"].names == list(DEFAULT_GENRES)
    assert train["label"][0] == DEFAULT_GENRES.index(play.genre)


def test_no_play_in_two_splits_and_test_plays_named_without_reading(passages):
    plays = {split: set(rows["play"]) for split, rows in passages.items()}
    assert not plays["train"] & plays["validation"] and not plays["train"] & plays["test"]
    assert not plays["validation"] & plays["test"]
    assert plays["test"] == set(genre_classification_test_plays(seed=0))
    assert set(passages["test"]["label"]) == {0, 1, 2}


def test_bad_passage_length_is_refused():
    with pytest.raises(ValueError, match="passage_words=0"):
        genre_classification_splits(passage_words=0)


@pytest.fixture(scope="module")
def word_order():
    return word_order_splits(seed=0, passage_words=150, shuffled_lines=0.3)


def test_word_order_passages_hold_the_lines_of_one_play_or_the_same_words_reordered(word_order):
    from collections import Counter

    test = word_order["test"]
    assert test.features["label"].names == list(WORD_ORDER_LABELS)
    opening_play = next(p for p in list_plays(DEFAULT_GENRES) if p.name == test["play"][0])
    lines, passages = [], []  # the play's lines grouped as the docstring says, rebuilt here
    for line in spoken_lines(plays=[opening_play]):
        lines.append(line)
        if len(" ".join(lines).split()) >= 150:
            passages.append(lines)
            lines = []
    for text, label, original in zip(test["text"][:20], test["label"][:20], passages):
        words, written = text.split(), " ".join(original).split()
        assert Counter(words) == Counter(written)  # the same words: a bag of words cannot tell the classes apart
        if label == 0:
            assert words == written
        else:
            # every line keeps its length and its words: shuffling stays within a line
            cut = [len(line.split()) for line in original]
            starts = [sum(cut[:i]) for i in range(len(cut))]
            shuffled = [i for i, start in enumerate(starts) if words[start:start + cut[i]] != original[i].split()]
            assert 1 <= len(shuffled) <= max(1, round(0.3 * len(original)))
            for i in shuffled:
                assert Counter(words[starts[i]:starts[i] + cut[i]]) == Counter(original[i].split())
    assert 0.45 < sum(word_order["train"]["label"]) / len(word_order["train"]) < 0.55  # a fair coin per passage


def test_word_order_splits_by_play_with_the_genre_tasks_plays(word_order):
    plays = {split: set(rows["play"]) for split, rows in word_order.items()}
    assert not plays["train"] & plays["validation"] and not plays["train"] & plays["test"]
    assert not plays["validation"] & plays["test"]
    assert plays["test"] == set(genre_classification_test_plays(seed=0))
    again = word_order_splits(seed=0, passage_words=150, shuffled_lines=0.3)["test"]
    assert again["text"] == word_order["test"]["text"] and again["label"] == word_order["test"]["label"]


@pytest.mark.parametrize("arguments, message", [({"passage_words": 0}, "passage_words=0"),
                                                 ({"shuffled_lines": 0.0}, "shuffled_lines=0.0"),
                                                 ({"shuffled_lines": 1.5}, "shuffled_lines=1.5")])
def test_bad_word_order_arguments_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        word_order_splits(**arguments)
