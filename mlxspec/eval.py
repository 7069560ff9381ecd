"""Moved to :mod:`mlxspec.evaluation` (a module named ``eval`` shadows the built-in).

Kept only so that code not yet switched keeps importing; the lead deletes it at merge once
nothing imports ``mlxspec.eval``.
"""

from mlxspec.evaluation import *  # noqa: F403
from mlxspec.evaluation import __all__  # noqa: F401
