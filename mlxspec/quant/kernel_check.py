"""Diagnostics of the zero-point kernels, for ``mlxspec doctor --kernels`` and ``bench/kernels.py``:
every kernel, and the dispatch of :func:`mlxspec.quant.kernels.metal_matmul`, against a float32
reference that shares no code with them (the layer dequantized by MLX ops, then a dense matmul);
each case caught on its own, so a Metal compile error is a report line, not a traceback, and the
timing (:mod:`mlxspec.quant.kernel_timing`) skips a kernel that failed.

Runs on a Mac (Metal), or anywhere under ``MLXSPEC_KERNELS=emulate`` with a smaller grid and
without the large real shapes (the report says so in every line)."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from mlxspec.errors import MlxspecError
from mlxspec.quant import kernel_timing, kernels, zp_format
from mlxspec.quant.kernel_timing import TOLERANCE, first_line, random_words, relative_error
from mlxspec.quant.kernels import (
    EMULATED,
    emulating,
    metal_dequantize,
    metal_matmul,
    metal_qmm,
    metal_qmv,
    qmm_choice_path,
)

# (activation dtype, scale dtype): a model's scales are in its dtype; float32 is the default
# model's (and every GGUF import's) dtype.
DTYPES = [(mx.float16, mx.float16), (mx.bfloat16, mx.bfloat16), (mx.float32, mx.float32),
          (mx.float32, mx.float16)]
DISPATCH_ROWS = (1, 3, 16, 33)  # through metal_matmul: decode, verification, prefill
QMM_ROWS = (3, 8, 16)  # zp_qmm at each row capacity (BM = 4, 8, 16)
# (name, N, K): layers of real models where the kernels' indexing and reductions are stressed:
# vocabulary-sized heads (the largest N) and the largest MLP inputs (K up to 14336).
REAL_SHAPES = [
    ("SmolLM2-135M head", 49152, 576),
    ("Qwen2.5-0.5B head", 151936, 896),
    ("Llama-2-7B mlp down", 4096, 11008),
    ("Llama-3-8B mlp down", 4096, 14336),
]
REAL_ROWS = (1, 5, 16)
REFERENCE_CHUNK = 8192  # output rows dequantized at a time for a real shape's reference
# What doctor --kernels times (and saves as the per-shape choice) on a Mac.
TIMING = {"n": 4096, "k": 4096, "bits": (4, 8), "group_sizes": (32, 64, 128),
          "rows": kernels.MEASURED_ROWS}
EMULATED_GRID = {"bits": (4, 8), "group_sizes": (64,),
                 "dtypes": [(mx.float16, mx.float16), (mx.float32, mx.float32)],
                 "qmm_rows": (3, 16)}


def check_on_device(seed: int = 0, timing: bool = True, *, bits=None, group_sizes=None,
                    dtypes=None, qmm_rows=None, real_shapes: bool | None = None) -> dict:
    """Run every kernel against the float32 reference (``mlxspec doctor --kernels``).

    Returns ``{"ok", "emulated", "cases", "timing", ...}``: one case per (path, bits, group
    size, dtypes) with the largest error relative to the output's magnitude; ``path`` names what
    really ran (a forced kernel, or ``matmul M=m -> <route>``). With ``timing`` the kernels are
    timed against ``mx.quantized_matmul`` at every row count :func:`kernels.route` chooses for
    (:func:`kernel_timing.measure_choice`, saved where the kernel ran and agreed), each timed row
    compared too; a kernel that failed a case is not timed.

    Defaults: every supported bits and group size, :data:`DTYPES`, :data:`QMM_ROWS`, the
    :data:`REAL_SHAPES`; emulated, :data:`EMULATED_GRID`, no real shapes and timing on a small
    layer (CPU times, not saved). Raises MlxspecError where the Metal path cannot run.
    """
    emulated = emulating()
    if not (mx.metal.is_available() or emulated):
        raise MlxspecError("the kernel check needs Metal: run it on a Mac with Apple silicon "
                           "(or MLXSPEC_KERNELS=emulate to emulate the kernels on a CPU)")
    grid = EMULATED_GRID if emulated else {}
    bits = bits or grid.get("bits", zp_format.SUPPORTED_BITS)
    group_sizes = group_sizes or grid.get("group_sizes", zp_format.SUPPORTED_GROUP_SIZES)
    dtypes = dtypes or grid.get("dtypes", DTYPES)
    qmm_rows = qmm_rows or grid.get("qmm_rows", QMM_ROWS)
    real_shapes = (not emulated) if real_shapes is None else real_shapes
    rng = np.random.default_rng(seed)
    cases = []
    for b in bits:
        for g in group_sizes:
            n, k = 300, 9 * g  # neither a multiple of the row tiles nor of the K steps
            layer = _random_layer(rng, n, k, b, g)
            dense = zp_format.dequantize(*layer, b, g, dtype=mx.float32)
            cases.append(_caught("zp_dequantize", b, g, mx.float32, mx.float16, dense,
                                 metal_dequantize, *layer, bits=b, group_size=g,
                                 dtype=mx.float32))
            for dtype, scale_dtype in dtypes:
                cases += _matmul_cases(rng, layer, b, g, dtype, scale_dtype, DISPATCH_ROWS,
                                       qmm_rows, dense)
    report = {"ok": True, "device": kernels.device_name(), "mlx": mx.__version__,
              "emulated": EMULATED if emulated else None, "cases": cases}
    if real_shapes:
        for name, n, k in REAL_SHAPES:
            for b in (4, 8):
                layer = _random_words_layer(n, k, b, 64)
                for case in _matmul_cases(rng, layer, b, 64, mx.float16, mx.float16, REAL_ROWS,
                                          REAL_ROWS[1:], None):
                    cases.append({**case, "shape": f"{name} {n}x{k}"})
    else:
        report["real_shapes"] = (f"skipped ({EMULATED}; too slow): " + ", ".join(
            f"{name} {n}x{k}" for name, n, k in REAL_SHAPES))
    report["ok"] = all(c["ok"] for c in cases)
    if timing:
        report.update(_timing(cases, emulated))
    return report


def _timing(cases: list[dict], emulated: bool) -> dict:
    """The timing part of the report; kernels that failed a case are skipped, with the reason."""
    skip = {}
    for c in cases:
        for kernel in c.get("kernels", []):
            if not c["ok"] and kernel not in skip:
                skip[kernel] = f"{kernel} failed its check ({c['path']} {c['bits']}-bit g" \
                               f"{c['group_size']} {c['dtype']})"
    if emulated:  # the code path only: a small layer, CPU times, nothing saved
        rows = kernel_timing.measure_choice(64, 256, bits=(4,), group_sizes=(64,), rows=(1, 4),
                                            iters=1, skip=skip, working_set_mb=0)
        return {"timing": rows, "timing_note": f"times {EMULATED}; not saved"}
    out = {"timing": kernel_timing.measure_choice(**TIMING, skip=skip),
           "qmm_choice_saved": str(qmm_choice_path())}
    if "zp_qmv" not in skip:
        # float32 scales (float32 models) read 2 more bytes per group than float16: what
        # converting them at load would save, measured (these rows are not part of the choice).
        for scale_dtype in (mx.float32, mx.float16):
            try:
                out["timing"].append(kernel_timing.benchmark_matmul(
                    4096, 4096, bits=4, group_size=64, rows=1, dtype=mx.float32,
                    scale_dtype=scale_dtype, iters=10))
            except Exception as e:  # noqa: BLE001  (a report line)
                out["timing"].append({"n": 4096, "k": 4096, "bits": 4, "group_size": 64,
                                      "rows": 1, "path": "zp_qmv", "error": first_line(e)})
    try:
        out["gpu_copy_gbps"] = kernel_timing.gpu_copy_bandwidth()
    except Exception as e:  # noqa: BLE001  (a report line)
        out["gpu_copy_error"] = first_line(e)
    return out


def _matmul_cases(rng, layer, bits: int, group_size: int, dtype, scale_dtype, dispatch_rows,
                  qmm_rows, dense) -> list[dict]:
    """The forced kernels (zp_qmv at 1 row, zp_qmm at ``qmm_rows``) and the dispatch at
    ``dispatch_rows`` for one layer; ``dense``: its float32 weight (None: built in chunks)."""
    weight, scales, zeros = layer
    layer = (weight, scales.astype(scale_dtype), zeros)
    cases = []
    for m in sorted({1, *qmm_rows, *dispatch_rows}):
        x = mx.array(rng.standard_normal((m, weight.shape[1] * 32 // bits)).astype(np.float32))
        x = x.astype(dtype)
        want = _reference(x, layer, bits, group_size, dense)
        if m == 1:
            cases.append(_caught("zp_qmv M=1", bits, group_size, dtype, scale_dtype, want,
                                 metal_qmv, x, *layer, bits=bits, group_size=group_size))
        if m in qmm_rows:
            cases.append(_caught(f"zp_qmm M={m}", bits, group_size, dtype, scale_dtype, want,
                                 metal_qmm, x, *layer, bits=bits, group_size=group_size))
        if m in dispatch_rows:
            cases.append(_caught(f"matmul M={m}", bits, group_size, dtype, scale_dtype, want,
                                 metal_matmul, x, *layer, bits=bits, group_size=group_size))
    return cases


def _reference(x: mx.array, layer, bits: int, group_size: int, dense) -> mx.array:
    """``x @ W.T`` in float32 from the layer dequantized by MLX ops (in chunks of output rows
    where ``dense`` is None, so a vocabulary-sized head needs no full float32 copy)."""
    x32 = x.astype(mx.float32)
    if dense is not None:
        return x32 @ dense.T
    weight, scales, zeros = layer
    parts = []
    for start in range(0, weight.shape[0], REFERENCE_CHUNK):
        rows = slice(start, start + REFERENCE_CHUNK)
        w = zp_format.dequantize(weight[rows], scales[rows], zeros[rows], bits, group_size,
                                 dtype=mx.float32)
        parts.append(x32 @ w.T)
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=-1)


@contextlib.contextmanager
def _recording_launches():
    """The names of the kernels launched within the block (what a case really ran)."""
    launched: list[str] = []
    saved = kernels._launch

    def record(name, **launch):
        launched.append(name)
        return saved(name, **launch)

    kernels._launch = record
    try:
        yield launched
    finally:
        kernels._launch = saved


def _caught(path: str, bits: int, group_size: int, dtype, scale_dtype, want: mx.array, fn, /,
            *args, **kwargs) -> dict:
    """One case; a failure (e.g. a Metal compile error) becomes a case with ``ok: False`` and
    its one-line ``error``. ``path`` gains the route a dispatch case took."""
    case = {"path": path, "bits": bits, "group_size": group_size,
            "dtype": str(dtype).split(".")[-1], "scale_dtype": str(scale_dtype).split(".")[-1]}
    with _recording_launches() as launched:
        try:
            got = fn(*args, **kwargs)
            mx.eval(got)
        except Exception as e:  # noqa: BLE001  (reported, not raised: the other cases still run)
            return {**case, "kernels": sorted(set(launched)) or [path.split()[0]], "ok": False,
                    "error": first_line(e)}
    if path.startswith("matmul"):
        case["path"] = f"{path} -> {launched[0] if launched else 'mx.quantized_matmul'}"
    err = relative_error(got, want)
    return {**case, "kernels": sorted(set(launched)), "max_rel_error": err,
            "ok": bool(err <= TOLERANCE[dtype])}


def _random_layer(rng: np.random.Generator, n: int, k: int, bits: int, group_size: int):
    """A random zero-point layer (uint32 weight, float16 scales, uint32 zeros) as mx arrays."""
    q = rng.integers(0, 2**bits, (n, k))
    z = rng.integers(0, 2**bits, (n, k // group_size))
    s = (rng.random((n, k // group_size)) * 0.02 + 0.001).astype(np.float16)
    return mx.array(zp_format.pack(q, bits)), mx.array(s), mx.array(zp_format.pack(z, bits))


def _random_words_layer(n: int, k: int, bits: int, group_size: int):
    """A random zero-point layer built on the device (a vocabulary head is too large for numpy)."""
    groups = k // group_size
    scales = (mx.random.uniform(shape=(n, groups)) * 0.02 + 1e-3).astype(mx.float16)
    layer = (random_words((n, k * bits // 32)), scales,
             random_words((n, zp_format.packed_cols(groups, bits))))
    mx.eval(layer)
    return layer
