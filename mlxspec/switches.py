"""The ``MLXSPEC_*`` environment switches that turn a speed-up off, read one way everywhere.

Standard library only: :mod:`mlxspec.cpu.allocator` reads its switch before MLX may be imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF = ("0", "off", "false", "no")


def turned_off(variable: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment variable ``variable`` is set to 0/off/false/no (any case), in
    ``environ`` (default: this process's)."""
    return (os.environ if environ is None else environ).get(variable, "").strip().lower() in OFF
