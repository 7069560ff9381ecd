"""A fresh ``MLXSPEC_HOME`` for a subprocess that still finds the CPU ops and kernels this test
session built: ``cpu_ops/`` holds them keyed by their source, MLX's and nanobind's versions and
the flags, built under a lock, so sharing it changes no result and spares each subprocess
compiling them again (~30 s on a 2-core machine)."""

from __future__ import annotations

from pathlib import Path

from mlxspec import paths


def home_sharing_cpu_builds(home: Path) -> Path:
    """``home`` (created) with ``cpu_ops/`` linked to the session's own; returns ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    shared = paths.home() / "cpu_ops"
    shared.mkdir(parents=True, exist_ok=True)
    link = home / "cpu_ops"
    if not link.exists():
        link.symlink_to(shared, target_is_directory=True)
    return home
