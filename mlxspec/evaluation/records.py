"""The evaluation record stored beside a quantized model (``mlxspec_eval.json``) and the source
model a quantized model's config records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxspec.errors import EvaluationError
from mlxspec.quant.storage import quantization_record

EVAL_FILE = "mlxspec_eval.json"  # evaluation results stored beside a quantized model
SOURCE_KEY = "source_model"  # config.json["quantization"][SOURCE_KEY]: what it was quantized from


def save_results(model_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` (results, verdict, settings) to ``model_dir/mlxspec_eval.json``."""
    path = Path(model_dir) / EVAL_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_results(model_dir: str | Path) -> dict[str, Any] | None:
    """The stored evaluation record of a model directory, or None when it has none."""
    path = Path(model_dir) / EVAL_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EvaluationError(f"{path} is not valid JSON ({e}): re-run `mlxspec eval`") from e


def source_model(config: dict[str, Any]) -> str | None:
    """What a quantized model was quantized from (``config["quantization"]["source_model"]``)."""
    return (quantization_record(config) or {}).get(SOURCE_KEY)
