"""Step 3 of the emulator: a launch run grid-wide on the CPU (each threadgroup's threads as OS
threads), with the Apple GPU's launch limits checked first."""

from __future__ import annotations

import os
import platform
import struct
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.metal.emulator.build import Binary, build
from mlxspec.metal.emulator.source import EmulationError, cached_source, unavailable

RUN_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0",
    "ASAN_OPTIONS": "detect_leaks=0",
    "UBSAN_OPTIONS": "print_stacktrace=1",
}

_SCALAR_FORMATS = {"int32_t": "<i", "float": "<f", "bool": "<?"}
_NUMPY_TYPES = {
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # raw bits
    mx.float32: np.float32,
    mx.uint32: np.uint32,
    mx.int32: np.int32,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
}


# --------------------------------------------------------------------------------------------
# 3. Run.


def _raw(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _execute(command: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **RUN_ENV}
        )
    except subprocess.TimeoutExpired as e:
        raise EmulationError(f"{what} did not finish in {timeout} s") from e


# Apple GPU limits a real launch fails on (MTLDevice maxThreadsPerThreadgroup and
# maxThreadgroupMemoryLength on every Apple-silicon GPU).
MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024


def check_limits(binary: Binary, launch: dict) -> None:
    """Raise EmulationError where a Mac would refuse the launch: too many threads in a
    threadgroup, or more threadgroup memory than the GPU has."""
    threads = int(np.prod(launch["threadgroup"]))
    if threads > MAX_THREADS_PER_THREADGROUP:
        raise EmulationError(f"{binary.signature.function}: threadgroup of {threads} threads "
                             f"exceeds the limit of {MAX_THREADS_PER_THREADGROUP}")
    memory = sum(size for _, size in binary.statics)
    if memory > MAX_THREADGROUP_MEMORY:
        raise EmulationError(f"{binary.signature.function}: {memory} bytes of threadgroup memory "
                             f"exceed the limit of {MAX_THREADGROUP_MEMORY}")


def run(binary: Binary, launch: dict, timeout: float = 300) -> list[mx.array]:
    """Run ``binary`` with the arguments of a metal_kernel call; return its outputs."""
    check_limits(binary, launch)
    inputs, shapes, dtypes = launch["inputs"], launch["output_shapes"], launch["output_dtypes"]
    buffers = [p for p in binary.signature.params if p.role != "attribute"]
    if len(buffers) != len(inputs) + len(shapes):
        raise EmulationError("signature does not match the launch's inputs and outputs")
    blob = [
        b"MEMU",
        struct.pack("<6I", *launch["grid"], *launch["threadgroup"]),
        struct.pack("<I", len(buffers)),
    ]
    for param, value in zip(buffers, inputs, strict=False):
        if param.role == "scalar":
            data = struct.pack(_SCALAR_FORMATS[param.ctype], value)
        else:
            data = _raw(value)
        blob += [struct.pack("<IQ", 0, len(data)), data]
    for shape, dtype in zip(shapes, dtypes, strict=True):
        blob.append(struct.pack("<IQ", 1, int(np.prod(shape)) * dtype.size))
    blob.append(struct.pack("<I", len(binary.statics)))
    blob += [struct.pack("<qQ", off, size) for off, size in binary.statics]
    with tempfile.TemporaryDirectory() as tmp:
        launch_file, out_file = Path(tmp, "launch"), Path(tmp, "out")
        launch_file.write_bytes(b"".join(blob))
        command = [str(binary.path), str(launch_file), str(out_file)]
        proc = _execute(command, timeout, binary.signature.function)
        if "ThreadSanitizer: unexpected memory mapping" in proc.stderr:
            # Old TSan runtimes cannot map their shadow under high mmap randomisation.
            proc = _execute(
                ["setarch", platform.machine(), "-R", *command], timeout, binary.signature.function
            )
        if proc.returncode:
            raise EmulationError(
                f"{binary.signature.function} failed (exit {proc.returncode}):\n"
                + proc.stderr[-6000:]
            )
        raw = out_file.read_bytes()
    outputs, offset = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        n = int(np.prod(shape))
        values = np.frombuffer(raw, _NUMPY_TYPES[dtype], n, offset).reshape(shape)
        offset += n * dtype.size
        out = mx.array(values)
        outputs.append(out.view(mx.bfloat16) if dtype == mx.bfloat16 else out)
    return outputs


def launch(kernel, **kwargs) -> list[mx.array]:
    """``kernel(**kwargs)`` (an ``mx.fast.metal_kernel`` and the arguments of its call) run in
    the emulator: the ``MLXSPEC_KERNELS=emulate`` path. Inputs are evaluated first (the
    emulator needs their bytes), so the call is synchronous and cannot be traced by
    ``mx.compile``."""
    reason = unavailable()
    if reason:
        raise EmulationError(reason)
    return run(build(cached_source(kernel, kwargs), "plain"), kwargs)
