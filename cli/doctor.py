"""`mlxspec doctor`: what mlxspec runs on — machine, MLX backend, BLAS, kernels, default model.

A thin shell over :func:`mlxspec.system.system_report`; with ``--kernels`` the report is also
written to one JSON file to attach to an issue.
"""

from __future__ import annotations

import click

REPORT_FILE = "mlxspec-doctor.json"


@click.command("doctor")
@click.option("--kernels", "check_kernels", is_flag=True,
              help="Check every Metal kernel against a float32 reference and time it (on a Mac; "
                   "MLXSPEC_KERNELS=emulate runs it emulated on a CPU, logic only).")
@click.option("--no-measure", is_flag=True, help="Skip the BLAS speed measurement.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help=f"Write the report as JSON here (default with --kernels: ./{REPORT_FILE}).")
def command(check_kernels, no_measure, as_json, output):
    """Report the machine, the MLX backend, which BLAS MLX uses (and its GFLOP/s) and the
    kernel path.

    \b
    Examples:
      mlxspec doctor
      mlxspec doctor --kernels     # on a Mac: checks and times the Metal kernels, writes
                                   # mlxspec-doctor.json to attach to an issue
    """
    from mlxspec.cli import render
    from mlxspec.system import system_report, write_report

    report = system_report(measure=not no_measure, check_kernels=check_kernels)
    click.echo(render.as_json(report) if as_json else render.report_lines(report))
    if output or check_kernels:
        path = write_report(report, output or REPORT_FILE)
        click.echo(f"report written to {path}: attach this file to your issue", err=as_json)
