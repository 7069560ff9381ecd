"""Step 2 of the emulator: MLX's kernel text compiled as C++17 after the Metal shim (one
binary per text and flavor, cached by content hash), and the clang address-space check."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlxspec.metal.emulator.source import EmulationError, Signature, parse_signature

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


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "mlxspec" / "metal-emu"
    return Path(os.environ.get("MLXSPEC_EMU_CACHE") or default)


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
    """Compile MLX's generated ``source`` for the emulator (cached by content on disk, and in
    this process: a model launches the same few kernels many times)."""
    key = (source, flavor, str(cache_dir()))
    if key not in _BUILT:
        _BUILT[key] = _build(source, flavor)
    return _BUILT[key]


_BUILT: dict[tuple[str, str, str], Binary] = {}


def _build(source: str, flavor: str) -> Binary:
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
