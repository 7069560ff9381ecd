"""Step 1 of the emulator: the exact text MLX would hand to the Metal compiler for a
``mx.fast.metal_kernel`` call, and the kernel signature MLX wrote in it."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass

import mlx.core as mx

_ATTRIBUTES = (
    "dispatch_quadgroups_per_threadgroup dispatch_simdgroups_per_threadgroup "
    "dispatch_threads_per_threadgroup grid_origin grid_size quadgroup_index_in_threadgroup "
    "quadgroups_per_threadgroup simdgroup_index_in_threadgroup simdgroups_per_threadgroup "
    "thread_execution_width thread_index_in_quadgroup thread_index_in_simdgroup "
    "thread_index_in_threadgroup thread_position_in_grid thread_position_in_threadgroup "
    "threadgroup_position_in_grid threadgroups_per_grid threads_per_grid threads_per_simdgroup "
    "threads_per_threadgroup"
).split()


class EmulationError(RuntimeError):
    """The kernel failed to compile, or misbehaved when run (race, out of bounds, bad barrier)."""


def unavailable() -> str | None:
    """Why the emulator cannot run on this machine, or None if it can. It needs Linux (it finds
    threadgroup variables in the ELF symbol table with ``nm -S``, which Mach-O lacks) and g++."""
    if platform.system() != "Linux":
        return (f"the Metal emulator runs on Linux only (ELF symbol sizes), not on "
                f"{platform.system()}: on a Mac the real kernels run")
    if shutil.which("g++") is None or shutil.which("nm") is None:
        return "the Metal emulator needs g++ and nm (apt-get install g++ binutils)"
    return None


# --------------------------------------------------------------------------------------------
# 1. The exact source MLX generates.


@contextlib.contextmanager
def _capture_fd(fd: int):
    """Collect what C++ code writes to file descriptor ``fd`` (std::cout is not sys.stdout)."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(fd)
        os.dup2(sink.fileno(), fd)
        text: list[str] = []
        try:
            yield text
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode())


def generated_source(kernel, launch: dict) -> str:
    """The text MLX would compile for ``kernel(**launch)``, printed by a traced call."""
    inputs = launch["inputs"]
    arrays = [a for a in inputs if isinstance(a, mx.array)]
    rest = {k: v for k, v in launch.items() if k not in ("inputs", "verbose")}

    def traced(*traced_arrays):
        it = iter(traced_arrays)
        call_inputs = [next(it) if isinstance(a, mx.array) else a for a in inputs]
        return kernel(inputs=call_inputs, verbose=True, **rest)

    with tempfile.TemporaryDirectory() as tmp, _capture_fd(1) as printed:
        mx.export_function(os.path.join(tmp, "trace.mlxfn"), traced, *arrays)
    match = re.search(r"Generated source code for `\w+`:\n```\n(.*)\n```", printed[0], re.S)
    if not match:
        raise EmulationError(f"MLX printed no kernel source: {printed[0][:200]!r}")
    return match.group(1)


# --------------------------------------------------------------------------------------------
# 2. Parse the signature MLX wrote, build a binary.


@dataclass(frozen=True)
class Param:
    name: str
    role: str  # "buffer" (pointer), "scalar" (reference) or "attribute"
    ctype: str  # element type without address space, e.g. "float16_t"
    const: bool = True


@dataclass(frozen=True)
class Signature:
    function: str  # the kernel's host name
    callee: str  # expression naming the instantiated kernel
    params: tuple[Param, ...]


_BUFFER = re.compile(r"^\s*(const )?(device|constant) (.+?)([*&]) (\w+) \[\[buffer\(\d+\)\]\]")
_ATTRIBUTE = re.compile(r"^\s*(uint3|uint) (\w+) \[\[(\w+)\]\]")


def parse_signature(source: str) -> Signature:
    """Read MLX's generated signature (format of mlx/backend/common/metal_kernel.cpp)."""
    head = re.search(r"\[\[kernel\]\] void (\w+)\(\n(.*?)\) \{\n", source, re.S)
    if not head:
        raise EmulationError("no [[kernel]] function in the generated source")
    function, lines = head.group(1), head.group(2).split("\n")
    params = []
    for line in lines:
        if m := _BUFFER.match(line):
            const, _, ctype, ref, name = m.groups()
            if name.endswith(("_shape", "_strides", "_ndim")):
                raise EmulationError(f"{name}: shape/stride inputs are not emulated")
            role = "scalar" if ref == "&" else "buffer"
            params.append(Param(name, role, ctype.strip(), const=bool(const)))
        elif m := _ATTRIBUTE.match(line):
            if m.group(2) not in _ATTRIBUTES:
                raise EmulationError(f"unknown attribute {m.group(2)}")
            params.append(Param(m.group(2), "attribute", m.group(1)))
        else:
            raise EmulationError(f"unparsed signature line: {line!r}")
    inst = re.search(r"decltype\((" + function + r"<.*?>)\)", source)
    callee = inst.group(1) if inst else function
    return Signature(function, callee, tuple(params))


def _signature_key(launch: dict) -> tuple:
    """What MLX's generated text depends on: each input's dtype (scalars: their Python type) and
    whether it is small enough for the ``constant`` address space, the template, the output
    dtypes. Sizes (K, N, grid) only reach the text through those."""
    inputs = tuple(
        (a.dtype, a.size < 8) if isinstance(a, mx.array) else type(a) for a in launch["inputs"]
    )
    template = tuple((k, v) for k, v in launch.get("template", []))
    return inputs, template, tuple(launch["output_dtypes"])


_SOURCES: dict[tuple, tuple[object, str]] = {}  # (kernel id, signature) -> (kernel, text)


def cached_source(kernel, launch: dict) -> str:
    """:func:`generated_source`, traced once per kernel and signature (a model makes many
    launches that differ only in sizes)."""
    key = (id(kernel), _signature_key(launch))
    if key not in _SOURCES:
        _SOURCES[key] = (kernel, generated_source(kernel, launch))  # the kernel keeps its id
    return _SOURCES[key][1]
