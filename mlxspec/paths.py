"""Where mlxspec keeps its files."""

import os
from pathlib import Path


def home() -> Path:
    """mlxspec's cache directory: ``$MLXSPEC_HOME``, default ``~/.cache/mlxspec``."""
    return Path(os.environ.get("MLXSPEC_HOME") or Path.home() / ".cache" / "mlxspec")
