"""Zero-point Metal kernels on the GPU: correctness against the MLX fallback, then speed against
``mx.quantized_matmul`` (MLX affine) at the same bits and group size, with GB/s achieved and the
fraction of the measured copy bandwidth (roofline).

    python bench/kernels.py [--quick] [--output FILE]

Prints JSON. Needs Metal (a Mac with Apple silicon); elsewhere it exits with status 2 and one
line. Exit status 1 if any kernel disagrees with the fallback.
"""

from __future__ import annotations

import json
import sys

import click

from mlxspec.quant import kernel_check, kernels

# (name, out_features N, in_features K): decode-time matmuls of common model sizes.
SHAPES = [
    ("smollm2-135m mlp up", 1536, 576),
    ("llama-7b attention", 4096, 4096),
    ("llama-7b mlp up", 11008, 4096),
    ("llama-7b mlp down", 4096, 11008),
]
ROWS = (1, 4, 8, 16)
BITS = (4, 8)


@click.command()
@click.option("--quick", is_flag=True, help="One shape, 4 bits only.")
@click.option("--output", type=click.Path(dir_okay=False), help="Also write the JSON here.")
def main(quick: bool, output: str | None) -> None:
    import mlx.core as mx

    if not mx.metal.is_available():
        click.echo("error: bench/kernels.py needs Metal (a Mac with Apple silicon)", err=True)
        sys.exit(2)
    from rich.progress import Progress

    shapes = SHAPES[1:2] if quick else SHAPES
    bits_list = BITS[:1] if quick else BITS
    check = kernel_check.check_on_device(timing=False)
    copy_gbps = kernel_check.gpu_copy_bandwidth()  # a GPU copy, not a CPU memcpy
    results = []
    runs = [(s, b, m) for s in shapes for b in bits_list for m in ROWS]
    with Progress(transient=True) as progress:
        task = progress.add_task("timing kernels", total=len(runs))
        for (name, n, k), bits, rows in runs:
            r = kernel_check.benchmark_matmul(n, k, bits=bits, group_size=64, rows=rows)
            r["shape"] = name
            r["zp_roofline"] = r["zp_gbps"] / copy_gbps
            r["affine_roofline"] = r["affine_gbps"] / copy_gbps
            results.append(r)
            progress.advance(task)
    report = {
        "mlx": mx.__version__,
        "device": mx.metal.device_info(),
        "backend": kernels.describe(),
        "copy_gbps": copy_gbps,
        "check_ok": check["ok"],
        "check_failures": [c for c in check["cases"] if not c["ok"]],
        "results": results,
    }
    text = json.dumps(report, indent=2, default=str)
    click.echo(text)
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
    sys.exit(0 if check["ok"] else 1)


if __name__ == "__main__":
    main()
