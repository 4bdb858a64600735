"""Evaluation metrics that work offline.

`evaluate.load("accuracy")` fetches the metric's code from the Hub. The modules in this folder ship with the
package and are loaded by path instead, so evaluation needs no network.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import evaluate

CLASSIFICATION_METRIC_PATH = str(Path(__file__).with_name("classification.py"))


def load_classification_metrics(names: Sequence[str] | None = None) -> evaluate.CombinedEvaluations:
    """Metrics for single-label classification, combined so that one `compute` call returns them all.

    Args:
        names: `None` (the default) loads the local module `classification.py` (accuracy and macro-F1;
            no network needed). Otherwise the named metrics (e.g. `["accuracy", "f1"]`) are loaded with
            `evaluate.load`, i.e. from the Hub or its cache, or by path for names that are local files.

    Example:

    ```python
    >>> from roformer_hf.metrics import load_classification_metrics
    >>> load_classification_metrics().compute(predictions=[0, 1, 1, 2], references=[0, 1, 2, 2])
    {'accuracy': 0.75, 'macro_f1': 0.7777777777777777}
    ```
    """
    if names is None:
        return evaluate.combine([evaluate.load(CLASSIFICATION_METRIC_PATH)])
    if isinstance(names, str) or not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"names={names!r}: expected None or a non-empty list of metric names")
    return evaluate.combine([evaluate.load(name) for name in names])


__all__ = ["CLASSIFICATION_METRIC_PATH", "load_classification_metrics"]
