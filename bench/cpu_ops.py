"""mlxspec.cpu.ops: the attention and greedy-candidates primitives against MLX's own, side by side.

One process, the two in alternating rounds (this host's speed drifts within minutes), medians:

- ``attention``: 30 layers of SmolLM2's attention (9 heads, 3 KV heads, 64 dimensions) as one
  evaluation, for 1 and 8 rows at 100, 400 and 1,000 positions (a KV cache's slices; 8 rows with
  a padding mask), MLX's own composition against the primitive; the outputs compared bitwise.
- ``greedy``: the greedy candidates (argmax and near-tie count) of 1 and 8 rows of 49,152 logits.
- ``engine``: ``mlxspec.serving.engine.Engine`` in-process with 1 and 8 clients sending SmolLM2 chat
  requests (64 tokens) back to back, tokens/s over a window, both ops off (MLX's own) and on, and
  the ratio of 8 clients to 1 in each.

    python bench/cpu_ops.py [--rounds 3] [--seconds 12] [--skip engine] [--out results.json]
"""

# ruff: noqa: I001  (mlxspec is imported before mlx.core: it must load the optimized BLAS first)
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlxspec  # first: the BLAS set-up
import mlx.core as mx
from mlxspec.cpu import blas
from mlxspec.cpu import ops as cpu_ops
from mlxspec.serving.rows import GREEDY_TIE, greedy_candidates

sys.path.insert(0, str(Path(__file__).parent))
from serve import PROMPTS  # noqa: E402  (the serving benchmark's chat prompts)

LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64


def switch(on: bool) -> None:
    if on:
        assert cpu_ops.enable(), cpu_ops.describe()
    else:
        cpu_ops.disable()


def best_ms(run, repeats: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - tic)
    return best * 1e3


def attention_case(rows: int, positions: int):
    keys = mx.random.split(mx.random.key(rows * positions), 3)
    q = [mx.random.normal((rows, HEADS, 1, DIM), key=keys[0]) for _ in range(LAYERS)]
    cache = [mx.random.normal((rows, KV_HEADS, positions + 64, DIM), key=keys[1])
             for _ in range(2 * LAYERS)]
    k, v = [c[:, :, :positions] for c in cache[:LAYERS]], [c[:, :, :positions] for c in cache[LAYERS:]]
    pad = mx.arange(rows) * 3
    mask = mx.arange(positions)[None, None, None, :] >= pad[:, None, None, None] if rows > 1 else None
    mx.eval(q, k, v, mask) if mask is not None else mx.eval(q, k, v)

    def run():
        outs = [mx.fast.scaled_dot_product_attention(a, b, c, scale=DIM**-0.5, mask=mask)
                for a, b, c in zip(q, k, v, strict=True)]
        mx.eval(outs)
        return outs
    return run


def attention(rounds: int) -> list[dict]:
    results = []
    for rows in (1, 8):
        for positions in (100, 400, 1000):
            run = attention_case(rows, positions)
            times, outs = {False: [], True: []}, {}
            for r in range(rounds):
                for on in (False, True) if r % 2 == 0 else (True, False):
                    switch(on)
                    outs[on] = run()
                    times[on].append(best_ms(run))
            same = all(mx.array_equal(a, b).item() for a, b in zip(outs[False], outs[True],
                                                                  strict=True))
            own, op = statistics.median(times[False]), statistics.median(times[True])
            results.append({"rows": rows, "positions": positions, "mlx_own_ms": round(own, 2),
                            "cpu_ops_ms": round(op, 2), "speedup": round(own / op, 2),
                            "bitwise": same})
            print(json.dumps(results[-1]), flush=True)
    return results


def greedy(rounds: int) -> list[dict]:
    results = []
    for rows in (1, 8):
        logits = mx.random.normal((rows, 49152), key=mx.random.key(rows))
        mx.eval(logits)
        times, outs = {False: [], True: []}, {}
        for r in range(rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                switch(on)
                outs[on] = greedy_candidates(logits)
                times[on].append(best_ms(lambda x=logits: mx.eval(*greedy_candidates(x)), 100))
        same = all(mx.array_equal(a, b).item() for a, b in zip(outs[False], outs[True], strict=True))
        own, op = statistics.median(times[False]), statistics.median(times[True])
        results.append({"rows": rows, "mlx_own_ms": round(own, 3), "cpu_ops_ms": round(op, 3),
                        "speedup": round(own / op, 2), "bitwise": same, "tie": GREEDY_TIE})
        print(json.dumps(results[-1]), flush=True)
    return results


def engine_rate(model, tokenizer, clients: int, seconds: float, warmup: float = 3.0) -> float:
    """Tokens/s of the in-process engine with ``clients`` requests always in flight."""
    from mlxspec.serving.engine import Engine
    from mlxspec.serving.requests import Request

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True) for p in PROMPTS]
    engine = Engine(model, tokenizer)
    sent = 0

    def submit() -> None:
        nonlocal sent
        engine.submit(Request(prompt=prompts[sent % len(prompts)], max_tokens=64))
        sent += 1

    for _ in range(clients):
        submit()
    start, counted, opened = time.perf_counter(), 0, None
    while True:
        now = time.perf_counter()
        if opened is None and now - start >= warmup:
            opened, counted = now, 0
        if opened is not None and now - opened >= seconds:
            break
        for event in engine.step():
            counted += event.token is not None
            if event.finish_reason:
                submit()
    rate = counted / (time.perf_counter() - opened)
    engine.close()
    return rate


def engine(rounds: int, seconds: float) -> dict:
    model, tokenizer = mlxspec.load()
    rates = {(on, c): [] for on in (False, True) for c in (1, 8)}
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            switch(on)
            for clients in (1, 8):
                rates[on, clients].append(engine_rate(model, tokenizer, clients, seconds))
                print(f"round {r} ops {'on' if on else 'off'} clients {clients}: "
                      f"{rates[on, clients][-1]:.1f} tok/s", flush=True)
    out = {}
    for on in (False, True):
        name = "cpu_ops" if on else "mlx_own"
        ratios = [a / b for a, b in zip(rates[on, 8], rates[on, 1], strict=True)]
        out[name] = {"tokens_per_s": {str(c): round(statistics.median(rates[on, c]), 1)
                                      for c in (1, 8)},
                     "tokens_per_s_rounds": {str(c): [round(x, 1) for x in rates[on, c]]
                                             for c in (1, 8)},
                     "clients_8_vs_1": round(statistics.median(ratios), 2),
                     "clients_8_vs_1_rounds": [round(x, 2) for x in ratios]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=12, help="engine: window per run")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) - {""}
    assert cpu_ops.enable(), cpu_ops.describe()
    result = {"mlx": mx.__version__, "blas": blas.skinny_products(), "rounds": args.rounds}
    if "attention" not in skip:
        result["attention"] = attention(args.rounds)
    if "greedy" not in skip:
        result["greedy"] = greedy(args.rounds)
    if "engine" not in skip:
        result["engine"] = engine(args.rounds, args.seconds)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
