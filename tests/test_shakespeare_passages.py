"""The demo's task data: passages of consecutive speeches labelled with their play's genre, split by play."""

import pytest
from shakespeare import (
    DEFAULT_GENRES,
    genre_classification_splits,
    genre_classification_test_plays,
    list_plays,
    speeches,
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
