"""Zero-point Metal kernels on the GPU: correctness against a float32 reference, then speed against
``mx.quantized_matmul`` (MLX affine) at the same bits and group size, every timed row compared
with the fallback, with GB/s achieved and the fraction of the measured GPU copy bandwidth
(roofline).

    python bench/kernels.py [--quick] [--output FILE]

Prints JSON (and writes bench/results/kernels.json on a Mac). Needs Metal (a Mac with Apple
silicon); ``MLXSPEC_KERNELS=emulate`` runs it anywhere on one small shape, its kernels emulated
(CPU times: logic only, and said in the result). Elsewhere it exits with status 2 and one line.
Exit status 1 if any kernel disagrees with the reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from mlxspec.quant import kernel_check, kernel_timing, kernels

# (name, out_features N, in_features K): decode-time matmuls of common model sizes.
SHAPES = [
    ("smollm2-135m mlp up", 1536, 576),
    ("smollm2-135m head", 49152, 576),
    ("llama-7b attention", 4096, 4096),
    ("llama-7b mlp up", 11008, 4096),
    ("llama-7b mlp down", 4096, 11008),
    ("llama-3-8b mlp down", 4096, 14336),
]
EMULATED_SHAPES = [("tiny (emulated)", 64, 256)]
ROWS = (1, 4, 8, 16)
BITS = (4, 8)
RESULT = Path(__file__).parent / "results" / "kernels.json"


@click.command()
@click.option("--quick", is_flag=True, help="One shape, 4 bits only.")
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help=f"Also write the JSON here (default on a Mac: {RESULT}; emulated: nowhere).")
def main(quick: bool, output: str | None) -> None:
    import mlx.core as mx

    from mlxspec.system import machine, write_report

    emulated = kernels.emulating()
    if not (mx.metal.is_available() or emulated):
        click.echo("error: bench/kernels.py needs Metal (a Mac with Apple silicon), or "
                   "MLXSPEC_KERNELS=emulate for a logic-only run", err=True)
        sys.exit(2)
    from rich.progress import Progress

    shapes = EMULATED_SHAPES if emulated else SHAPES[2:3] if quick else SHAPES
    bits_list = BITS[:1] if quick or emulated else BITS
    check = kernel_check.check_on_device(timing=False)
    # A GPU copy, not a CPU memcpy (emulated: the CPU's copy, meaningless as a GPU roofline).
    copy_gbps = kernel_timing.gpu_copy_bandwidth()
    results = []
    runs = [(s, b, m) for s in shapes for b in bits_list for m in ROWS]
    with Progress(transient=True) as progress:
        task = progress.add_task("timing kernels", total=len(runs))
        for (name, n, k), bits, rows in runs:
            r = kernel_timing.benchmark_matmul(n, k, bits=bits, group_size=64, rows=rows,
                                               iters=1 if emulated else 20,
                                               working_set_mb=0 if emulated else 256)
            r["shape"] = name
            r["zp_roofline"] = r["zp_gbps"] / copy_gbps
            r["affine_roofline"] = r["affine_gbps"] / copy_gbps
            results.append(r)
            progress.advance(task)
    report = {
        "mlx": mx.__version__,
        "machine": machine(),  # chip, GPU (mx.device_info()), memory, OS
        "backend": kernels.describe(),
        "emulated": kernels.EMULATED if emulated else None,
        "copy_gbps": copy_gbps,
        "check_ok": check["ok"],
        "check_failures": [c for c in check["cases"] if not c["ok"]],
        "results": results,
    }
    click.echo(json.dumps(report, indent=2, default=str))
    if output or not emulated:  # an emulated run is never the current result of a Mac
        write_report(report, output or RESULT)
    sys.exit(0 if check["ok"] and all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
