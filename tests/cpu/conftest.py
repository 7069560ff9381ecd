"""Every test here checks the Linux CPU backend (``mlxspec.cpu``: BLAS shim, JIT flags, fused and
compiled ops, huge pages, mimalloc), which mlxspec uses on Linux only: on a Mac they skip."""

from __future__ import annotations

import platform

import pytest

_REASON = ("the Linux CPU backend (mlxspec.cpu) is not used on "
           f"{platform.system()}: Metal runs the model there")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if platform.system() == "Linux":
        return
    here = config.rootpath / "tests" / "cpu"
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.skip(reason=_REASON))
