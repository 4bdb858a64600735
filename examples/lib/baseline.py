"""The bag-of-words baseline the demo's classifier is measured against: scikit-learn's TF-IDF features and
logistic regression, with the regularisation strength chosen on the validation split.

It sees which words a text holds and how often, never their order. Example:

```python
>>> from lib.baseline import bag_of_words_baseline
>>> texts = ["the king and the crown", "a merry jest and a song"] * 10
>>> result = bag_of_words_baseline(texts, [0, 1] * 10, texts, [0, 1] * 10, ["the crown"], [0])
>>> result.test_accuracy
1.0
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

REGULARISATION = (0.1, 1.0, 10.0, 100.0)  # inverse strengths C tried; the validation split picks one


class BaselineResult(NamedTuple):
    validation_accuracy: float
    test_accuracy: float
    C: float
    test_predictions: np.ndarray


def bag_of_words_baseline(train_texts: Sequence[str], train_labels: Sequence[int],
                          validation_texts: Sequence[str], validation_labels: Sequence[int],
                          test_texts: Sequence[str], test_labels: Sequence[int]) -> BaselineResult:
    """TF-IDF (sublinear term frequencies, words seen in at least two training texts) + logistic regression,
    fitted on train; C in `REGULARISATION` chosen by validation accuracy; scored once on test."""
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
    except ImportError as error:
        raise ImportError("the baseline needs scikit-learn: pip install roformer_hf[examples]") from error

    vectorizer = TfidfVectorizer(sublinear_tf=True, min_df=2 if len(train_texts) > 20 else 1)
    train = vectorizer.fit_transform(train_texts)
    validation, test = vectorizer.transform(validation_texts), vectorizer.transform(test_texts)
    best = None
    for C in REGULARISATION:
        classifier = LogisticRegression(C=C, max_iter=5000).fit(train, train_labels)
        accuracy = float(np.mean(classifier.predict(validation) == np.asarray(validation_labels)))
        if best is None or accuracy > best[0]:
            best = (accuracy, C, classifier)
    accuracy, C, classifier = best
    predictions = classifier.predict(test)
    return BaselineResult(accuracy, float(np.mean(predictions == np.asarray(test_labels))), C, predictions)
