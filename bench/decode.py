"""Decode and prefill of the default model (SmolLM2-135M, its GGUF file) on a CPU, side by side:

    float32 + BLAS      the GGUF dequantized to float32, OpenBLAS (mlxspec's path before issue 43)
    mlx quantized       the GGUF's blocks as MLX quantized weights, MLX's own quantized_matmul
    mlxspec 4-bit       the same weights through mlxspec's packed-weight kernel, each Llama layer
                        four ops (mlxspec/cpu/layers.py): the default
    ..., layers unfused the same with mlx-lm's layers as written (MLXSPEC_CPU_LAYERS=0)
    mlxspec 8-bit       the float32 weights requantized by MLX (nn.quantize, 8 bits, group 32),
                        through the kernel
    ..., int8 x         the same with int8 activations (MLXSPEC_CPU_QMM_ACTIVATIONS=int8, VNNI)
    llama.cpp           llama-cpp-python on the very same GGUF file, 2 threads and 1 thread
                        (mlxspec 4-bit also once with 1 thread)

Each row runs in a process of its own (resident memory is the process's), 2 threads, the same
prompt token ids, greedy; rows alternate over ``--rounds`` rounds and medians are reported:
decode tok/s (``--tokens`` tokens after the chat prompt), prefill tok/s (a ``--prefill``-token
prompt over the time to its first token, through ``stream_generate``: mlx-lm's prefill, which
skips the output head for all but the last position, as llama.cpp's row does), bytes read per
decoded token and the GB/s that achieves, its fraction of the measured read bandwidth, and
resident memory after decoding. JSON into
``bench/results/decode.json``; run it under the benchmark lock:

    flock /tmp/mlxspec-bench.lock python bench/decode.py [--rounds 3] [--tokens 64]

llama.cpp's row needs a separate benchmark-only environment (never a test or project
dependency; builds llama.cpp from source, ~6-15 min):

    python3 -m venv /work/llamacpp-env && nice -n 19 /work/llamacpp-env/bin/pip install llama-cpp-python

Without ``/work/llamacpp-env/bin/python`` (or ``--llama-python``) the row is skipped with a note.

Accuracy, beside the speed: each row's logits (llama.cpp's with two threads too) over
``ACCURACY_TOKENS`` tokens of the long prompt, fed ``ACCURACY_CHUNK`` at a time (the path decoding
and verification take), against the float64 model (the GGUF dequantized, every parameter and every
operation in float64): the largest error over the logits' spread, and how often the argmax is the
float64 model's.

Where a step's time goes (``step_profile``, mlxspec rows): one synchronous decode step, the
linear layers' products on one row, the output head, and the rest (``docs/linux-cpu.md``).
"""

# ruff: noqa: I001  (mlxspec is imported before mlx.core: it must load the optimized BLAS first)
from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "decode.json"
LLAMA_PYTHON = Path("/work/llamacpp-env/bin/python")
THREADS = 2
INT8 = "MLXSPEC_CPU_QMM_ACTIVATIONS"
# llama.cpp's threads meet at a spinning barrier after every op: on a shared 2-core machine one
# preempted thread stalls the other, so its 1-thread run is recorded beside the 2-thread one
LLAMA_ROWS = {"llama.cpp": THREADS, "llama.cpp, 1 thread": 1}
ROWS = {  # name -> environment of its process
    "float32 + BLAS": {"MLXSPEC_CPU_QMM": "0", "MLXSPEC_GGUF_WEIGHTS": "dense"},
    "mlx quantized_matmul": {"MLXSPEC_CPU_QMM": "0", "MLXSPEC_GGUF_WEIGHTS": "quantized",
                             "MLXSPEC_ZP_CPU": "quantized"},
    "mlxspec 4-bit": {"MLXSPEC_GGUF_WEIGHTS": "quantized"},
    "mlxspec 4-bit, layers unfused": {"MLXSPEC_GGUF_WEIGHTS": "quantized", "MLXSPEC_CPU_LAYERS": "0"},
    "mlxspec 4-bit, int8 x": {"MLXSPEC_GGUF_WEIGHTS": "quantized", INT8: "int8"},
    "mlxspec 4-bit, 1 thread": {"MLXSPEC_GGUF_WEIGHTS": "quantized", "OPENBLAS_NUM_THREADS": "1"},
    "mlxspec 8-bit": {"MLXSPEC_GGUF_WEIGHTS": "dense", "BENCH_REQUANTIZE_BITS": "8"},
    "mlxspec 8-bit, int8 x": {"MLXSPEC_GGUF_WEIGHTS": "dense", "BENCH_REQUANTIZE_BITS": "8",
                              INT8: "int8"},
}
ACCURACY_TOKENS, ACCURACY_CHUNK = 96, 16  # teacher-forced, 16 rows a forward: the kernel's path


def rss_mb() -> float:
    """This process's resident memory now, in MB (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def mlxspec_row(prompt_ids: list[int], long_ids: list[int], tokens: int,
                accuracy_file: str) -> dict:
    """One row in this process, configured by its environment (``ROWS``); its chunked logits
    (:func:`chunked_logits`) into ``accuracy_file``."""
    import mlxspec
    import mlx.core as mx
    import mlx.nn as nn
    from mlxspec import cpu
    from mlxspec.benchmark import model_bytes
    from mlxspec.generate import stream_generate

    model, tokenizer = mlxspec.load()
    bits = int(os.environ.get("BENCH_REQUANTIZE_BITS", "0"))
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        cpu.prepare(model)
    mx.eval(model.parameters())

    def prefill() -> float:  # to the first token, as a user waits for it (and llama.cpp's row)
        tic = time.perf_counter()
        next(iter(stream_generate(model, tokenizer, long_ids, max_tokens=1)))
        return time.perf_counter() - tic

    prefill()  # warm-up (and the JIT's kernels)
    prefill_s = min(prefill() for _ in range(3))
    run = list(stream_generate(model, tokenizer, prompt_ids, max_tokens=8))  # warm-up
    run = list(stream_generate(model, tokenizer, prompt_ids, max_tokens=tokens))
    np.save(accuracy_file, chunked_logits(model, long_ids[:ACCURACY_TOKENS]))
    return {"decode_tps": run[-1].generation_tps, "decoded": run[-1].generation_tokens,
            "prefill_tps": len(long_ids) / prefill_s, "bytes_per_token": model_bytes(model),
            "rss_mb": rss_mb(), "tokens": [r.token for r in run[:24]],
            "quantized_products": cpu.report(measure=False)["quantized_products"],
            "step_profile": step_profile(model, prompt_ids)}


def step_profile(model, prompt_ids: list[int], steps: int = 32) -> dict:
    """Milliseconds of one synchronous decode step and of its parts, medians: every linear
    layer's product on one row (in one graph, as a step's), the output head's, and the rest
    (attention, norms, RoPE, cache updates, MLX's per-node cost and the Python building it)."""
    import mlx.core as mx
    from mlxspec.cache import make_cache

    cache = make_cache(model)
    mx.eval(model(mx.array([prompt_ids]), cache=cache))
    token = mx.array([[1]])

    def median_ms(fn, n: int) -> float:
        fn()
        times = []
        for _ in range(n):
            tic = time.perf_counter()
            fn()
            times.append(time.perf_counter() - tic)
        return 1e3 * statistics.median(times)

    step = median_ms(lambda: mx.eval(mx.argmax(model(token, cache=cache)[:, -1], -1)), steps)
    inner = model.model if hasattr(model, "model") else model
    head = getattr(model, "lm_head", None) or inner.embed_tokens.as_linear
    linears = [m for name, m in model.named_modules()
               if "weight" in m and m["weight"].ndim == 2 and "embed" not in name
               and name != "lm_head"]
    rows = {m_in(m): mx.zeros((1, 1, m_in(m))) for m in linears}
    calls = [(m, rows[m_in(m)]) for m in linears]  # inputs looked up outside the timed loop
    hidden = mx.zeros((1, 1, model.args.hidden_size))
    products = median_ms(lambda: mx.eval([m(x) for m, x in calls]), 9)
    head_ms = median_ms(lambda: mx.eval(head(hidden)), 9)
    return {"step_ms": step, "linear_products_ms": products, "linear_products": len(linears),
            "head_ms": head_ms, "rest_ms": step - products - head_ms}


def m_in(layer) -> int:
    """A linear layer's input size (packed or not)."""
    w = layer["weight"]
    return w.shape[1] * 32 // layer.bits if hasattr(layer, "bits") else w.shape[1]


def chunked_logits(model, ids: list[int]) -> np.ndarray:
    """Logits (len(ids), vocabulary) float64 of ``model`` fed ``ACCURACY_CHUNK`` tokens a forward."""
    import mlx.core as mx
    from mlxspec.cache import make_cache

    cache, out = make_cache(model), []
    for i in range(0, len(ids), ACCURACY_CHUNK):
        logits = model(mx.array([ids[i:i + ACCURACY_CHUNK]]), cache=cache)[0]
        out.append(np.array(logits.astype(mx.float32)).astype(np.float64))
    return np.concatenate(out)


def float64_logits(ids: list[int]) -> np.ndarray:
    """The float64 model's logits on ``ids``: the GGUF dequantized (float32 numbers, exact in
    float64), every parameter cast to float64 and run on MLX's CPU in float64."""
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_lm_load
    from mlxspec.gguf import tensors
    from mlxspec.load import resolve_model_path

    with tensors.dense_conversion():
        model, _ = mlx_lm_load(str(resolve_model_path(None)))
    model.set_dtype(mx.float64)
    return chunked_logits(model, ids)


def accuracy(logits: np.ndarray, reference: np.ndarray) -> dict:
    error = np.abs(logits - reference)
    return {"max_error_over_std": float(error.max() / reference.std()),
            "mean_error_over_std": float(error.mean() / reference.std()),
            "argmax_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean())}


LLAMA_ROW = r"""
import json, sys, time
from pathlib import Path
import llama_cpp.llama_cpp as C
from llama_cpp import Llama, __version__
args = json.loads(sys.argv[1])
# llama-cpp-python 0.3.36 built here segfaults in llama_decode on any batch of more than one token
# with its extra weight buffers (AMX/repacked, on by default on this CPU; one token at a time
# works). Decoding therefore runs the default build fed one token a time (n_batch 1: the prompt
# too); prefill runs a second instance without the extra buffers (use_extra_bufts off).
def model(extra_buffers, n_batch, logits_all=False):
    default = C.llama_model_default_params
    def params():
        p = default()
        p.use_extra_bufts = extra_buffers
        return p
    C.llama_model_default_params = params
    try:
        return Llama(args["model"], n_ctx=2048, n_threads=args["threads"],
                     n_threads_batch=args["threads"], n_batch=n_batch, logits_all=logits_all,
                     verbose=False)
    finally:
        C.llama_model_default_params = default
def first_token(llm, ids):  # greedy (temp 0) through Llama.generate: it sets the sampler
    llm.reset()
    return llm.generate(ids, temp=0.0, top_k=1, reset=True)
llm = model(False, 512)
def prefill():
    tic = time.perf_counter()
    next(first_token(llm, args["long"]))
    return time.perf_counter() - tic
prefill()
prefill_s = min(prefill() for _ in range(3))
del llm
if args["accuracy_chunk"]:  # the mlxspec rows' accuracy input: teacher-forced, chunk by chunk
    import numpy as np
    llm = model(False, args["accuracy_chunk"], logits_all=True)
    ids = args["long"][:args["accuracy_tokens"]]
    llm.eval(ids)
    np.save(args["accuracy_file"], np.array(llm.scores[:len(ids)], dtype=np.float64))
    del llm
llm = model(True, 1)
def decode(n):
    stream, out = first_token(llm, args["prompt"]), []
    out.append(next(stream))
    tic = time.perf_counter()
    for token in stream:
        out.append(token)
        if len(out) == n + 1:
            break
    return out, time.perf_counter() - tic  # n tokens timed after the first
decode(8)
out, seconds = decode(args["tokens"])
rss = next(int(l.split()[1]) / 1024 for l in Path("/proc/self/status").read_text().splitlines()
           if l.startswith("VmRSS:"))
print(json.dumps({"decode_tps": (len(out) - 1) / seconds, "decoded": len(out) - 1,
                  "prefill_tps": len(args["long"]) / prefill_s,
                  "bytes_per_token": Path(args["model"]).stat().st_size, "rss_mb": rss,
                  "tokens": out[:24], "version": __version__, "threads": args["threads"]}))
"""


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLXSPEC_CPU_QMM", "MLXSPEC_GGUF_WEIGHTS", "MLXSPEC_ZP_CPU",
                        "MLXSPEC_CPU_LAYERS")}
    return {**env, "OPENBLAS_NUM_THREADS": str(THREADS), **extra}


def run_row(name: str, args, prompt_ids: list[int], long_ids: list[int], model: Path,
            reference: np.ndarray) -> dict:
    work = tempfile.mkdtemp(prefix="bench-decode-")
    accuracy_file = str(Path(work) / "logits.npy")
    payload = {"prompt": prompt_ids, "long": long_ids, "tokens": args.tokens,
               "accuracy_file": accuracy_file}
    if name.startswith("llama.cpp"):
        payload.update(model=str(model), threads=LLAMA_ROWS[name],
                       accuracy_tokens=ACCURACY_TOKENS,
                       accuracy_chunk=ACCURACY_CHUNK if LLAMA_ROWS[name] == THREADS else 0)
        command = [str(args.llama_python), "-c", LLAMA_ROW, json.dumps(payload)]
        env = child_env({})
    else:
        command = [sys.executable, __file__, "--child", json.dumps(payload)]
        env = child_env(ROWS[name])
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"the {name!r} row failed: {result.stderr.strip()[-600:]}")
    row = json.loads(result.stdout.strip().splitlines()[-1])
    if Path(accuracy_file).is_file():
        row["accuracy"] = accuracy(np.load(accuracy_file), reference)
    shutil.rmtree(work, ignore_errors=True)
    print(f"  decode {row['decode_tps']:.1f} tok/s, prefill {row['prefill_tps']:.1f} tok/s, "
          f"RSS {row['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    return row


def summary(runs: list[dict], bandwidth: float) -> dict:
    row = {k: statistics.median(r[k] for r in runs)
           for k in ("decode_tps", "prefill_tps", "rss_mb")}
    row["bytes_per_token"] = runs[0]["bytes_per_token"]
    if "accuracy" in runs[0]:
        row["accuracy"] = runs[0]["accuracy"]
    if "step_profile" in runs[0]:  # mlxspec rows: the median of each part over the rounds
        row["step_profile"] = {k: statistics.median(r["step_profile"][k] for r in runs)
                               for k in runs[0]["step_profile"]}
    row["achieved_gbs"] = row["bytes_per_token"] * row["decode_tps"] / 1e9
    row["roofline"] = row["achieved_gbs"] / bandwidth
    row["runs"] = runs
    return row


def markdown_table(result: dict) -> str:
    """The README's table of a result: tok/s, ratios, bytes, accuracy, per row."""
    lines = ["| row | decode tok/s | ÷ float32 | ÷ llama.cpp | prefill tok/s | MB read / token "
             "| argmax = float64 |", "|---|--:|--:|--:|--:|--:|--:|"]
    for name, row in result["rows"].items():
        acc = row.get("accuracy", {}).get("argmax_agreement")
        vs_llama = row.get("decode_vs_llama_cpp")
        lines.append(
            f"| {name} | {row['decode_tps']:.1f} | {row['decode_vs_float32']:.2f}× | "
            f"{'–' if vs_llama is None else f'{vs_llama:.2f}×'} | {row['prefill_tps']:.0f} | "
            f"{row['bytes_per_token'] / 1e6:.0f} | {'–' if acc is None else f'{100 * acc:.1f} %'} |")
    load = ", ".join(f"{v:.1f}" for v in result["load_average"])
    lines.append(f"\n{result['cpu']}, {result['threads']} threads, load average {load}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true",
                        help="print --out's rows as the README's markdown table and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.out.read_text())))
        return
    if args.child:
        payload = json.loads(args.child)
        print(json.dumps(mlxspec_row(payload["prompt"], payload["long"], payload["tokens"],
                                     payload["accuracy_file"])))
        return

    import mlxspec  # noqa: F401  (the BLAS set-up)
    from mlxspec import cpu
    from mlxspec.benchmark import DEFAULT_PROMPT, read_bandwidth
    from mlxspec.chat_template import chat_prompt
    from mlxspec.load import default_model_path, read_tokenizer, resolve_model_path

    model_dir = resolve_model_path(None)
    tokenizer = read_tokenizer(model_dir, json.loads((model_dir / "config.json").read_text()))
    prompt_ids = chat_prompt(tokenizer, [{"role": "user", "content": DEFAULT_PROMPT}])
    long_ids = (tokenizer.encode(Path(__file__).read_text()) * 4)[: args.prefill]
    names = list(ROWS)
    notes = []
    if args.llama_python.is_file():
        names += list(LLAMA_ROWS)
    else:
        notes.append(f"llama.cpp skipped: no {args.llama_python} (see this script's docstring)")
    bandwidth = read_bandwidth()
    reference = float64_logits(long_ids[:ACCURACY_TOKENS])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names:
            print(f"round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            try:
                runs[name].append(run_row(name, args, prompt_ids, long_ids, default_model_path(),
                                          reference))
            except RuntimeError as e:  # one row's failure is a note, not the whole run lost
                notes.append(str(e))
    rows = {name: summary(r, bandwidth) for name, r in runs.items() if r}
    base = rows["float32 + BLAS"]
    for row in rows.values():
        row["decode_vs_float32"] = row["decode_tps"] / base["decode_tps"]
        row["prefill_vs_float32"] = row["prefill_tps"] / base["prefill_tps"]
        llama = [rows[n]["decode_tps"] for n in LLAMA_ROWS if n in rows]
        if llama:  # against llama.cpp's faster thread count in this run
            row["decode_vs_llama_cpp"] = row["decode_tps"] / max(llama)
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
    print(f"{'':22} {'decode':>8} {'prefill':>8} {'MB/token':>9} {'GB/s':>6} {'RSS MB':>7} "
          f"{'max err/std':>11} {'argmax':>6}")
    for name, row in rows.items():
        acc = row.get("accuracy", {})
        print(f"{name:22} {row['decode_tps']:8.1f} {row['prefill_tps']:8.1f} "
              f"{row['bytes_per_token'] / 1e6:9.0f} {row['achieved_gbs']:6.1f} {row['rss_mb']:7.0f} "
              f"{acc.get('max_error_over_std', float('nan')):11.2e} "
              f"{acc.get('argmax_agreement', float('nan')):6.3f}")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
