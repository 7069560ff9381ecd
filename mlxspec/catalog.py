"""What models are on this machine: the default, converted GGUFs, Hub downloads, recipes."""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

from mlxspec import paths
from mlxspec.errors import DefaultModelMissingError
from mlxspec.load import DEFAULT_MODEL_NAME, default_model_path


def recipes() -> dict[str, dict[str, Any]]:
    """The JSON recipes shipped in ``models/`` (installed as ``mlxspec.recipes``), by file stem."""
    out = {}
    for entry in files("mlxspec.recipes").iterdir():
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = json.loads(entry.read_text())
    return out


def known_pairs() -> list[dict[str, Any]]:
    """Known target/draft pairs (Hub ids) from the ``pairs`` recipe."""
    return recipes().get("pairs", {}).get("pairs", [])


def list_models() -> list[dict[str, str]]:
    """Rows of ``{kind, name, detail}`` for ``mlxspec models``."""
    rows = []
    try:
        rows.append({"kind": "default", "name": DEFAULT_MODEL_NAME,
                     "detail": str(default_model_path())})
    except DefaultModelMissingError as e:
        rows.append({"kind": "default", "name": DEFAULT_MODEL_NAME, "detail": str(e)})
    gguf_dir = paths.home() / "gguf"
    if gguf_dir.is_dir():
        for d in sorted(gguf_dir.iterdir()):
            if (d / "config.json").is_file():
                source = d / "source.txt"
                detail = source.read_text().strip() if source.is_file() else ""
                rows.append({"kind": "converted", "name": str(d), "detail": detail})
    try:
        from huggingface_hub import scan_cache_dir

        for repo in sorted(scan_cache_dir().repos, key=lambda r: r.repo_id):
            if repo.repo_type == "model":
                rows.append({"kind": "hub", "name": repo.repo_id,
                             "detail": f"{repo.size_on_disk / 1e6:.0f} MB"})
    except Exception:  # no HF cache yet, or an unreadable one: nothing to list
        pass
    for pair in known_pairs():
        rows.append({"kind": "recipe", "name": f"{pair['target']} + draft {pair['draft']}",
                     "detail": pair["family"]})
    return rows
