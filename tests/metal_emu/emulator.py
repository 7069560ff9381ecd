"""Run mlxspec's Metal kernels on a CPU: "logic verified", never "Metal verified".

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
4. :func:`emulated` patches ``mlxspec.quant.kernels._launch`` so that the real loader code
   (dispatch, grid and threadgroup choice, reshapes, the dequantize + matmul path) runs end to end
   with emulated kernels.

:func:`syntax_check` compiles the same text with clang and real address spaces (device, constant,
threadgroup), which g++ erases.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
SHIM_FILES = ("metal_shim.h", "emu_driver.h")
FLAVORS = {
    "plain": ["-O1"],
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
    "asan": [
        "-O1",
        "-g",
        "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
    ],
}
# -w: g++ does not know Metal's attributes ([[kernel]], [[buffer(0)]], [[host_name(...)]]).
COMMON_FLAGS = ["-std=c++17", "-pthread", "-w", "-fno-omit-frame-pointer"]  # simd call paths
RUN_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0",
    "ASAN_OPTIONS": "detect_leaks=0",
    "UBSAN_OPTIONS": "print_stacktrace=1",
}
_ATTRIBUTES = (
    "dispatch_quadgroups_per_threadgroup dispatch_simdgroups_per_threadgroup "
    "dispatch_threads_per_threadgroup grid_origin grid_size quadgroup_index_in_threadgroup "
    "quadgroups_per_threadgroup simdgroup_index_in_threadgroup simdgroups_per_threadgroup "
    "thread_execution_width thread_index_in_quadgroup thread_index_in_simdgroup "
    "thread_index_in_threadgroup thread_position_in_grid thread_position_in_threadgroup "
    "threadgroup_position_in_grid threadgroups_per_grid threads_per_grid threads_per_simdgroup "
    "threads_per_threadgroup"
).split()
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


class EmulationError(RuntimeError):
    """The kernel failed to compile, or misbehaved when run (race, out of bounds, bad barrier)."""


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "mlxspec" / "metal-emu"
    return Path(os.environ.get("MLXSPEC_EMU_CACHE") or default)


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


def _driver(sig: Signature) -> str:
    """The main() appended after MLX's text: one kernel call per thread."""
    args = []
    for i, p in enumerate(sig.params):
        const = "const " if p.const else ""
        if p.role == "buffer":
            args.append(f"reinterpret_cast<{const}{p.ctype}*>(run.buffers[{i}])")
        elif p.role == "scalar":
            args.append(f"*reinterpret_cast<const {p.ctype}*>(run.buffers[{i}])")
        else:
            args.append(f"a.{p.name}")
    call = ",\n        ".join(args)
    return f"""
#line 1 "emulator-driver"
#undef device
#undef constant
#undef threadgroup
#undef thread
extern "C" {{ char emu_anchor[16] = {{0}}; }}
int main(int argc, char** argv) {{
  if (argc != 3) emu::fail("usage: kernel LAUNCH_FILE OUTPUT_FILE");
  emu::Run run(argv[1]);
  run.launch([&](const emu::Attrs& a) {{
    {sig.callee}(
        {call});
  }}, emu_anchor);
  run.write_outputs(argv[2]);
  return 0;
}}
"""


@functools.cache
def _compiler_id() -> str:
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    return version.split("\n")[0]


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _shim_text() -> str:
    return "".join((HERE / f).read_text() for f in SHIM_FILES)


def _atomic_write_dir(final: Path, fill) -> Path:
    """Create directory ``final`` via ``fill(tmpdir)`` and an atomic rename (parallel-safe)."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
    try:
        fill(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _precompiled_shim(flavor: str) -> Path:
    """Directory holding metal_shim.h and its precompiled header for ``flavor``."""
    flags = COMMON_FLAGS + FLAVORS[flavor]
    key = _digest(_shim_text(), " ".join(flags), _compiler_id())

    def fill(tmp: Path):
        for f in SHIM_FILES:
            shutil.copy(HERE / f, tmp / f)
        _compile(
            [
                *flags,
                "-x",
                "c++-header",
                str(tmp / "metal_shim.h"),
                "-o",
                str(tmp / "metal_shim.h.gch"),
            ],
            "metal_shim.h",
        )

    return _atomic_write_dir(cache_dir() / f"shim-{flavor}-{key}", fill)


def _compile(cmd: list[str], what: str) -> None:
    proc = subprocess.run(["g++", *cmd], capture_output=True, text=True)
    if proc.returncode:
        raise EmulationError(f"g++ failed on {what}:\n{proc.stderr[-4000:]}")


@dataclass(frozen=True)
class Binary:
    path: Path
    signature: Signature
    statics: tuple[tuple[int, int], ...]  # (offset from emu_anchor, bytes) of threadgroup memory


def build(source: str, flavor: str = "plain") -> Binary:
    """Compile MLX's generated ``source`` for the emulator (cached by content)."""
    sig = parse_signature(source)
    shim = _precompiled_shim(flavor)
    flags = COMMON_FLAGS + FLAVORS[flavor]
    text = f'#line 1 "{sig.function}.metal"\n{source}\n{_driver(sig)}'
    key = _digest(text, shim.name)

    def fill(tmp: Path):
        (tmp / "kernel.cpp").write_text(text)
        _compile(
            [
                *flags,
                "-Winvalid-pch",
                "-include",
                str(shim / "metal_shim.h"),
                str(tmp / "kernel.cpp"),
                "-o",
                str(tmp / "kernel"),
            ],
            sig.function,
        )

    out = _atomic_write_dir(cache_dir() / f"kernel-{flavor}-{key}", fill)
    return Binary(out / "kernel", sig, _threadgroup_statics(out / "kernel", sig.function))


def _threadgroup_statics(binary: Path, function: str) -> tuple[tuple[int, int], ...]:
    """Locate the kernel's `threadgroup` variables (function statics in the shim) with nm."""
    nm = subprocess.run(
        ["nm", "-C", "-S", "--defined-only", str(binary)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    anchor, found = None, []
    for line in nm.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 3 and parts[2].endswith("emu_anchor"):
            parts = [parts[0], "0", *parts[1:]]
        if len(parts) < 4:
            continue
        addr, size, _, name = parts
        if name == "emu_anchor":
            anchor = int(addr, 16)
        elif re.search(rf"\b{function}[<(].*\)::\w+$", name):
            found.append((int(addr, 16), int(size, 16)))
    if anchor is None:
        raise EmulationError("emu_anchor not found in the kernel binary")
    return tuple((addr - anchor, size) for addr, size in found)


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


# --------------------------------------------------------------------------------------------
# 4. Plug into the loader.


class Emulator:
    """Stands in for ``mlxspec.quant.kernels._launch``; records every launch it runs.

    ``edit(file_name, text) -> text`` alters a kernel file before use (the broken-kernel tests).
    """

    def __init__(self, flavor: str = "plain", edit=None):
        from mlxspec.quant import kernels

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


# --------------------------------------------------------------------------------------------
# Address spaces: clang -fsyntax-only with device/constant/threadgroup kept distinct.


def clang() -> str | None:
    return shutil.which("clang++") or shutil.which("clang")


def syntax_check(source: str) -> None:
    """Compile MLX's text with real address spaces; raise EmulationError on an error."""
    compiler = clang()
    if compiler is None:
        raise EmulationError("clang is not installed (apt-get install clang)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cpp")
        # Standard C++ allows no attributes in an explicit instantiation; Metal does.
        source = re.sub(
            r"^template \[\[host_name\(.*?\)\]\] \[\[kernel\]\] ", "template ", source, flags=re.M
        )
        path.write_text(f'#line 1 "{parse_signature(source).function}.metal"\n{source}\n')
        # aarch64: clang supports _Float16 there; freestanding: the shim needs no system header.
        cmd = [
            compiler,
            "--target=aarch64-linux-gnu",
            "-std=c++17",
            "-fsyntax-only",
            "-ffreestanding",
            "-nostdinc",
            "-DEMU_ADDRESS_SPACES",
            "-Wno-unknown-attributes",
            "-include",
            str(HERE / "metal_shim.h"),
            str(path),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise EmulationError(f"clang rejects the kernel:\n{proc.stderr[-4000:]}")
