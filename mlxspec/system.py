"""``system_report()``: what mlxspec runs on — the machine (chip, GPU, memory, OS), MLX device,
BLAS, kernel path, default model. ``mlxspec doctor`` prints it; bug reports should attach it
(:func:`write_report`)."""

from __future__ import annotations

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
    except Exception as e:  # noqa: BLE001  (reported, not raised: doctor diagnoses)
        report["quantized_matmul"] = f"unavailable ({e})"
    try:
        report["default_model"] = str(default_model_path())
    except Exception as e:  # noqa: BLE001
        report["default_model"] = f"missing: {e}"
    if mx.metal.is_available():
        report["wired_limit"] = wired_limit_check()
    if check_kernels:
        from mlxspec.quant.kernel_check import check_on_device

        report["kernel_check"] = check_on_device()
    return report


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
