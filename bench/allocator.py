"""glibc's malloc or mimalloc (``mlxspec.cpu.allocator``): decode steps of mlxspec's engine, side by side.

    python bench/allocator.py [--model DIR] [--rows 1,8] [--rounds 4] [--steps 64] [--out F]

The same runs as bench/huge_pages.py (a fresh process per run, ``rows`` greedy streams, the
median of ``--steps`` engine steps once all decode, variants in turns), with the weights on huge
pages in both and the process started without or with mimalloc preloaded, as the ``mlxspec``
command starts itself. JSON on stdout: per row count the medians, their ratio, and for each
allocator the in-process ceiling of batching, ``rows x one-row step / rows-row step``.
"""

from __future__ import annotations

import click
from huge_pages import report, side_by_side, step_options

from mlxspec.cpu import allocator


@step_options
def main(model: str | None, rows: str, rounds: int, steps: int, out: str | None) -> None:
    library = allocator.library_path()
    if library is None:
        raise click.ClickException("no mimalloc here: Linux with `pip install cmeel-mimalloc`")
    variants = {"glibc": {"LD_PRELOAD": ""}, "mimalloc": {"LD_PRELOAD": str(library)}}
    counts = [int(r) for r in rows.split(",")]
    result = side_by_side(variants, counts, rounds, steps, model)
    result["library"] = str(library)
    one = next((row for row in result["rows"] if row["rows"] == 1), None)
    for row in result["rows"]:
        if one is not None and row["rows"] > 1:
            row["batching_ceiling"] = {
                name: round(row["rows"] * one[f"{name}_ms"] / row[f"{name}_ms"], 2)
                for name in variants}
    report(result, out)


if __name__ == "__main__":
    main()
