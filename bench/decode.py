"""Decode and prefill of the default model (SmolLM2-135M, its GGUF file) on a CPU, side by side:

    float32 + BLAS      the GGUF dequantized to float32, OpenBLAS (mlxspec's path before issue 43)
    mlx quantized       the GGUF's blocks as MLX quantized weights, MLX's own quantized_matmul
    mlxspec 4-bit       the same weights through mlxspec's packed-weight kernel (the default now)
    mlxspec 8-bit       the float32 weights requantized by MLX (nn.quantize, 8 bits, group 32),
                        through the kernel
    llama.cpp           llama-cpp-python on the very same GGUF file

Each row runs in a process of its own (resident memory is the process's), 2 threads, the same
prompt token ids, greedy; rows alternate over ``--rounds`` rounds and medians are reported:
decode tok/s (``--tokens`` tokens after the chat prompt), prefill tok/s (one forward over a
``--prefill``-token prompt), bytes read per decoded token and the GB/s that achieves, its fraction
of the measured read bandwidth, and resident memory after decoding. JSON into
``bench/results/decode.json``; run it under the benchmark lock:

    flock /tmp/mlxspec-bench.lock python bench/decode.py [--rounds 3] [--tokens 64]

llama.cpp's row needs a separate benchmark-only environment (never a test or project
dependency; builds llama.cpp from source, ~6-15 min):

    python3 -m venv /work/benchenv && nice -n 19 /work/benchenv/bin/pip install llama-cpp-python

Without ``/work/benchenv/bin/python`` (or ``--llama-python``) the row is skipped with a note.
"""

# ruff: noqa: I001  (mlxspec is imported before mlx.core: it must load the optimized BLAS first)
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "decode.json"
LLAMA_PYTHON = Path("/work/benchenv/bin/python")
THREADS = 2
ROWS = {  # name -> environment of its process
    "float32 + BLAS": {"MLXSPEC_CPU_QMM": "0", "MLXSPEC_GGUF_WEIGHTS": "dense"},
    "mlx quantized_matmul": {"MLXSPEC_CPU_QMM": "0", "MLXSPEC_GGUF_WEIGHTS": "quantized",
                             "MLXSPEC_ZP_CPU": "quantized"},
    "mlxspec 4-bit": {},
    "mlxspec 8-bit": {"MLXSPEC_GGUF_WEIGHTS": "dense", "BENCH_REQUANTIZE_BITS": "8"},
}


def rss_mb() -> float:
    """This process's resident memory now, in MB (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def mlxspec_row(prompt_ids: list[int], long_ids: list[int], tokens: int) -> dict:
    """One row in this process, configured by its environment (``ROWS``)."""
    import mlxspec
    import mlx.core as mx
    import mlx.nn as nn
    from mlxspec import cpu
    from mlxspec.benchmark import model_bytes
    from mlxspec.cache import make_cache
    from mlxspec.generate import stream_generate

    model, tokenizer = mlxspec.load()
    bits = int(os.environ.get("BENCH_REQUANTIZE_BITS", "0"))
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        cpu.prepare(model)
    mx.eval(model.parameters())

    def prefill() -> float:
        cache = make_cache(model)
        tic = time.perf_counter()
        mx.eval(model(mx.array([long_ids]), cache=cache)[:, -1])
        return time.perf_counter() - tic

    prefill()  # warm-up (and the JIT's kernels)
    prefill_s = min(prefill() for _ in range(3))
    run = list(stream_generate(model, tokenizer, prompt_ids, max_tokens=8))  # warm-up
    run = list(stream_generate(model, tokenizer, prompt_ids, max_tokens=tokens))
    return {"decode_tps": run[-1].generation_tps, "decoded": run[-1].generation_tokens,
            "prefill_tps": len(long_ids) / prefill_s, "bytes_per_token": model_bytes(model),
            "rss_mb": rss_mb(), "tokens": [r.token for r in run[:24]],
            "quantized_products": cpu.report(measure=False)["quantized_products"]}


LLAMA_ROW = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from llama_cpp import Llama, __version__
args = json.loads(sys.argv[1])
llm = Llama(args["model"], n_ctx=2048, n_threads=args["threads"], n_threads_batch=args["threads"],
            n_batch=512, verbose=False)
def prefill():
    llm.reset()
    tic = time.perf_counter()
    llm.eval(args["long"])
    return time.perf_counter() - tic
prefill()
prefill_s = min(prefill() for _ in range(3))
def decode(n):
    llm.reset()
    llm.eval(args["prompt"])
    out = []
    tic = time.perf_counter()
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out, time.perf_counter() - tic
decode(8)
out, seconds = decode(args["tokens"])
rss = next(int(l.split()[1]) / 1024 for l in Path("/proc/self/status").read_text().splitlines()
           if l.startswith("VmRSS:"))
print(json.dumps({"decode_tps": len(out) / seconds, "decoded": len(out),
                  "prefill_tps": len(args["long"]) / prefill_s,
                  "bytes_per_token": Path(args["model"]).stat().st_size, "rss_mb": rss,
                  "tokens": out[:24], "version": __version__}))
"""


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLXSPEC_CPU_QMM", "MLXSPEC_GGUF_WEIGHTS", "MLXSPEC_ZP_CPU")}
    return {**env, "OPENBLAS_NUM_THREADS": str(THREADS), **extra}


def run_row(name: str, args, prompt_ids: list[int], long_ids: list[int], model: Path) -> dict:
    payload = {"prompt": prompt_ids, "long": long_ids, "tokens": args.tokens}
    if name == "llama.cpp":
        payload.update(model=str(model), threads=THREADS)
        command = [str(args.llama_python), "-c", LLAMA_ROW, json.dumps(payload)]
        env = child_env({})
    else:
        command = [sys.executable, __file__, "--child", json.dumps(payload)]
        env = child_env(ROWS[name])
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"the {name!r} row failed: {result.stderr.strip()[-600:]}")
    row = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"  decode {row['decode_tps']:.1f} tok/s, prefill {row['prefill_tps']:.1f} tok/s, "
          f"RSS {row['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    return row


def summary(runs: list[dict], bandwidth: float) -> dict:
    row = {k: statistics.median(r[k] for r in runs)
           for k in ("decode_tps", "prefill_tps", "rss_mb")}
    row["bytes_per_token"] = runs[0]["bytes_per_token"]
    row["achieved_gbs"] = row["bytes_per_token"] * row["decode_tps"] / 1e9
    row["roofline"] = row["achieved_gbs"] / bandwidth
    row["runs"] = runs
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        payload = json.loads(args.child)
        print(json.dumps(mlxspec_row(payload["prompt"], payload["long"], payload["tokens"])))
        return

    import mlxspec  # noqa: F401  (the BLAS set-up)
    from mlxspec import cpu
    from mlxspec.benchmark import DEFAULT_PROMPT, read_bandwidth
    from mlxspec.chat import chat_prompt
    from mlxspec.load import default_model_path, read_tokenizer, resolve_model_path

    model_dir = resolve_model_path(None)
    tokenizer = read_tokenizer(model_dir, json.loads((model_dir / "config.json").read_text()))
    prompt_ids = chat_prompt(tokenizer, [{"role": "user", "content": DEFAULT_PROMPT}])
    long_ids = (tokenizer.encode(Path(__file__).read_text()) * 4)[: args.prefill]
    names = list(ROWS)
    notes = []
    if args.llama_python.is_file():
        names.append("llama.cpp")
    else:
        notes.append(f"llama.cpp skipped: no {args.llama_python} (see this script's docstring)")
    bandwidth = read_bandwidth()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names:
            print(f"round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            try:
                runs[name].append(run_row(name, args, prompt_ids, long_ids, default_model_path()))
            except RuntimeError as e:  # one row's failure is a note, not the whole run lost
                notes.append(str(e))
    rows = {name: summary(r, bandwidth) for name, r in runs.items() if r}
    base = rows["float32 + BLAS"]
    for row in rows.values():
        row["decode_vs_float32"] = row["decode_tps"] / base["decode_tps"]
        row["prefill_vs_float32"] = row["prefill_tps"] / base["prefill_tps"]
        if "llama.cpp" in rows:
            row["decode_vs_llama_cpp"] = row["decode_tps"] / rows["llama.cpp"]["decode_tps"]
    result = {
        "benchmark": "decode", "model": str(default_model_path().name), "threads": THREADS,
        "prompt_tokens": len(prompt_ids), "decode_tokens": args.tokens,
        "prefill_tokens": len(long_ids), "rounds": args.rounds, "cpu": cpu.cpu_model(),
        "read_bandwidth_gbs": bandwidth, "load_average": os.getloadavg(), "notes": notes,
        "blas": cpu.blas_report(measure=False), "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"{'':22} {'decode':>8} {'prefill':>8} {'MB/token':>9} {'GB/s':>6} {'RSS MB':>7}")
    for name, row in rows.items():
        print(f"{name:22} {row['decode_tps']:8.1f} {row['prefill_tps']:8.1f} "
              f"{row['bytes_per_token'] / 1e6:9.0f} {row['achieved_gbs']:6.1f} {row['rss_mb']:7.0f}")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
