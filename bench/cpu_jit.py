"""mlxspec.cpu.jit: decode steps with MLX's JIT kernels built for this CPU against MLX's own build.

The two builds cannot share a process (MLX keeps a kernel it loaded), so each round runs one
child process per variant, in alternating order: ``MLXSPEC_JIT_FLAGS=0`` (MLX's build) and the
default (``mlxspec.cpu.jit``), each with a kernel cache of its own (``TMPDIR``, kept across the
rounds: the first round also builds the kernels, and is a warm-up). A child measures what
``bench/fused_ops.py`` does: the median time of a forward over one new token per row at batch
sizes 1, 8 and 16 (a KV cache of ~100 tokens per row, the greedy token fed back), and saves its
last logits; the two variants' logits must be bitwise the same.

    python bench/cpu_jit.py [--model DIR] [--rounds 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import mlxspec
import mlx.core as mx
import numpy as np
from fused_ops import forward_ms
from mlxspec.cpu import jit as cpu_jit
from mlxspec.load import default_model_path

model, _ = mlxspec.load(sys.argv[2] or str(default_model_path()))
out = {"jit_flags": cpu_jit.enabled(), "forward_ms": {}}
for b in [int(b) for b in sys.argv[3].split(",")]:
    out["forward_ms"][b], logits = forward_ms(model, b, int(sys.argv[4]))
    np.save(f"{sys.argv[5]}_{b}.npy", np.array(logits))
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the first a warm-up")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    variants = {"mlx_build": {"MLXSPEC_JIT_FLAGS": "0"}, "cpu_jit": {}}
    ms = {name: {b: [] for b in batches} for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        caches = {name: Path(tmp) / name for name in variants}
        for cache in caches.values():
            cache.mkdir()
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                env = {**os.environ, "TMPDIR": str(caches[name]), **variants[name]}
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, str(HERE), args.model, args.batches,
                     str(args.steps), str(Path(tmp) / name)],
                    capture_output=True, text=True, env=env, check=True)
                child = json.loads(proc.stdout.strip().splitlines()[-1])
                assert child["jit_flags"] == (name == "cpu_jit"), child
                if r > 0:
                    for b in batches:
                        ms[name][b].append(child["forward_ms"][str(b)])
        same_bits = all(np.array_equal(np.load(Path(tmp) / f"mlx_build_{b}.npy"),
                                       np.load(Path(tmp) / f"cpu_jit_{b}.npy")) for b in batches)
    result = {"model": args.model or "SmolLM2-135M-Instruct (default)", "rounds": args.rounds - 1,
              "steps": args.steps, "same_logits_bitwise": same_bits,
              "loadavg": open("/proc/loadavg").read().split()[:3], "variants": {}}
    sys.path.insert(0, str(HERE))
    from fused_ops import summary  # bench/fused_ops.py: the same measurement, summarised alike

    for name in variants:
        result["variants"][name] = summary(ms[name], batches)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not same_bits:
        sys.exit("the two builds' logits differ")


if __name__ == "__main__":
    main()
