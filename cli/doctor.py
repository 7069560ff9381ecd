"""`mlxspec doctor`: what mlxspec runs on — MLX backend, BLAS, kernels, default model."""

from __future__ import annotations

import json
import platform

import click


def system_report(measure: bool = True) -> dict:
    """Platform, MLX device, BLAS in use (with measured GFLOP/s) and the quantized-matmul path."""
    import mlx.core as mx

    from mlxspec import __version__, blas
    from mlxspec.load import default_model_path

    report = {
        "mlxspec": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "blas": blas.blas_report(measure=measure),
    }
    try:
        from mlxspec.quant import kernels, layers

        report["quantized_matmul"] = kernels.describe()
        report["zero_point_layers"] = layers.describe()
    except ImportError as e:
        report["quantized_matmul"] = f"unavailable ({e})"
    try:
        report["default_model"] = str(default_model_path())
    except Exception as e:  # reported, not raised: doctor diagnoses
        report["default_model"] = f"missing: {e}"
    return report


@click.command("doctor")
@click.option("--kernels", "check_kernels", is_flag=True,
              help="Run every Metal kernel against the MLX fallback and time it (Mac only).")
@click.option("--no-measure", is_flag=True, help="Skip the BLAS speed measurement.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def command(check_kernels, no_measure, as_json):
    """Report the MLX backend, which BLAS MLX uses (and its GFLOP/s) and the kernel path.

    \b
    Examples:
      mlxspec doctor
      mlxspec doctor --kernels     # on a Mac: checks and times the Metal kernels
    """
    report = system_report(measure=not no_measure)
    if check_kernels:
        from mlxspec.quant.kernel_check import check_on_device

        report["kernel_check"] = check_on_device()
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    for key, value in report.items():
        if isinstance(value, dict):
            click.echo(f"{key}:")
            for k, v in value.items():
                click.echo(f"  {k}: {v}")
        else:
            click.echo(f"{key}: {value}")
