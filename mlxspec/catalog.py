"""What models are on this machine: the default, converted GGUFs, Hub downloads, recipes."""

from __future__ import annotations

import json
import os
from importlib.resources import files
from pathlib import Path
from typing import Any

from mlxspec import paths
from mlxspec.errors import DefaultModelMissingError
from mlxspec.load import DEFAULT_MODEL_NAME, default_model_path


def known_pairs() -> list[dict[str, Any]]:
    """Known target/draft pairs (Hub ids): ``models/draft_pairs.json``, installed as
    ``mlxspec.recipes``."""
    return json.loads((files("mlxspec.recipes") / "draft_pairs.json").read_text()).get("pairs", [])


def _printable(text: str) -> str:
    """``text`` safe to print: undecodable bytes (from a non-UTF-8 file or file name) as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def cache_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (symlinks not followed); 0 when it does not exist."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                stat = os.lstat(os.path.join(dirpath, name))
            except OSError:  # removed meanwhile
                continue
            total += stat.st_size
    return total


def list_models() -> list[dict[str, str]]:
    """Rows of ``{kind, name, detail}`` for ``mlxspec models``: mlxspec's cache and its size, the
    default model, converted GGUFs, Hub downloads and recipes. Stale conversion work directories
    (their process is gone) are deleted on the way."""
    from mlxspec.gguf.checks import clean_stale_work_dirs

    home = paths.home()
    gguf_dir = home / "gguf"
    try:
        clean_stale_work_dirs(gguf_dir)
    except OSError:  # an unreadable cache: listed below as far as possible
        pass
    rows = [{"kind": "cache", "name": _printable(str(home)),
             "detail": f"{cache_bytes(home) / 1e6:.1f} MB"}]
    try:
        rows.append({"kind": "default", "name": DEFAULT_MODEL_NAME,
                     "detail": str(default_model_path())})
    except DefaultModelMissingError as e:
        rows.append({"kind": "default", "name": DEFAULT_MODEL_NAME, "detail": str(e)})
    if gguf_dir.is_dir():
        for d in sorted(gguf_dir.iterdir()):
            if (d / "config.json").is_file():
                source = d / "source.txt"
                try:
                    detail = source.read_text(encoding="utf-8", errors="replace").strip()
                except OSError:
                    detail = ""
                rows.append({"kind": "converted", "name": _printable(str(d)),
                             "detail": _printable(detail)})
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
