"""The ``MLXSPEC_*`` environment switches that turn a speed-up off, read one way everywhere.

Standard library only: :mod:`mlxspec.allocator` reads its switch before MLX may be imported.
"""

from __future__ import annotations

import os

OFF = ("0", "off", "false", "no")


def turned_off(variable: str) -> bool:
    """Whether the environment variable ``variable`` is set to 0/off/false/no (any case)."""
    return os.environ.get(variable, "").strip().lower() in OFF
