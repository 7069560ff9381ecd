"""``system_report()``: what mlxspec runs on — platform, MLX device, BLAS, kernel path, default
model. ``mlxspec doctor`` prints it; bug reports should include it."""

from __future__ import annotations

import platform
from typing import Any


def cpu_model() -> str:
    """The CPU's name, with its family and model where Linux reports them (cloud machines often
    name only the vendor, "AMD EPYC": the family tells a Zen 5 from a Zen 3): benchmark results
    record it, since the same code runs at different speeds on different machines."""
    from mlxspec.cpu_jit import cpuinfo

    fields = cpuinfo()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def system_report(measure: bool = True, check_kernels: bool = False) -> dict[str, Any]:
    """Platform, MLX device, BLAS in use (with measured GFLOP/s when ``measure``) and the
    quantized-matmul path; with ``check_kernels``, every Metal kernel checked against the MLX
    fallback and timed (Mac only).

    Never raises for a missing piece: a part that cannot be inspected is reported as such.
    """
    import mlx.core as mx

    from mlxspec import __version__, allocator, blas, cpu_jit, cpu_ops, fused_ops, huge_pages
    from mlxspec.load import default_model_path

    report: dict[str, Any] = {
        "mlxspec": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_model(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "blas": blas.blas_report(measure=measure),
        "fused_ops": fused_ops.describe(),
        "cpu_jit": cpu_jit.describe(),
        "cpu_ops": cpu_ops.describe(),
        "huge_pages": huge_pages.describe(),
        "allocator": allocator.describe(),
    }
    try:
        from mlxspec.quant import kernels, layers

        report["quantized_matmul"] = kernels.describe()
        report["zero_point_layers"] = layers.describe()
        from mlxspec import gguf_quant

        report["gguf_weights"] = gguf_quant.describe()
    except ImportError as e:
        report["quantized_matmul"] = f"unavailable ({e})"
    try:
        report["default_model"] = str(default_model_path())
    except Exception as e:  # reported, not raised: doctor diagnoses
        report["default_model"] = f"missing: {e}"
    if check_kernels:
        from mlxspec.quant.kernel_check import check_on_device

        report["kernel_check"] = check_on_device()
    return report
