"""`--config_overrides` of the example scripts, parsed into typed config fields.

Kept apart from example_utils.py (which needs `datasets`) so that model_summary.py runs with torchinfo alone.
"""

from __future__ import annotations


def parse_overrides(overrides: str | None) -> dict[str, object]:
    """'hidden_size=256,rotary_layout=half,rope_theta=1e6,sparse_prediction=true' -> {"hidden_size": 256,
    "rotary_layout": "half", "rope_theta": 1000000.0, "sparse_prediction": True}: ints, floats, bools (true/false in
    any case), else strings."""
    result = {}
    for item in filter(None, (part.strip() for part in (overrides or "").split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config_overrides item {item!r}: expected key=value")
        value: object = raw.strip()
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                pass
        if raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
        result[key.strip()] = value
    return result
