"""Quantized models on disk: the one reader of the ``quantization`` record, the loaders of the
zero-point format and of exact MLX affine models, and the saver.

Formats (``config.json["quantization"]["format"]``):

- ``"mlx"`` (default): MLX's affine layout (``weight``, ``scales``, ``biases`` in the model's
  dtype), plain mlx-lm ``quantization`` config. mlxspec's quantizers make it an exact encoding of
  ``s * (q - z)`` (:mod:`mlxspec.quant.zp_format`), so every MLX tool runs the same weights, and
  mlxspec recovers the integer zero-points on load (:func:`adopt_zero_points`) for its own kernels
  and CPU policy.
- ``"zp"``: mlxspec's zero-point layout (integer ``zeros``), for what cannot be exact in MLX's
  layout (act-order, imported GPTQ/AWQ checkpoints with arbitrary scales): mlxspec loads it,
  plain mlx-lm cannot. The record's ``reason`` says why.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlxspec.errors import CorruptModelError, OutputExistsError, QuantizationError
from mlxspec.quant import zp_format
from mlxspec.quant.layers import (
    MLX_QUANTIZED_LAYERS,
    ZeroPointEmbedding,
    ZeroPointLinear,
    replace_modules,
    zero_point_from_affine,
    zero_point_modules,
)

ZP_FORMAT = "zp"
MLX_FORMAT = "mlx"
FORMATS = (MLX_FORMAT, ZP_FORMAT)
# Files copied from the source model directory next to the quantized weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


# -- the quantization record -----------------------------------------------------------------


def quantization_record(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization`` entry of a ``config.json`` dict (mlx-lm's key, else Hugging Face's
    ``quantization_config``), or None for an unquantized model."""
    q = config.get("quantization") or config.get("quantization_config")
    return q if isinstance(q, dict) else None


def is_zero_point_config(config: dict[str, Any]) -> bool:
    """True for a model saved in mlxspec's zero-point zp_format."""
    q = config.get("quantization")
    return isinstance(q, dict) and q.get("format") == ZP_FORMAT


def mlx_lm_loadable(config: dict[str, Any]) -> tuple[bool, str]:
    """Whether plain mlx-lm (and every MLX tool reading its layout) loads this model, and why.

    Returns ``(loadable, reason)``: one sentence for a model card.
    """
    q = quantization_record(config)
    if q is None:
        return True, "unquantized weights"
    fmt = q.get("format")
    if fmt == ZP_FORMAT:
        why = q.get("reason") or "integer zero-points in mlxspec's own layout"
        return False, f"mlxspec zero-point format ({why}): only mlxspec loads it"
    if "quant_method" in q and "quantization" not in config:
        return False, f"a {q['quant_method']} checkpoint: mlx-lm does not load it, mlxspec does"
    if q.get("exact"):
        return True, (f"MLX affine layout, {q['exact']} scales and biases: an exact encoding of "
                      "s * (q - z), loaded bit for bit by mlx-lm and other MLX tools")
    return True, "MLX affine layout: loaded by mlx-lm and other MLX tools"


def activation_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The model's float dtype, read from its unquantized float weights (norms, biases)."""
    for key, value in weights.items():
        if mx.issubdtype(value.dtype, mx.floating) and not key.endswith(".scales"):
            return value.dtype
    return mx.float32


def swap_in_zero_point(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Replace each ``nn.Linear``/``nn.Embedding`` whose weights are zero-point in ``weights``
    (``<path>.zeros`` present) by a zero-point layer of the shapes those arrays imply."""
    dtype = activation_dtype(weights)
    new = {}
    for path, module in model.named_modules():
        if f"{path}.zeros" not in weights or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        out_features, in_features = module.weight.shape
        packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
        bits = packed.shape[-1] * 32 // in_features
        group_size = in_features // max(scales.shape[-1], 1)
        if packed.shape[-1] * 32 != bits * in_features or scales.shape[-1] * group_size != (
            in_features
        ):
            raise CorruptModelError(
                f"{path}: packed weight {tuple(packed.shape)} / scales {tuple(scales.shape)} "
                f"do not fit a {out_features}x{in_features} layer: the checkpoint is corrupt"
            )
        try:
            if isinstance(module, nn.Embedding):
                new[path] = ZeroPointEmbedding(
                    out_features, in_features, bits=bits, group_size=group_size, dtype=dtype
                )
            else:
                new[path] = ZeroPointLinear(
                    in_features, out_features, "bias" in module, bits=bits,
                    group_size=group_size, permuted=f"{path}.perm" in weights,
                )
        except QuantizationError as e:
            raise CorruptModelError(f"{path}: {e}") from e
    replace_modules(model, new)


# -- loading the zero-point format ------------------------------------------------------------


def read_safetensors(model_dir: Path) -> dict[str, mx.array]:
    """Every tensor of the directory's ``model*.safetensors`` files."""
    files = sorted(Path(model_dir).glob("model*.safetensors"))
    if not files:
        raise CorruptModelError(f"{model_dir} has no model*.safetensors weights")
    weights = {}
    for file in files:
        weights.update(mx.load(str(file)))
    return weights


def build_model(model_dir: Path, config: dict, weights: dict[str, mx.array], lazy: bool):
    """The mlx-lm model for ``config`` holding ``weights`` (zero-point layers where the weights
    are zero-point), loaded strictly."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    swap_in_zero_point(model, weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    return model


def load_zero_point(model_dir: Path, config: dict, lazy: bool) -> nn.Module:
    """Loader of the ``zp`` weight format (see :mod:`mlxspec.load`)."""
    from mlx_lm.utils import load_config

    return build_model(model_dir, load_config(Path(model_dir)), read_safetensors(model_dir), lazy)


def load_affine(model_dir: Path, config: dict, lazy: bool, trust_remote_code: bool = False):
    """Load an MLX (affine or unquantized) model with mlx-lm, then :func:`adopt_zero_points`."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir), lazy=lazy, trust_remote_code=trust_remote_code)
    return adopt_zero_points(model)


def adopt_zero_points(model: nn.Module) -> nn.Module:
    """Replace each MLX affine layer whose biases are ``-scale * z`` for integer ``z`` by its
    zero-point twin (same packed weight and scales; :func:`layers.zero_point_from_affine`), so
    mlxspec's kernels and CPU policy run it. Other layers stay as they are."""
    new = {}
    for path, module in model.named_modules():
        if isinstance(module, MLX_QUANTIZED_LAYERS):
            twin = zero_point_from_affine(module)
            if twin is not None:
                new[path] = twin
    replace_modules(model, new)
    return model


# -- saving -----------------------------------------------------------------------------------


def to_mlx_affine_model(model: nn.Module) -> nn.Module:
    """Replace every zero-point layer by MLX's own ``nn.QuantizedLinear``/``QuantizedEmbedding``
    holding the affine form in the scales' dtype, so mlx-lm loads the saved model and computes
    the same numbers.

    Raises QuantizationError for layers the affine layout cannot hold exactly in their dtype
    (act-order, scales not from mlxspec's quantizers): save those with ``--format zp``.
    """
    new = {}
    for path, layer in zero_point_modules(model).items():
        if "perm" in layer:
            raise QuantizationError(
                f"{path} was quantized with act-order, which MLX's affine format cannot express: "
                "save it with --format zp, or quantize without --act-order"
            )
        if not zp_format.scales_are_exact(layer.scales, layer.bits):
            raise QuantizationError(
                f"{path}: its {zp_format.dtype_name(layer.scales.dtype)} scales do not make MLX's "
                "affine layout exact: save it with --format zp"
            )
        weight, scales, biases = zp_format.to_mlx_affine(
            layer.weight, layer.scales, layer.zeros, layer.bits, layer.group_size
        )
        if isinstance(layer, ZeroPointEmbedding):
            affine = nn.QuantizedEmbedding(
                layer.num_embeddings, layer.dims, group_size=layer.group_size, bits=layer.bits
            )
        else:
            affine = nn.QuantizedLinear(
                layer.in_features, layer.out_features, "bias" in layer,
                group_size=layer.group_size, bits=layer.bits,
            )
            if "bias" in layer:
                affine.bias = layer.bias
        affine.weight, affine.scales, affine.biases = weight, scales, biases
        new[path] = affine
    replace_modules(model, new)
    return model


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every unquantized float parameter (norms, biases, float layers) to ``dtype``; the
    quantized layers' arrays are left as they are (their scales already have ``dtype``)."""
    quantized = {id(m) for _, m in model.named_modules()
                 if isinstance(m, MLX_QUANTIZED_LAYERS + (ZeroPointLinear, ZeroPointEmbedding))}
    for _, module in model.named_modules():
        if id(module) in quantized:
            if isinstance(module, ZeroPointEmbedding):
                module.dtype = dtype
            if "bias" in module:
                module.bias = module.bias.astype(dtype)
            continue
        params = module.parameters()
        local = {k: v for k, v in params.items() if isinstance(v, mx.array)}
        module.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating)
                               else a, local))


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's first float parameter that is not a quantization scale."""
    for name, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating) and not name.endswith((".scales", ".biases")):
            return value.dtype
    return mx.float32


def save_quantized(
    model: nn.Module,
    out_dir: str | Path,
    *,
    config: dict[str, Any],
    quantization: dict[str, Any],
    source_dir: str | Path | None = None,
    output_format: str = MLX_FORMAT,
    force: bool = False,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a quantized model directory atomically (a temporary sibling, then a rename).

    Args:
        model: a model quantized by :func:`mlxspec.quant.quantize.quantize_model`. With
            ``output_format="mlx"`` it is converted in place to MLX affine layers (exact, biases
            ``-s*z`` in the scales' dtype; QuantizationError where that cannot be exact).
        out_dir: the directory to create.
        config: the source model's ``config.json`` dict.
        quantization: what :func:`quantize_model` returned.
        source_dir: copy the tokenizer, chat template and generation config from here.
        output_format: ``"mlx"`` (MLX affine, exact; loaded by plain ``mlx_lm.load`` and every
            MLX tool) or ``"zp"`` (mlxspec zero-point, loaded by ``mlxspec.load`` only).
        force: replace an existing ``out_dir``.
        extra: more keys for ``config["quantization"]`` (``source_model``, ``calibration_sha256``).

    Returns:
        ``out_dir`` as a Path.
    """
    from mlx_lm.utils import save_model

    if output_format not in FORMATS:
        raise QuantizationError(f"unknown format {output_format!r}: choose zp or mlx")
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise OutputExistsError(f"{out_dir} exists: pass --force to overwrite it")
    record = {**quantization, **(extra or {}), "format": output_format}
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    dtype = zp_format.dtype_name(model_dtype(model))
    config["torch_dtype"] = dtype
    if output_format == MLX_FORMAT:
        to_mlx_affine_model(model)
        record["mode"] = "affine"
        record["exact"] = dtype  # scales and biases in this dtype encode s * (q - z) exactly
        for path, spec in record.pop("layers").items():
            record[path] = False if spec is None else {**spec, "mode": "affine"}
        config["quantization"] = record
        config["quantization_config"] = record  # mlx-lm writes both (Hugging Face reads this)
    else:
        if any("perm" in m for m in zero_point_modules(model).values()):
            record.setdefault("reason", "act-order column permutation")
        config["quantization"] = record
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_model(tmp, model, donate_model=False)
        (tmp / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
        if source_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(source_dir) / name).is_file():
                    shutil.copy(Path(source_dir) / name, tmp / name)
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
