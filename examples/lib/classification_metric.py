"""Accuracy and macro-averaged F1 for single-label classification, as an `evaluate` metric that works offline.

`evaluate.load("accuracy")` fetches the metric's code from the Hub. This file is loaded by path instead, so
evaluation needs no network; it is self-contained (numpy, datasets and evaluate only), so `evaluate.load` can
copy and import it:

```python
>>> import evaluate
>>> from lib.classification_metric import CLASSIFICATION_METRIC_PATH
>>> metric = evaluate.load(CLASSIFICATION_METRIC_PATH)
>>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
{'accuracy': 0.6666666666666666, 'macro_f1': 0.6666666666666666}
```
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import datasets
import evaluate
import numpy as np

CLASSIFICATION_METRIC_PATH = str(Path(__file__).resolve())

_DESCRIPTION = """Accuracy (the share of exact matches) and macro-F1: the F1 score of each class, one class
against the rest, averaged with equal weight over every class seen in the predictions or the references.
A class that occurs in the references but is never predicted scores F1 = 0."""

_INPUTS = """
Args:
    predictions (`list[int]`): predicted class ids.
    references (`list[int]`): true class ids.
Returns:
    accuracy (`float`): matches / examples, in [0, 1].
    macro_f1 (`float`): the unweighted mean over classes of 2 TP / (2 TP + FP + FN), in [0, 1].
"""


def accuracy(predictions: Sequence[int], references: Sequence[int]) -> float:
    """The share of predictions equal to their reference."""
    predictions, references = _as_arrays(predictions, references)
    return float((predictions == references).mean())


def per_class_f1(predictions: Sequence[int], references: Sequence[int]) -> dict[int, float]:
    """F1 of each class seen in `predictions` or `references`, that class against all others.

    F1 = 2 TP / (2 TP + FP + FN), which equals the harmonic mean of precision and recall and is 0, not
    undefined, for a class that is never predicted.
    """
    predictions, references = _as_arrays(predictions, references)
    scores = {}
    for label in np.union1d(predictions, references):
        true_positives = np.sum((predictions == label) & (references == label))
        predicted, actual = np.sum(predictions == label), np.sum(references == label)
        scores[int(label)] = float(2 * true_positives / (predicted + actual))  # 2TP+FP+FN = predicted+actual
    return scores


def macro_f1(predictions: Sequence[int], references: Sequence[int]) -> float:
    """The unweighted mean of `per_class_f1` over every class seen in predictions or references."""
    scores = per_class_f1(predictions, references)
    return float(np.mean(list(scores.values())))


def _as_arrays(predictions: Sequence[int], references: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    predictions, references = np.asarray(predictions).reshape(-1), np.asarray(references).reshape(-1)
    if len(predictions) != len(references):
        raise ValueError(f"predictions has {len(predictions)} items, references {len(references)}: expected equal")
    if len(references) == 0:
        raise ValueError("references is empty: expected at least one example")
    return predictions, references


class Classification(evaluate.Metric):
    """Accuracy and macro-F1 of integer class predictions."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({
                "predictions": datasets.Value("int64"),
                "references": datasets.Value("int64"),
            }),
        )

    def _compute(self, predictions, references) -> dict[str, float]:
        return {"accuracy": accuracy(predictions, references), "macro_f1": macro_f1(predictions, references)}


def load_classification_metrics(names: Sequence[str] | None = None) -> evaluate.CombinedEvaluations:
    """Metrics for single-label classification, combined so that one `compute` call returns them all.

    Args:
        names: `None` (the default) loads this file by path (accuracy and macro-F1; no network needed).
            Otherwise the named metrics (e.g. `["accuracy", "f1"]`) are loaded with `evaluate.load`, i.e. from
            the Hub or its cache, or by path for names that are local files.

    Example:

    ```python
    >>> load_classification_metrics().compute(predictions=[0, 1, 1, 2], references=[0, 1, 2, 2])
    {'accuracy': 0.75, 'macro_f1': 0.7777777777777777}
    ```
    """
    if names is None:
        return evaluate.combine([evaluate.load(CLASSIFICATION_METRIC_PATH)])
    if isinstance(names, str) or not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"names={names!r}: expected None or a non-empty list of metric names")
    return evaluate.combine([evaluate.load(name) for name in names])
