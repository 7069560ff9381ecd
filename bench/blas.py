"""MLX's CPU backend on its reference BLAS vs OpenBLAS (mlxspec.cpu.blas), side by side.

Each BLAS choice runs in its own subprocess (the choice is made before ``mlx.core`` is imported):
``MLXSPEC_BLAS=reference``, the default (OpenBLAS on the cores not already busy, see
``mlxspec.cpu.blas.default_threads``, with the shim's own kernel for products of 1-24 rows), the same
with every product sent to OpenBLAS's sgemm (``MLXSPEC_SKINNY=0``), with the shim's AVX2 kernel
where the CPU has AVX-512 (``MLXSPEC_SKINNY=avx2``), with products of 9 rows and more sent to
sgemm (``MLXSPEC_SKINNY_ROWS=8``), and OpenBLAS on every core.
``--repeats N`` takes the columns in turns N times and reports medians. Measured in each (with
the 1-minute load average, since other processes on the machine skew every timing):

- float32 matmul GFLOP/s (512^2, 1024^2) and memory bandwidth (large copy and sum, GB/s), the
  roofline for decoding (decode bandwidth / read bandwidth);
- one 576x1536 layer (SmolLM2-135M's MLP) at M=1..8 tokens: float32 (BLAS), bfloat16 and
  4/8-bit ``quantized_matmul`` (neither uses BLAS), microseconds per layer;
- a model in float32 (quantized layers are de-quantized, since only float32 uses BLAS): prefill
  tok/s, decode tok/s through mlx-lm's ``generate_step``, the cost of one forward over M=1..32
  new tokens (what a speculative verify step or a short prefill pays; a batch step over M rows
  multiplies the same shapes), and decode bandwidth (weight bytes x tok/s).

    python bench/blas.py                      # default model (mlxspec.load)
    python bench/blas.py path/to/mlx_model --json
    python bench/blas.py --random-model       # random weights with SmolLM2-135M's shapes
    OPENBLAS_NUM_THREADS=2 python bench/blas.py --skip-reference --repeats 5 --json

The model is an MLX/Hugging Face directory or anything ``mlxspec.load`` accepts. Without one, or
if loading fails, a randomly initialised model with SmolLM2-135M's shapes stands in (the label
says so): speed does not depend on the weights' values.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import click

SMOLLM2_135M = dict(
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)

# Columns: name and environment. By default OpenBLAS runs on the cores not already busy
# (mlxspec.cpu.blas.default_threads); the last column gives it every core.
COLUMNS = (
    ("reference", {"MLXSPEC_BLAS": "reference"}),
    ("openblas", {}),
    ("openblas_sgemm_only", {"MLXSPEC_SKINNY": "0"}),  # without the shim's skinny products
    ("openblas_avx2_kernel", {"MLXSPEC_SKINNY": "avx2"}),  # its AVX2 kernel where AVX-512 runs
    ("openblas_kernel_8_rows", {"MLXSPEC_SKINNY_ROWS": "8"}),  # 9 rows and more to sgemm
    ("openblas_all_cores", {"OPENBLAS_NUM_THREADS": str(len(os.sched_getaffinity(0)))}),
)


def measure_matmul(sizes=(512, 1024)) -> dict:
    """float32 (n, n) @ (n, n) GFLOP/s, best of 5."""
    from mlxspec.cpu.blas_info import measure_matmul_gflops

    return {f"matmul_{n}_gflops": round(measure_matmul_gflops(n), 1) for n in sizes}


def measure_memory_bandwidth(megabytes: int = 256) -> dict:
    """GB/s of copying (bytes read + written) and summing (bytes read) a large array: numpy,
    BLAS-independent, so the columns differ only by noise (other processes on the machine)."""
    from mlxspec.benchmark import memory_bandwidth, read_bandwidth

    return {"memcpy_gbs": round(memory_bandwidth(megabytes), 1),
            "read_gbs": round(read_bandwidth(megabytes), 1)}


def measure_layer(tokens=(1, 2, 4, 8), n_layers: int = 30) -> dict:
    """Microseconds per (M, 576) @ (576, 1536) layer, float32 / bfloat16 / 4-bit / 8-bit.

    ``n_layers`` distinct weights per timing (~106 MB in float32), like one decode step through
    the model, so the weights come from memory rather than cache.
    """
    import mlx.core as mx

    from mlxspec.benchmark import best_seconds

    weights = [mx.random.normal((1536, 576)) for _ in range(n_layers)]
    variants = {"float32": lambda x, w: x @ w.T}
    bf16 = [w.astype(mx.bfloat16) for w in weights]
    variants["bfloat16"] = lambda x, i: x.astype(mx.bfloat16) @ bf16[i].T
    quantized = {
        bits: [mx.quantize(w, group_size=64, bits=bits) for w in weights] for bits in (4, 8)
    }
    for bits, layers in quantized.items():
        variants[f"q{bits}"] = lambda x, i, layers=layers, bits=bits: mx.quantized_matmul(
            x, *layers[i], transpose=True, group_size=64, bits=bits
        )
    mx.eval(weights, bf16, quantized)
    result = {}
    for m in tokens:
        x = mx.random.normal((m, 576))
        for name, layer in variants.items():
            arg = (lambda i: weights[i]) if name == "float32" else (lambda i: i)

            def step(layer=layer, arg=arg, x=x):
                mx.eval([layer(x, arg(i)) for i in range(n_layers)])

            seconds = best_seconds(step, 3)
            result[f"layer_{name}_m{m}_us"] = round(seconds / n_layers * 1e6, 1)
    return result


def load_float32_model(spec: str | None, random_model: bool):
    """(model, vocab size, label) in float32; random SmolLM2-135M shapes if loading fails."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    if not random_model:
        try:
            import mlxspec

            model, _tokenizer = mlxspec.load(spec)
            dequantize_model(model)
            model.set_dtype(mx.float32)
            return model, model.args.vocab_size, str(spec or "default model")
        except Exception as e:  # the benchmark still says what BLAS does with a stand-in
            if spec is not None:
                raise
            print(f"default model unavailable ({e}); using random weights", file=sys.stderr)
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**SMOLLM2_135M))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, SMOLLM2_135M["vocab_size"], "random weights, SmolLM2-135M shapes"


def measure_model(model, vocab_size: int, prompt_tokens: int, decode_tokens: int) -> dict:
    """Prefill and decode tok/s, forward cost over M new tokens, decode bandwidth."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlxspec.benchmark import achieved_bandwidth, best_seconds, model_bytes

    mx.random.seed(1)
    prompt = mx.random.randint(0, vocab_size, (prompt_tokens,))
    weight_bytes = model_bytes(model)

    def prefill():
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[None], cache=cache))
        return cache

    prefill_seconds = best_seconds(prefill, 2)

    times = []
    for _ in generate_step(prompt, model, max_tokens=decode_tokens):
        times.append(time.perf_counter())
    decode_tps = (len(times) - 1) / (times[-1] - times[0])

    cache = prefill()
    new_tokens = mx.random.randint(0, vocab_size, (1, 32))
    forward_ms = {}
    for m in (1, 2, 4, 8, 12, 16, 24, 32):
        samples = []
        for _ in range(6):
            start = time.perf_counter()
            mx.eval(model(new_tokens[:, :m], cache=cache))
            samples.append(time.perf_counter() - start)
            trim_prompt_cache(cache, m)
        forward_ms[m] = statistics.median(samples[1:]) * 1e3
    return {
        "weight_mb": round(weight_bytes / 1e6, 1),
        "prefill_tokens": prompt_tokens,
        "prefill_tps": round(prompt_tokens / prefill_seconds, 1),
        "decode_tps": round(decode_tps, 2),
        "decode_gbs": round(achieved_bandwidth(weight_bytes, decode_tps), 2),
        **{f"forward_m{m}_ms": round(ms, 1) for m, ms in forward_ms.items()},
    }


def run_worker(spec, random_model, prompt_tokens, decode_tokens, skip_model) -> dict:
    from mlxspec.cpu import blas, blas_info

    blas.setup()
    report = blas_info.blas_report(measure=False)
    keys = ("active", "library", "config", "threads", "skinny_products")
    result = {"blas": {k: report.get(k) for k in keys}}
    result.update(measure_matmul())
    result.update(measure_memory_bandwidth())
    result.update(measure_layer())
    if not skip_model:
        model, vocab_size, label = load_float32_model(spec, random_model)
        result["model"] = label
        result.update(measure_model(model, vocab_size, prompt_tokens, decode_tokens))
        if "read_gbs" in result:
            from mlxspec.benchmark import roofline

            result["decode_roofline"] = round(roofline(result["decode_gbs"], result["read_gbs"]), 2)
    return result


def _median_round(runs: list[dict]) -> dict:
    """Each number's median over the rounds (other values from the first round)."""
    out = dict(runs[0])
    for key, value in out.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = round(statistics.median(r[key] for r in runs), 3)
    out["rounds"] = len(runs)
    return out


def _speedup(key: str, reference, optimized) -> float | None:
    """optimized vs reference, > 1 is better: a ratio of rates, or the inverse ratio of times."""
    if not isinstance(reference, (int, float)) or not isinstance(optimized, (int, float)):
        return None
    if not reference or not optimized or key.endswith(("_mb", "_tokens", "load_average")):
        return None
    ratio = reference / optimized if key.endswith(("_ms", "_us")) else optimized / reference
    return round(ratio, 2)


@click.command()
@click.argument("model", required=False)
@click.option("--random-model", is_flag=True, help="Random weights with SmolLM2-135M's shapes.")
@click.option("--no-model", is_flag=True, help="Only matmul, bandwidth and layer timings.")
@click.option("--prompt-tokens", default=128, show_default=True)
@click.option("--decode-tokens", default=32, show_default=True)
@click.option("--repeats", default=1, show_default=True,
              help="Rounds of every column, taken in turns; each number is the median of its "
              "rounds (this machine's timings drift by tens of percent between runs).")
@click.option("--skip-reference", is_flag=True, help="Leave out the slow reference-BLAS column.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--worker", is_flag=True, hidden=True)
def main(model, random_model, no_model, prompt_tokens, decode_tokens, repeats, skip_reference,
         as_json, worker):
    """MLX CPU speed on the reference BLAS vs OpenBLAS (Linux)."""
    args = (model, random_model, prompt_tokens, decode_tokens, no_model)
    if worker:
        result = {"load_average": round(os.getloadavg()[0], 2)}  # other processes skew timings
        print(json.dumps(result | run_worker(*args)))
        return
    options = ["--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode_tokens)]
    options += ["--random-model"] * random_model + ["--no-model"] * no_model + [model] * bool(model)
    columns = COLUMNS[1:] if skip_reference else COLUMNS
    rounds = {name: [] for name, _ in columns}
    for round_ in range(repeats):
        for name, column_env in columns:
            env = {k: v for k, v in os.environ.items() if k not in ("MLXSPEC_BLAS", *column_env)}
            print(f"measuring {name} (round {round_ + 1} of {repeats}) ...", file=sys.stderr)
            output = subprocess.run(
                [sys.executable, __file__, "--worker", *options],
                env=env | column_env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            rounds[name].append(json.loads(output.strip().splitlines()[-1]))
    results = {name: _median_round(runs) for name, runs in rounds.items()}
    names = [name for name, _ in columns]
    reference = results[names[0]]
    speedup = f"speedup_vs_{names[0]}"  # the reference BLAS unless --skip-reference
    results[speedup] = {
        name: {
            k: ratio
            for k, value in results[name].items()
            if (ratio := _speedup(k, reference.get(k), value)) is not None
        }
        for name in names[1:]
    }
    if as_json:
        print(json.dumps(results, indent=2))
        return
    for name in names:
        print(f"{name}: {results[name]['blas']}")
    if "model" in reference:
        print(f"model: {reference['model']} (float32)")
    print(f"{'metric':<26}" + "".join(f"{name:>22}" for name in names))
    for key, value in reference.items():
        if key in ("blas", "model"):
            continue
        cells = [f"{value!s:>22}"]
        for name in names[1:]:
            ratio = results[speedup][name].get(key)
            cell = f"{results[name].get(key)!s}" + (f" ({ratio}x)" if ratio else "")
            cells.append(f"{cell:>22}")
        print(f"{key:<26}" + "".join(cells))


if __name__ == "__main__":
    main()
