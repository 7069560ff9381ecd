"""``quantize_to_dir``: quantize a model, save it, evaluate it against its source, judge it and
optionally upload it — the whole ``mlxspec quantize`` flow as one library call, as mlx-lm's
``convert()`` is for ``mlx_lm.convert``.

Everything that can be checked without the model is checked before the (slow) load: the bit
width and group size, the method and format options, the recipe, the calibration file, the
source's config (already quantized?), and the output directory (:func:`check_output_dir`: never
the source, the reference or the working directory, nor inside or above them; writable; room for
the weights). A run that fails leaves nothing behind: the directory is written under a temporary
name and renamed at the end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlxspec.errors import OutputExistsError, QuantizationError

ModelSpec = str | Path | None  # a Hub repo id, a model directory, a .gguf file; None: the default
# The most accurate single-pass method in every cell of bench/quantized.py's comparison, at
# about twice GPTQ's time (SmolLM2 4-bit g64: 204 s against 123 s,
# bench/results/quantized_smollm2.jsonl).
DEFAULT_METHOD = "awq+gptq"


@dataclass
class QuantizeReport:
    """What :func:`quantize_to_dir` did; filled in step by step (see its ``on_step``)."""

    out_dir: Path
    source: str  # what config.json records as the source: "default", a path or a Hub id
    method: str
    bits: int
    group_size: int
    output_format: str
    quantization: dict[str, Any] = field(default_factory=dict)  # config.json["quantization"]
    mixed: str | None = None  # description of the chosen mixed-precision recipe, if any
    weight_bytes: int = 0  # bytes of the written safetensors
    evaluation: dict[str, Any] | None = None  # the stored mlxspec_eval.json record
    url: str | None = None  # where it was uploaded

    @property
    def passed(self) -> bool | None:
        """The quality gate's verdict (None when it did not run)."""
        return None if self.evaluation is None else bool(self.evaluation["verdict"]["passed"])

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out_dir": str(self.out_dir), "passed": self.passed}


def quantize_to_dir(
    model: ModelSpec,
    out_dir: str | Path,
    *,
    bits: int = 4,
    group_size: int = 64,
    method: str | None = None,
    output_format: str = "mlx",
    dtype: str | None = None,
    recipe: str | dict | None = None,
    group_fallback: bool = False,
    act_order: bool = False,
    calibration: str | Path | None = None,
    calibration_windows: int | None = None,
    calibration_tokens: int | None = None,
    distill_epochs: int = 0,
    force: bool = False,
    evaluate: bool = True,
    reference: ModelSpec = None,
    thresholds: dict[str, float | None] | None = None,
    upload_repo: str | None = None,
    private: bool = False,
    force_upload: bool = False,
    progress: bool = True,
    on_step: Callable[[str, QuantizeReport], None] | None = None,
) -> QuantizeReport:
    """Quantize ``model`` to ``bits`` bits and write it to ``out_dir``; then (``evaluate``)
    compare it with its source on held-out text, judge it and store the verdict beside it
    (``mlxspec_eval.json``); then (``upload_repo``) upload it with a model card.

    Args:
        model: the unquantized source (Hub repo id, directory, .gguf; None: the default model).
        out_dir: the directory to create (replaced only with ``force``, and only if it is empty
            or a model directory mlxspec wrote).
        bits, group_size: see :mod:`mlxspec.quant.zp_format`.
        method: ``"rtn"``, ``"gptq"``, ``"awq"`` or ``"awq+gptq"``; None: ``"awq+gptq"`` (the
            most accurate; ``"gptq"`` with ``act_order``, which only GPTQ has).
        output_format: ``"mlx"`` (MLX affine, exact; plain mlx-lm loads it) or ``"zp"``
            (mlxspec zero-point, for what affine cannot express: act-order).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` for the scales, biases and
            unquantized parameters; None keeps the source's.
        recipe: mixed precision: a recipe dict, a JSON file or shipped name, or ``"auto"`` /
            ``"auto:BPW"`` to measure each kind of layer's sensitivity.
        group_fallback: layers whose width ``group_size`` does not divide use a smaller group.
        act_order: GPTQ visits columns by decreasing activation (zp format only).
        calibration, calibration_windows, calibration_tokens: the calibration text of the
            calibrated methods and of distillation and how much of it to use; default the
            built-in multi-domain set (:mod:`mlxspec.quant.calibration_set`; with a chat share
            in its mix, the source model's own answers to built-in prompts, generated first).
        distill_epochs: then tune the scales by distillation from the source on the calibration
            text for this many epochs (:mod:`mlxspec.quant.distill`; 0: no distillation). The
            most accurate result, at many times the quantizer's time on a CPU.
        evaluate: run the quality gate (against ``reference``, default the source).
        thresholds: the gate's ``{"max_kl", "min_top1"}`` (None entries keep the defaults).
        upload_repo, private, force_upload: upload to this Hub repo (see :func:`mlxspec.publish.hub.upload`).
        progress: show progress bars.
        on_step: called with ``"quantized"``, ``"saved"``, ``"evaluated"``, ``"uploaded"`` and the
            report so far, as each step ends (the CLI prints from it).

    Raises:
        QuantizationError, OutputExistsError, EvaluationError, ...: every input error before the
        model loads.
    """
    from mlxspec.gguf.tensors import dense_conversion
    from mlxspec.load import default_model_path, load, read_config, resolve_model_path
    from mlxspec.quant import calibrate, storage
    from mlxspec.quant.quantize import CALIBRATED, quantize_model

    step = on_step or (lambda _name, _report: None)
    if method is None:
        method = "gptq" if act_order else DEFAULT_METHOD
    _check_options(bits, group_size, method, output_format, act_order)
    if distill_epochs < 0 or distill_epochs != int(distill_epochs):
        raise QuantizationError(f"distill_epochs must be a whole number >= 0, not {distill_epochs}")
    target_bpw = _auto_target(recipe, bits)
    if recipe is not None and target_bpw is None and not isinstance(recipe, dict):
        from mlxspec.quant.mixed import load_recipe

        recipe = load_recipe(recipe)
    if calibration is not None and not Path(calibration).is_file():
        raise QuantizationError(f"calibration text not found: {calibration}")
    # The output is checked against the local files as given (a .gguf, a directory) before
    # anything is converted or downloaded, then against what they resolved to (the cache).
    given = [("source", model), ("reference", reference if evaluate else None)]
    protected = [(what, Path(spec)) for what, spec in given
                 if spec is not None and spec != "default" and Path(spec).expanduser().exists()]
    check_output_dir(out_dir, protected=protected, force=force)
    # Room for the weights is checked now too when the source is local (a .gguf is sized from
    # its header), so a full disk fails before a GGUF is converted.
    local_source = default_model_path() if model in (None, "default") else Path(model).expanduser()
    if local_source.exists():
        check_output_dir(out_dir, protected=protected, force=force,
                         needed_bytes=_weight_count(local_source) * bits // 8)
    with dense_conversion():  # quantize from float weights, even where GGUFs import quantized
        model_dir = resolve_model_path(model)
    config = read_config(model_dir)
    if storage.quantization_record(config) is not None:
        raise QuantizationError(
            f"{model_dir} is already quantized: quantize its unquantized source instead"
        )
    reference_dir = None
    if evaluate and reference is not None:
        with dense_conversion():
            reference_dir = resolve_model_path(None if reference == "default" else reference)
        protected.append(("reference", reference_dir))
    protected.append(("source", model_dir))
    out = check_output_dir(out_dir, protected=protected, force=force,
                           needed_bytes=_weight_count(model_dir) * bits // 8)
    report = QuantizeReport(out_dir=out, source=_source_name(model), method=method, bits=bits,
                            group_size=group_size, output_format=output_format)

    nn_model, tokenizer = load(str(model_dir))
    extra: dict[str, Any] = {"source_model": report.source}
    n_windows = calibration_windows or calibrate.DEFAULT_CALIBRATION_WINDOWS
    n_tokens = calibration_tokens or calibrate.DEFAULT_CALIBRATION_TOKENS
    # The built-in set's chat domain is the float model's own answers: generated once, before
    # quantizing, for every use of the set below.
    conversations = None
    if calibration is None and (method in CALIBRATED or distill_epochs):
        from mlxspec.publish.self_calibration import generate_conversations
        from mlxspec.quant import calibration_set

        chat = calibration_set.DEFAULT_MIX.get("chat", 0) > 0  # on in the measured default
        if chat and getattr(tokenizer, "chat_template", None):
            prompts = (calibration_set.prompts() if distill_epochs else
                       calibration_set.chat_prompts_needed(n_windows, n_tokens))
            conversations = generate_conversations(nn_model, tokenizer, prompts,
                                                                   progress=progress)
    tokens = None
    if method in CALIBRATED:
        tokens, sha256 = calibrate.calibration_windows(
            tokenizer, calibration, windows=n_windows, window_tokens=n_tokens,
            conversations=conversations,
        )
        extra.update(
            calibration_sha256=sha256,
            calibration=(("builtin" if conversations is None else "builtin+self-generated")
                         if calibration is None else Path(calibration).name),
            calibration_windows=len(tokens),
            calibration_window_tokens=len(tokens[0]),
        )
    if distill_epochs:  # its windows are checked before the slow work
        from mlxspec.quant import distill

        windows, sha256 = calibrate.calibration_windows(
            tokenizer, calibration, windows=distill.MAX_WINDOWS,
            window_tokens=distill.WINDOW_TOKENS, conversations=conversations)
        distill.check_windows(windows)
    if target_bpw is not None:
        from mlxspec.quant.mixed import sensitivity_recipe

        probe, _ = calibrate.calibration_windows(tokenizer, calibration, windows=2, window_tokens=128)
        recipe = sensitivity_recipe(nn_model, probe, bits=bits, group_size=group_size,
                                    target_bpw=target_bpw, group_fallback=group_fallback)
        extra["sensitivity"] = recipe["sensitivity"]
        report.mixed = recipe["description"]
    nn_model, report.quantization = quantize_model(
        nn_model, bits=bits, group_size=group_size, method=method, calibration_tokens=tokens,
        recipe=recipe, act_order=act_order, group_fallback=group_fallback, progress=progress,
        **({"dtype": dtype} if dtype is not None else {}),
    )
    if distill_epochs:
        teacher, _ = load(str(model_dir))
        report.quantization["distillation"] = {
            **distill.distill_scales(nn_model, teacher, windows,
                                     dtype=report.quantization["dtype"], epochs=distill_epochs,
                                     progress=progress),
            "calibration_sha256": sha256,
        }
        del teacher
    step("quantized", report)
    storage.save_quantized(nn_model, out, config=config, quantization=report.quantization,
                     source_dir=model_dir, output_format=output_format, force=force, extra=extra)
    del nn_model  # the gate loads the model back from disk: what is judged is what was written
    report.weight_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    step("saved", report)
    if evaluate:
        from mlxspec.evaluation import evaluate_saved

        report.evaluation = evaluate_saved(
            out, reference=str(reference_dir or model_dir), thresholds=thresholds,
            progress=progress,
        )
        step("evaluated", report)
    if upload_repo:
        from mlxspec.publish.hub import upload

        report.url = upload(out, upload_repo, private=private, force=force_upload)
        step("uploaded", report)
    return report


def check_output_dir(
    out_dir: str | Path,
    *,
    protected: list[tuple[str, Path]],
    force: bool,
    needed_bytes: int = 0,
) -> Path:
    """Refuse an output directory that would lose data or cannot be written, before any work.

    Refused, with or without ``force``: a path equal to, inside or above a ``protected`` one
    (``[("source", path), ("reference", path)]``: what each is, for the message) or the working directory; an existing file; with ``force``, an
    existing directory that is neither empty nor a model directory mlxspec wrote; a parent that
    cannot be written (read-only, no permission) or lacks ``needed_bytes`` of free space.

    Returns:
        ``out_dir`` as an absolute Path.
    """
    out = Path(out_dir).expanduser().absolute()
    for what, path in protected:
        relation = _relation(out, Path(path))
        if relation:
            raise QuantizationError(
                f"--out {out_dir} is {relation} the {what} model {path}, which it would "
                "destroy: choose a new directory elsewhere"
            )
    if _relation(out, Path.cwd()) in ("the same as", "a parent of"):  # inside it is fine
        raise QuantizationError(
            f"--out {out_dir} is the working directory or above it: choose a new directory"
        )
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise OutputExistsError(f"{out} exists and is not a directory: choose another --out")
        if not force:
            raise OutputExistsError(f"{out} exists: pass --force to overwrite it")
        if any(out.iterdir()) and not _written_by_mlxspec(out):
            raise OutputExistsError(
                f"{out} is not a model directory mlxspec wrote: --force replaces only those; "
                "choose another --out"
            )
    parent = next(p for p in out.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise QuantizationError(f"cannot write to {parent}: choose a writable --out")
    try:
        probe = parent / f".mlxspec-write-test-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise QuantizationError(f"cannot write to {parent} ({e.strerror}): choose another --out") from e
    free = shutil.disk_usage(parent).free
    if free < needed_bytes:
        raise QuantizationError(
            f"{parent} has {free / 1e6:.0f} MB free, the model needs about "
            f"{needed_bytes / 1e6:.0f} MB: free some space or choose another --out"
        )
    return out


def _relation(out: Path, other: Path) -> str | None:
    """How ``out`` relates to ``other``: "the same as", "inside", "a parent of", or None."""
    out, other = out.resolve(), other.expanduser().resolve()
    if out == other:
        return "the same as"
    if out.is_relative_to(other):
        return "inside"
    if other.is_relative_to(out):
        return "a parent of"
    return None


def _written_by_mlxspec(path: Path) -> bool:
    """A model directory mlxspec saved: its config records mlxspec's quantization."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quantization = config.get("quantization") if isinstance(config, dict) else None
    return isinstance(quantization, dict) and "mlxspec_version" in quantization


def _check_options(bits, group_size, method, output_format, act_order) -> None:
    from mlxspec.quant import zp_format
    from mlxspec.quant.quantize import METHODS
    from mlxspec.quant.storage import FORMATS

    zp_format.check_spec(bits, group_size, group_size)
    if method not in METHODS:
        raise QuantizationError(f"unknown method {method!r}: choose {', '.join(METHODS)}")
    if output_format not in FORMATS:
        raise QuantizationError(f"unknown format {output_format!r}: choose zp or mlx")
    if act_order and output_format == "mlx":
        raise QuantizationError("--act-order needs --format zp: MLX's affine format cannot "
                                "express the column permutation")
    if act_order and method != "gptq":
        raise QuantizationError("--act-order applies to --method gptq only")


def _auto_target(recipe: str | dict | None, bits: int) -> float | None:
    """The bits-per-weight target of ``recipe="auto[:BPW]"``, or None for any other recipe."""
    if not isinstance(recipe, str) or not (recipe == "auto" or recipe.startswith("auto:")):
        return None
    if recipe == "auto":
        return bits + 0.5
    try:
        target = float(recipe[5:])
    except ValueError:
        target = float("nan")
    if not bits <= target <= 16:  # also refuses nan
        raise QuantizationError(
            f"--mixed {recipe}: give auto or auto:BPW with BPW between {bits} and 16, e.g. auto:4.6"
        )
    return target


def _source_name(model: ModelSpec) -> str:
    """What the config records as the source: "default", an absolute path, or a Hub id."""
    if model is None:
        return "default"
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def _weight_count(model_dir: Path) -> int:
    """Number of weights in the safetensors of ``model_dir`` or in a ``.gguf`` file (read from
    their headers)."""
    from mlxspec.errors import CorruptModelError, MlxspecError
    from mlxspec.publish.records import safetensors_header

    if model_dir.is_file() and model_dir.suffix == ".gguf":
        from mlxspec.gguf.reader import read_gguf

        try:
            return sum(math.prod(t.shape) for t in read_gguf(model_dir).tensors.values())
        except MlxspecError:
            return 0  # a damaged file: its conversion names the problem
    count = 0
    for path in model_dir.glob("*.safetensors"):
        try:
            header = safetensors_header(path)
        except CorruptModelError:
            continue  # loading it names the problem
        count += sum(math.prod(info["shape"]) for info in header.values())
    return count
