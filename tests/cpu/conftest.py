"""Every test here checks the Linux CPU backend (``mlxspec.cpu``: BLAS shim, JIT flags, fused and
compiled ops, huge pages, mimalloc), which mlxspec uses on Linux only: on a Mac they skip."""

from __future__ import annotations

import platform
import shutil

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


@pytest.fixture
def primitives_in_place():
    """mlxspec.cpu.ops' primitives and fused_ops' compiled RoPE/RMSNorm in place for a test, as
    they were after (tests/cpu/test_cpu_rope.py, test_cpu_norm.py)."""
    from mlxspec.cpu import fused_ops, ops

    if shutil.which("g++") is None:
        pytest.skip("no g++: the primitives cannot be built here, MLX's own ops run instead")
    was = ops.enabled(), fused_ops.enabled()
    assert ops.enable() and fused_ops.enable()
    yield
    if not was[0]:
        ops.disable()
    if not was[1]:
        fused_ops.disable()

