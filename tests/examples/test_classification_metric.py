"""Tests of examples/lib/classification_metric.py, the offline classification metric, against hand-computed values."""

import evaluate
import pytest
from lib.classification_metric import CLASSIFICATION_METRIC_PATH, load_classification_metrics, macro_f1, per_class_f1


@pytest.fixture(scope="module")
def metrics():
    return load_classification_metrics()


def test_macro_f1_averages_classes_with_equal_weight(metrics):
    # class 0: TP 2, predicted 3, actual 2 -> F1 = 4/5; class 1: TP 1, 1, 2 -> 2/3; class 2: TP 2, 2, 2 -> 1.
    result = metrics.compute(predictions=[0, 0, 0, 1, 2, 2], references=[0, 0, 1, 1, 2, 2])
    assert result["accuracy"] == pytest.approx(5 / 6)
    assert result["macro_f1"] == pytest.approx((4 / 5 + 2 / 3 + 1) / 3)  # 0.822, not micro-F1 = 5/6


def test_class_never_predicted_scores_zero(metrics):
    # class 0: TP 2, predicted 4, actual 2 -> 2/3; class 1 is never predicted -> 0.
    result = metrics.compute(predictions=[0, 0, 0, 0], references=[0, 0, 1, 1])
    assert result == pytest.approx({"accuracy": 0.5, "macro_f1": 1 / 3})


def test_class_only_predicted_counts_in_the_average():
    assert per_class_f1([0, 2], [0, 0]) == pytest.approx({0: 2 / 3, 2: 0.0})
    assert macro_f1([0, 2], [0, 0]) == pytest.approx(1 / 3)


def test_perfect_and_batched_predictions():
    metric = evaluate.load(CLASSIFICATION_METRIC_PATH)
    metric.add_batch(predictions=[3, 1], references=[3, 1])
    metric.add_batch(predictions=[2], references=[2])
    assert metric.compute() == {"accuracy": 1.0, "macro_f1": 1.0}


def test_named_metrics_are_loaded_with_evaluate_load():
    combined = load_classification_metrics([CLASSIFICATION_METRIC_PATH])  # a path works as a name, offline
    assert combined.compute(predictions=[1, 1], references=[1, 0])["accuracy"] == 0.5
    with pytest.raises(ValueError, match="names"):
        load_classification_metrics("accuracy")


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="predictions"):
        macro_f1([0, 1], [0])
