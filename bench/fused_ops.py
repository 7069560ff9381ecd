"""mlxspec.cpu.fused_ops: a decode step with the compiled RoPE and RMSNorm against MLX's own, side by side.

One process, the two in alternating rounds (this host's speed drifts within minutes): the ops in
one decode step's graph, the median time of a model forward over one new token per row at batch
sizes 1, 8 and 16 (a KV cache of ~100 tokens per row, the greedy token fed back), and the
ratio of batch N's tokens/s to batch 1's (what batching can give at most). Also checks that the
two give bitwise the same logits.

    python bench/fused_ops.py [--model DIR] [--rounds 3] [--out results.json]
"""

# ruff: noqa: I001  (mlxspec is imported before mlx.core: it must load the optimized BLAS first)
from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import time

import mlxspec  # first: the BLAS set-up
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlxspec.cpu import fused_ops
from mlxspec.load import default_model_path


def op_count(model) -> int:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 100]), cache=cache))
    dot = io.StringIO()
    mx.export_to_dot(dot, model(mx.array([[2]]), cache=cache))
    return len(re.findall(r'label ="[A-Z]', dot.getvalue()))


def forward_ms(model, batch: int, steps: int) -> tuple[float, mx.array]:
    """Median ms of a forward over one new token per row, and the last step's logits."""
    cache = make_prompt_cache(model)
    prompt = mx.array([[1, 5, 9, 200, 3000] * 20] * batch)
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    times = []
    for _ in range(steps):
        tokens = mx.argmax(logits[:, -1:, :], axis=-1)
        tic = time.perf_counter()
        logits = model(tokens, cache=cache)
        mx.eval(logits)
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3, logits


def summary(ms: dict[int, list[float]], batches: list[int]) -> dict:
    """One variant's forward times (ms per round at each batch size): medians, rounds, tokens/s
    and the ratio of batch N's tokens/s to the first batch size's."""
    medians = {b: statistics.median(ms[b]) for b in batches}
    return {
        "forward_ms": {str(b): round(medians[b], 2) for b in batches},
        "forward_ms_rounds": {str(b): [round(t, 2) for t in ms[b]] for b in batches},
        "tokens_per_s": {str(b): round(b * 1e3 / medians[b], 1) for b in batches},
        "vs_batch_1": {str(b): round(b * medians[batches[0]] / medians[b], 2) for b in batches},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model, _ = mlxspec.load(args.model or str(default_model_path()))
    variants = {"mlx_own": fused_ops.disable, "fused": fused_ops.enable}
    ms = {name: {b: [] for b in batches} for name in variants}
    ops, same_bits = {}, True
    for _ in range(args.rounds):
        last = {}
        for name, switch in variants.items():
            switch()
            ops[name] = op_count(model)
            for b in batches:
                step_ms, last[name, b] = forward_ms(model, b, args.steps)
                ms[name][b].append(step_ms)
        same_bits &= all(mx.array_equal(last["mlx_own", b], last["fused", b]).item() for b in batches)
    result = {"model": args.model or "SmolLM2-135M-Instruct (default)", "rounds": args.rounds,
              "steps": args.steps, "same_logits_bitwise": same_bits,
              "blas": mlxspec.cpu.blas.skinny_products(), "loadavg": open("/proc/loadavg").read().split()[:3],
              "variants": {}}
    for name in variants:
        result["variants"][name] = {"ops_per_step": ops[name], **summary(ms[name], batches)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
