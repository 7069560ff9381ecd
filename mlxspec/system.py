"""``system_report()``: what mlxspec runs on — the machine (chip, GPU, memory, OS), MLX device,
BLAS, kernel path, default model. ``mlxspec doctor`` prints it; bug reports should attach it
(:func:`write_report`)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def system_report(measure: bool = True, check_kernels: bool = False) -> dict[str, Any]:
    """Platform, machine, MLX device, BLAS in use (with measured GFLOP/s when ``measure``) and
    the quantized-matmul path; with ``check_kernels``, every Metal kernel checked against a
    float32 reference and timed (on a Mac, or emulated under ``MLXSPEC_KERNELS=emulate``).

    Never raises for a missing piece: a part that cannot be inspected is reported as such.
    """
    import mlx.core as mx

    from mlxspec import __version__, cpu
    from mlxspec.load import default_model_path

    facts = machine()
    report: dict[str, Any] = {
        "mlxspec": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "os": facts.pop("os"),
        "cpu": facts.pop("chip"),  # on a Mac the chip (sysctl): there is no /proc/cpuinfo
        **facts,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        **cpu.report(measure=measure),
    }
    try:
        from mlxspec.gguf import tensors as gguf_quant
        from mlxspec.quant import kernels, layers

        report["quantized_matmul"] = kernels.describe()
        report["zero_point_layers"] = layers.describe()
        report["gguf_weights"] = gguf_quant.describe()
        report["gguf_dtype"] = _gguf_dtype()
    except Exception as e:  # noqa: BLE001  (reported, not raised: doctor diagnoses)
        report["quantized_matmul"] = f"unavailable ({e})"
    try:
        report["default_model"] = str(default_model_path())
    except Exception as e:  # noqa: BLE001
        report["default_model"] = f"missing: {e}"
    report["distributed"] = _group()
    if mx.metal.is_available():
        report["wired_limit"] = wired_limit_check()
    if check_kernels:
        from mlxspec.quant.kernel_check import check_on_device

        # the default model in the dtype a GGUF import gets on Metal, against float32
        try:
            report["default_model_dtype"] = model_dtype_check()
        except Exception as e:  # noqa: BLE001  (reported, not raised)
            report["default_model_dtype"] = {"ok": False, "error": str(e).strip().splitlines()[0]}
        report["kernel_check"] = check_on_device()
    return report


DTYPE_CHECK_PROMPT = "Explain in two sentences why the sky is blue."


def model_dtype_check(model=None, tokenizer=None, tokens: int | None = None) -> dict:
    """The default model in the dtype a GGUF import gets on Metal
    (:func:`mlxspec.gguf.dtype.conversion_dtype`: float16) against the same weights in float32:
    the activations' dtype, the prompt logits' error, greedy agreement over ``tokens`` tokens and
    the decode step time of both (``mlxspec doctor --kernels``; what only a Mac can measure).

    On a CPU the float32 conversion is cast to that dtype first: quality only, the times are not
    a GPU's (the report says so). ``model``/``tokenizer``: default, the default model;
    ``tokens``: default 16 on Metal, 4 on a CPU (where float16 is slow).
    """
    import mlx.core as mx

    from mlxspec.gguf.dtype import METAL_DTYPES
    from mlxspec.load import load
    from mlxspec.quant.kernel_timing import TOLERANCE, relative_error

    metal = mx.metal.is_available()
    # On a CPU the check is about dtypes, not kernels: MLX's own products even under
    # MLXSPEC_KERNELS=emulate (emulating the 49152-row head takes seconds per token).
    with _environment({} if metal else {"MLXSPEC_KERNELS": "mlx"}):
        if model is None:
            model, tokenizer = load()
        tokens = tokens or (16 if metal else 4)
        half = getattr(mx, METAL_DTYPES["llama"])
        _cast(model, half)  # a no-op for a Metal conversion (already half)
        prompt = tokenizer.encode(DTYPE_CHECK_PROMPT)
        got = _greedy_timed(model, prompt, tokens)
        _cast(model, mx.float32)  # exact: the same numbers, computed in float32
        want = _greedy_timed(model, prompt, tokens)
    pairs = zip(got["tokens"], want["tokens"], strict=True)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), tokens)
    error = relative_error(got["logits"], want["logits"])
    report = {
        "activations": got["dtype"],
        "prompt_logits_max_rel_error": error,
        "greedy_tokens_equal_to_float32": f"{agree}/{tokens}",
        "decode_ms_per_token": round(got["ms"], 2),
        "float32_decode_ms_per_token": round(want["ms"], 2),
        "speedup": round(want["ms"] / got["ms"], 2),
        "ok": bool(got["dtype"] == str(half).split(".")[-1] and got["finite"] and agree >= 1
                   and error <= TOLERANCE[half] * 5),  # a whole forward, not one product
    }
    if not metal:
        report["note"] = ("a CPU: the float32 conversion cast down, quality only; the times are "
                          "not a GPU's")
    return report


def _group() -> dict[str, Any] | str:
    """The process group when ``mlx.launch`` started this process (backend, world size, rank),
    else one line saying it runs alone."""
    if not any(os.environ.get(v) for v in ("MLX_HOSTFILE", "MLX_IBV_DEVICES",
                                           "OMPI_COMM_WORLD_SIZE")):
        return ("one process (mlx.launch ... mlxspec generate|chat|serve|batch|bench "
                "--shard tensor|pipeline: docs/distributed.md)")
    try:
        from mlxspec.distributed import group_report

        return group_report()
    except Exception as e:  # noqa: BLE001  (reported, not raised)
        return f"unavailable ({str(e).strip().splitlines()[0]})"


def _cast(model, dtype) -> None:
    """Every floating-point parameter to ``dtype``, and the rows zero-point embeddings return
    (an attribute, which ``set_dtype`` does not reach)."""
    from mlxspec.quant.layers import ZeroPointEmbedding

    model.set_dtype(dtype)
    for module in model.modules():
        if isinstance(module, ZeroPointEmbedding):
            module.dtype = dtype


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Within the block, these environment variables have these values."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _greedy_timed(model, prompt: list[int], tokens: int) -> dict:
    """Greedy decoding of ``tokens`` tokens: the tokens, the prompt's last logits, their dtype,
    whether every logit was finite, and the median decode step in milliseconds."""
    import time

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    first, finite, out, times = logits, True, [], []
    for _ in range(tokens):
        token = mx.argmax(logits)
        finite = finite and bool(mx.isfinite(logits).all().item())
        out.append(int(token.item()))
        start = time.perf_counter()
        logits = model(token.reshape(1, 1), cache=cache)[0, -1]
        mx.eval(logits)
        times.append(time.perf_counter() - start)
    return {"tokens": out, "logits": first, "dtype": str(first.dtype).split(".")[-1],
            "finite": finite, "ms": float(np.median(times)) * 1e3}


def machine() -> dict[str, Any]:
    """``os`` (name and version: macOS 14.5, a Linux distribution), ``chip`` (the CPU's or Apple
    chip's name), ``memory_gb`` (physical memory) and, from ``mx.device_info()``, the device:
    on a Mac the GPU's name, architecture and recommended working set."""
    import mlx.core as mx

    facts: dict[str, Any] = {"os": _os_name(), "chip": _chip(), "memory_gb": _memory_gb()}
    try:
        info = mx.device_info()  # not mx.metal.device_info(): deprecated in MLX 0.32
    except Exception as e:  # noqa: BLE001
        info = {"error": str(e)}
    if mx.metal.is_available():
        facts["gpu"] = f"{info.get('device_name', '?')} ({info.get('architecture', '?')})"
        if "max_recommended_working_set_size" in info:
            facts["gpu_working_set_gb"] = round(info["max_recommended_working_set_size"] / 1e9, 2)
    facts["device_info"] = {k: v for k, v in info.items() if isinstance(v, (int, float, str))}
    return facts


def wired_limit_check() -> str:
    """One line: MLX's wired-memory limit can be set and given back (the serving engines set it
    and restore it in the reverse order; only a Mac has one)."""
    import mlx.core as mx

    try:
        recommended = int(mx.device_info()["max_recommended_working_set_size"])
        before = mx.set_wired_limit(recommended)
        seen = mx.set_wired_limit(before)
    except Exception as e:  # noqa: BLE001
        return f"cannot be set: {str(e).strip().splitlines()[0]}"
    state = "ok" if seen == recommended else f"FAILED: set {recommended}, read back {seen}"
    return f"set and restored {state} (recommended {recommended / 1e9:.1f} GB, was {before})"


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write ``report`` as one JSON file (to attach to an issue), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _gguf_dtype() -> str:
    """One line: the dtype GGUF imports are converted to here, per architecture."""
    from mlxspec.gguf.dtype import DTYPE_ENV, METAL_DTYPES, conversion_dtype

    chosen = ", ".join(f"{name} {conversion_dtype(name)}" for name in METAL_DTYPES)
    why = (f"{DTYPE_ENV}" if os.environ.get(DTYPE_ENV) else "Metal: half activations where "
           "the GGUF's float16 scales allow" if _metal() else "a CPU: float32 BLAS")
    return f"{chosen} ({why}; doctor --kernels compares float16 with float32)"


def _metal() -> bool:
    import mlx.core as mx

    return bool(mx.metal.is_available())


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _os_name() -> str:
    if platform.system() == "Darwin":
        return f"macOS {platform.mac_ver()[0]}"
    try:
        return platform.freedesktop_os_release().get("PRETTY_NAME", platform.platform())
    except OSError:
        return platform.platform()


def _chip() -> str:
    if platform.system() == "Darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.machine()
    from mlxspec import cpu

    return cpu.cpu_model()


def _memory_gb() -> float | None:
    if platform.system() == "Darwin":
        value = _sysctl("hw.memsize")
        return round(int(value) / 1e9, 1) if value.isdigit() else None
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None
