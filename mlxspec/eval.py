"""Moved to :mod:`mlxspec.evaluation` (a module named ``eval`` shadows the built-in).

Kept only so that code not yet switched keeps importing; the lead deletes it at merge once
nothing imports ``mlxspec.eval`` (requests are in /work/coord/requests.md).
"""

from mlxspec.evaluation import *  # noqa: F403
from mlxspec.evaluation import __all__, compare, gate, take_windows  # noqa: F401


def evaluate_against(model, tokenizer, reference_model, *, bits, reference, thresholds=None,
                     text=None, windows=8, window_tokens=256, progress=True):
    """Old in-memory form of :func:`mlxspec.evaluation.evaluate_saved` (tests/test_hub.py)."""
    results = compare(model, reference_model, take_windows(tokenizer, text, windows,
                                                           window_tokens), progress=progress)
    return {"results": results, "verdict": gate(results, bits, thresholds),
            "reference": reference, "text": "builtin" if text is None else str(text),
            "window_tokens": window_tokens}
