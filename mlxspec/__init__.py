"""mlxspec: fast local LLM inference on MLX.

Two levers on the memory-bandwidth wall of decoding, stacked: zero-point weight quantization
(de-quantized on the fly by custom Metal kernels) and lossless speculative decoding.

``import mlxspec`` is cheap (~milliseconds): the public names below are imported on first
access (PEP 562), so ``mlxspec --help`` or ``from mlxspec import errors`` never load mlx-lm or
transformers.

The one thing done eagerly is the CPU backend's start (:func:`mlxspec.cpu.start`, Linux): MLX binds its BLAS
when ``mlx.core`` is first imported, so the set-up must come before. Python initialises a
package before any of its modules, so every ``mlxspec.*`` module that imports mlx gets the
optimized BLAS without caring about import order; only a script that imports ``mlx.core``
before any mlxspec module keeps MLX's reference BLAS (with one warning saying so).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

from mlxspec import cpu as _cpu

_cpu.start()  # Linux: the command starts over once on mimalloc; MLX's BLAS bound to OpenBLAS

# The version, written once: pyproject.toml reads it from here (tool.setuptools.dynamic).
__version__ = "0.1.0"

# Public name -> the module defining it, imported on first access.
_LAZY = {
    "MlxspecError": "mlxspec.errors",
    "load": "mlxspec.load",
    "generate": "mlxspec.generate",
    "stream_generate": "mlxspec.generate",
    "quantize_to_dir": "mlxspec.publish.quantize_flow",
    "QuantizeReport": "mlxspec.publish.quantize_flow",
    "evaluate": "mlxspec.evaluation",
    "system_report": "mlxspec.system",
    "batch_generate": "mlxspec.serving.batch",
}

__all__ = [
    "MlxspecError", "QuantizeReport", "__version__", "batch_generate", "evaluate", "generate", "load",
    "quantize_to_dir", "stream_generate", "system_report",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports these
    from mlxspec.errors import MlxspecError
    from mlxspec.evaluation import evaluate
    from mlxspec.generate import generate, stream_generate
    from mlxspec.load import load
    from mlxspec.publish.quantize_flow import QuantizeReport, quantize_to_dir
    from mlxspec.serving.batch import batch_generate
    from mlxspec.system import system_report


class _Package(types.ModuleType):
    """``mlxspec.load`` and ``mlxspec.generate`` name both submodules and the public functions
    they define. The import system binds a submodule to its package's attribute when it first
    loads it; here the functions keep those names, as when they were imported eagerly (the
    submodules stay reachable in ``sys.modules``)."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mlxspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
