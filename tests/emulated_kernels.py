"""Step 4 of the Metal emulator, for the tests: ``mlxspec.quant.kernels._launch`` patched so that
the real loader code (dispatch, grid and threadgroup choice, reshapes) runs end to end with
emulated kernels, in any sanitizer flavor, optionally on deliberately edited kernel text."""

from __future__ import annotations

import contextlib

import mlx.core as mx

from mlxspec.metal.emulator import Binary, build, cached_source, generated_source, run
from mlxspec.quant import kernels


class Emulator:
    """Stands in for ``mlxspec.quant.kernels._launch``; records every launch it runs.

    ``edit(file_name, text) -> text`` alters a kernel file before use (the broken-kernel tests).
    """

    def __init__(self, flavor: str = "plain", edit=None):
        self.kernels, self.flavor, self.edit = kernels, flavor, edit
        self.launches: list[tuple[str, dict, Binary]] = []

    def kernel(self, name: str):
        k = self.kernels
        if self.edit is None:
            return k._kernel(name)
        text = self.edit(f"{name}.metal", k._source(f"{name}.metal"))
        header = self.edit("zp_common.h", k._source("zp_common.h"))
        return k.make_kernel(name, text, header)

    def source(self, name: str, launch: dict) -> str:
        if self.edit is None:
            return cached_source(self.kernel(name), launch)
        return generated_source(self.kernel(name), launch)

    def __call__(self, name: str, **launch) -> list[mx.array]:
        binary = build(self.source(name, launch), self.flavor)
        self.launches.append((name, launch, binary))
        return run(binary, launch)


@contextlib.contextmanager
def emulated(flavor: str = "plain", edit=None):
    """Within the block, mlxspec.quant.kernels runs its Metal launches in the emulator."""
    emulator = Emulator(flavor, edit)
    saved = emulator.kernels._launch
    emulator.kernels._launch = emulator
    try:
        yield emulator
    finally:
        emulator.kernels._launch = saved
