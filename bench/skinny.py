"""The BLAS shim's skinny products at two revisions of its source, side by side.

    python bench/skinny.py [--base REV] [--rows 1,4,8,12,16,21,24] [--rounds 11] [--json]

Builds ``mlxspec/cpu/_blas_shim.c`` as it is and as it was at ``--base`` (``git show``), loads both
with ctypes and times SmolLM2-135M's 211 float32 products per token (30 layers of q, k, v, o,
gate, up and down, and the 49,152 x 576 output head; distinct random weights, 537 MB, so every
product streams its weights from memory; weights and inputs placed as MLX places them, past a
cache line) through each build's ``cblas_sgemm``, in alternating order each round; medians per
build and row count, and the ratio. The two builds' outputs are checked against each other
(bitwise: the kernels' sums must not depend on their blocking).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "mlxspec/cpu/_blas_shim.c"
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
          (576, 1536)] * 30 + [(49152, 576)]


def build(source: str, directory: Path, name: str) -> ctypes.CDLL:
    path, library = directory / f"{name}.c", directory / f"{name}.so"
    path.write_text(source)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-pthread", "-o", str(library), str(path),
                    "-ldl"], check=True)
    lib = ctypes.CDLL(str(library))
    lib.mlxspec_blas_set_isa(None)
    lib.mlxspec_blas_set_threads(int(os.environ.get("OPENBLAS_NUM_THREADS", "2")))
    lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    return lib


def placed(values: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``values`` whose data starts ``offset`` bytes past a 64-byte line, where MLX's
    CPU allocator puts its arrays (8 bytes past malloc's pointer: 24 past a line for a weight,
    40 or 56 for an activation), so that the kernels' loads split across lines as in MLX."""
    raw = np.empty(values.size + 32, np.float32)
    start = (-raw.ctypes.data % 64) // 4 + offset // 4
    out = raw[start : start + values.size].reshape(values.shape)
    out[...] = values
    return out


@click.command()
@click.option("--base", default="HEAD", show_default=True, help="git revision to compare with")
@click.option("--rows", default="1,4,8,12,16,21,24", show_default=True)
@click.option("--rounds", default=11, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(base: str, rows: str, rounds: int, as_json: bool) -> None:
    old = subprocess.run(["git", "show", f"{base}:{SOURCE}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    new = (ROOT / SOURCE).read_text()
    row_counts = [int(r) for r in rows.split(",")]
    rng = np.random.default_rng(0)
    weights = [placed(rng.standard_normal(s, dtype=np.float32), 24) for s in SHAPES]
    inputs = {m: {k: placed(rng.standard_normal((m, k), dtype=np.float32), 40) for k in (576, 1536)}
              for m in row_counts}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(old, Path(tmp), "base"), "current": build(new, Path(tmp), "current")}
        outputs = {(name, m): [np.empty((m, n), np.float32) for n, _ in SHAPES]
                   for name in libs for m in row_counts}

        def run(name: str, m: int) -> float:
            sgemm, outs = libs[name].cblas_sgemm, outputs[name, m]
            tic = time.perf_counter()
            for w, out in zip(weights, outs, strict=True):
                n, k = w.shape
                x = inputs[m][k]
                sgemm(101, 111, 112, m, n, k, 1.0, x.ctypes.data, k, w.ctypes.data, k, 0.0,
                      out.ctypes.data, n)
            return time.perf_counter() - tic

        times = {(name, m): [] for name in libs for m in row_counts}
        for r in range(rounds):
            for m in row_counts:
                for name in (("base", "current") if r % 2 == 0 else ("current", "base")):
                    times[name, m].append(run(name, m))
        same = all(np.array_equal(a, b) for m in row_counts
                   for a, b in zip(outputs["base", m], outputs["current", m], strict=True))
    gigabytes = sum(w.size for w in weights) * 4 / 1e9
    result = {"base": base, "rounds": rounds, "weights_gb": round(gigabytes, 3),
              "threads": int(os.environ.get("OPENBLAS_NUM_THREADS", "2")),
              "loadavg": Path("/proc/loadavg").read_text().split()[:3], "bitwise_same": same,
              "rows": []}
    for m in row_counts:
        b, c = (statistics.median(times[name, m]) * 1e3 for name in ("base", "current"))
        result["rows"].append({"rows": m, "base_ms": round(b, 2), "current_ms": round(c, 2),
                               "current_vs_base": round(c / b, 3),
                               "current_gb_per_s": round(gigabytes / c * 1e3, 1)})
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for row in result["rows"]:
            print(f"{row['rows']:3d} rows: base {row['base_ms']:6.1f} ms, current "
                  f"{row['current_ms']:6.1f} ms ({row['current_vs_base']:.3f}x)")
        print(f"bitwise the same: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
