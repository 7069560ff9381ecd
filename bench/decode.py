"""Decode benchmark: mlxspec vs mlx-lm on one model, with achieved bandwidth and roofline.

    python bench/decode.py [--model M] [--max-tokens N] [--repeats R] [--json]

The same as `mlxspec bench`; see mlxspec/benchmark.py.
"""

from mlxspec.cli.bench import command

if __name__ == "__main__":
    command()
