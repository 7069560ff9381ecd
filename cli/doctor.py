"""`mlxspec doctor`: what mlxspec runs on — MLX backend, BLAS, kernels, default model.

A thin shell over :func:`mlxspec.system.system_report`.
"""

from __future__ import annotations

import click


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
    from mlxspec.cli import render
    from mlxspec.system import system_report

    report = system_report(measure=not no_measure, check_kernels=check_kernels)
    click.echo(render.as_json(report) if as_json else render.report_lines(report))
