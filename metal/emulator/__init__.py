"""Run mlxspec's Metal kernels on a CPU: "logic verified", never "Metal verified".

Two users: the test suite (every flavor below), and ``MLXSPEC_KERNELS=emulate``
(:func:`mlxspec.quant.kernels.backend`), which sends the product's own Metal launches here so
that a contributor without a Mac can run ``generate``, ``bench`` and ``doctor --kernels`` through
the Metal path on a CPU build of MLX (slow: one OS thread per GPU thread; logic only, never a
speed). Linux only (:func:`unavailable`); docs/metal-emulation.md.

How it works:

1. :func:`generated_source` traces the real ``mx.fast.metal_kernel`` call inside
   ``mx.export_function`` with ``verbose=True``; on the CPU build of MLX that prints the exact text
   MLX would hand to the Metal compiler (header, template line, generated signature, body,
   explicit instantiation). Nothing is re-implemented: the kernel text is MLX's.
2. :func:`build` compiles that text as C++17 with g++ after ``metal_shim.h`` (the stand-in for
   MLX's Metal prelude, precompiled once per flavor) plus a generated ``main`` that calls the
   instantiated kernel once per thread. Flavors: ``plain`` (-O1), ``tsan`` (ThreadSanitizer: races
   in threadgroup memory, i.e. missing barriers), ``asan`` (AddressSanitizer + UBSan: out-of-bounds
   reads and writes, oversized shifts). Binaries are cached by content hash under
   ``$MLXSPEC_EMU_CACHE`` (default ``~/.cache/mlxspec/metal-emu``).
3. :func:`run` writes the inputs to a launch file, runs the grid threadgroup by threadgroup (each
   threadgroup's threads as OS threads; threadgroup variables poisoned with NaN bytes; outputs
   pre-filled with NaN bytes) and reads the outputs back.
4. ``MLXSPEC_KERNELS=emulate`` makes ``mlxspec.quant.kernels`` send every launch to
   :func:`launch`, so the real loader code (dispatch, grid and threadgroup choice, reshapes)
   runs end to end with emulated kernels; the tests' harness does the same per test, in any
   flavor.

:func:`syntax_check` compiles the same text with clang and real address spaces (device, constant,
threadgroup), which g++ erases.

Modules: ``source`` (step 1), ``build`` (step 2 and the clang check), ``run`` (step 3 and
:func:`launch`, the ``MLXSPEC_KERNELS=emulate`` entry). Step 4 is the tests' harness
(``tests/emulated_kernels.py``), which patches ``mlxspec.quant.kernels._launch``.
"""

from mlxspec.metal.emulator.build import FLAVORS, Binary, build, cache_dir, clang, syntax_check
from mlxspec.metal.emulator.run import (
    MAX_THREADGROUP_MEMORY,
    MAX_THREADS_PER_THREADGROUP,
    check_limits,
    launch,
    run,
)
from mlxspec.metal.emulator.source import (
    EmulationError,
    cached_source,
    generated_source,
    parse_signature,
    unavailable,
)

__all__ = [
    "FLAVORS", "MAX_THREADGROUP_MEMORY", "MAX_THREADS_PER_THREADGROUP", "Binary",
    "EmulationError", "build", "cache_dir", "cached_source", "check_limits", "clang",
    "generated_source", "launch", "parse_signature", "run", "syntax_check", "unavailable",
]
