"""Mixed precision: which bits each layer gets, from a recipe or from a measured sensitivity.

A *plan* maps every quantizable layer path (each ``nn.Linear`` and ``nn.Embedding``; a tied output
head is the embedding) to a :class:`LayerSpec` or None (left in float).

- Recipes are JSON (``models/quantization/*.json``, installed as ``mlxspec.recipes``;
  :func:`load_recipe`).
- :func:`sensitivity_recipe` measures, for each *kind* of layer (``model.layers.*.mlp.down_proj``,
  ``model.embed_tokens``, ...), the mean KL divergence from the float model when only that kind is
  rounded to the low bit width, on a few calibration windows; then it gives the high bit width to
  the kinds with the most KL per extra stored bit until the average storage over the quantized
  weights reaches the target bits per weight.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec.errors import QuantizationError
from mlxspec.quant import rtn, zp_format
from mlxspec.quant.layers import is_quantized, replace_modules, zero_point_like

HIGH_BITS = 8  # the width sensitive layers are promoted to


@dataclass(frozen=True)
class LayerSpec:
    """How one layer is quantized."""

    bits: int
    group_size: int




def load_recipe(name_or_path: str | Path) -> dict[str, Any]:
    """A mixed-precision recipe: a JSON file, or the name of one in ``models/`` (``embed8``).

    A recipe is ``{"kind": "quantization-recipe", "description": ..., "rules": [...]}``; each rule
    has ``match`` (a regular expression searched in the layer path, e.g. ``"mlp\\.down_proj$"``),
    optionally ``layers`` (``[[lo, hi], ...]``: fractions of the depth, ``lo <= i / n < hi``
    for block ``i`` of ``n``), and ``bits`` (null keeps the layer unquantized) and/or
    ``group_size``. The first matching rule wins; unmatched layers use the default bits.
    """
    path = Path(name_or_path)
    if not path.is_file():
        packaged = resources.files("mlxspec.recipes") / "quantization" / f"{name_or_path}.json"
        if not packaged.is_file():
            names = sorted(
                p.name[:-5]
                for p in (resources.files("mlxspec.recipes") / "quantization").iterdir()
                if p.name.endswith(".json") and _is_recipe(json.loads(p.read_text()))
            )
            raise QuantizationError(
                f"no recipe {name_or_path!r}: give a JSON file or one of {', '.join(names)}"
            )
        path = Path(str(packaged))
    try:
        recipe = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuantizationError(f"recipe {path} is not valid JSON: {e}") from e
    if not _is_recipe(recipe):
        raise QuantizationError(f"{path} is not a quantization recipe (no \"rules\" list)")
    for i, rule in enumerate(recipe["rules"]):
        _check_rule(rule, f"recipe {path}, rule {i + 1}")
    recipe.setdefault("name", path.stem)
    return recipe


def _check_rule(rule: Any, where: str) -> None:
    """Refuse a rule that would fail only after the model has loaded (a bad regex or range)."""
    if not isinstance(rule, dict) or not isinstance(rule.get("match"), str):
        raise QuantizationError(f"{where}: needs \"match\", a regular expression string")
    try:
        re.compile(rule["match"])
    except re.error as e:
        raise QuantizationError(f"{where}: \"match\" {rule['match']!r} is not a valid regular "
                                f"expression ({e})") from e
    ranges = rule.get("layers", [])
    if not isinstance(ranges, list) or not all(
        isinstance(r, list) and len(r) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in r)
        and 0 <= r[0] < r[1] <= 1
        for r in ranges
    ):
        raise QuantizationError(f"{where}: \"layers\" must be [[lo, hi], ...] with "
                                "0 <= lo < hi <= 1 (fractions of the depth)")


def _is_recipe(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("rules"), list)


def _block_index(path: str) -> int | None:
    match = re.search(r"\blayers\.(\d+)\.", path)
    return int(match.group(1)) if match else None


def _rule_for(path: str, rules: list[dict], n_blocks: int) -> dict | None:
    for rule in rules:
        if not re.search(rule["match"], path):
            continue
        if "layers" in rule:
            index = _block_index(path)
            if index is None or not any(
                lo <= index / n_blocks < hi for lo, hi in rule["layers"]
            ):
                continue
        return rule
    return None


def quantizable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> module of every ``nn.Linear`` and ``nn.Embedding`` of ``model``."""
    return {
        path: module
        for path, module in model.named_modules()
        if type(module) in (nn.Linear, nn.Embedding)
    }


def plan_layers(
    model: nn.Module,
    bits: int,
    group_size: int,
    *,
    recipe: dict | None = None,
    group_fallback: bool = False,
) -> dict[str, LayerSpec | None]:
    """Path -> :class:`LayerSpec` (or None: stays unquantized) for every quantizable layer.

    Raises QuantizationError (one line) if the model is already quantized, a bit width is
    unsupported, or a group size does not divide a layer's input size (with
    ``group_fallback`` such layers take the largest supported group size that divides it).
    """
    if is_quantized(model):
        raise QuantizationError(
            "the model is already quantized: quantize its unquantized source instead"
        )
    layers = quantizable_layers(model)
    if not layers:
        raise QuantizationError("the model has no nn.Linear or nn.Embedding layer to quantize")
    rules = (recipe or {}).get("rules", [])
    n_blocks = len(getattr(model, "layers", [])) or 1
    plan: dict[str, LayerSpec | None] = {}
    misfits = []
    for path, module in layers.items():
        rule = _rule_for(path, rules, n_blocks) or {}
        layer_bits = rule.get("bits", bits)
        if layer_bits is None:
            plan[path] = None
            continue
        layer_group = rule.get("group_size", group_size)
        zp_format.check_spec(layer_bits, layer_group, layer_group)  # the values themselves
        in_features = module.weight.shape[-1]
        if in_features % layer_group:
            fits = [g for g in zp_format.SUPPORTED_GROUP_SIZES if in_features % g == 0]
            if not group_fallback:
                misfits.append((path, in_features))
                continue
            if not fits:
                raise QuantizationError(
                    f"{path}: in_features={in_features} is a multiple of no supported group "
                    'size: keep it unquantized with a recipe rule {"bits": null}'
                )
            layer_group = max(fits)
        plan[path] = LayerSpec(layer_bits, layer_group)
    if misfits:
        path, in_features = misfits[0]
        fits = [g for g in zp_format.SUPPORTED_GROUP_SIZES if in_features % g == 0]
        others = f" and {len(misfits) - 1} other layers" if len(misfits) > 1 else ""
        raise QuantizationError(
            f"group size {group_size} does not divide in_features={in_features} of {path}"
            f"{others}: use --group-size {max(fits) if fits else 32}, or --group-fallback to "
            "give those layers the largest group size that fits"
        )
    return plan


# -- measured sensitivity ----------------------------------------------------------------------


def layer_kind(path: str) -> str:
    """The kind of a layer: its path with the block index replaced by ``*``."""
    return re.sub(r"\blayers\.\d+\.", "layers.*.", path)


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def measure_sensitivity(
    model: nn.Module, tokens, plan: dict[str, LayerSpec | None], *, grid: int = rtn.DEFAULT_GRID,
    advance=lambda: None,
) -> dict[str, float]:
    """Mean KL(float || quantized) per token, in nats, when only one kind of layer is rounded
    (RTN at its ``plan`` spec) and the rest of ``model`` stays float; one entry per kind.

    Args:
        model: the unquantized model (restored before returning).
        tokens: ``(windows, T)`` token ids.
        plan: from :func:`plan_layers`.
    """
    tokens = mx.array(tokens)
    reference = _log_softmax(model(tokens))
    mx.eval(reference)
    modules = quantizable_layers(model)
    kinds: dict[str, list[str]] = {}
    for path, spec in plan.items():
        if spec is not None:
            kinds.setdefault(layer_kind(path), []).append(path)
    sensitivity = {}
    for kind, paths in kinds.items():
        originals = {p: modules[p] for p in paths}
        rounded = {}
        for p in paths:
            q, s, z = rtn.quantize(np.array(originals[p].weight.astype(mx.float32)),
                                   plan[p].bits, plan[p].group_size, grid=grid)
            rounded[p] = zero_point_like(originals[p], q, s, z, bits=plan[p].bits,
                                         group_size=plan[p].group_size)
        replace_modules(model, rounded)
        try:
            logq = _log_softmax(model(tokens))
            kl = (mx.exp(reference) * (reference - logq)).sum(axis=-1).mean()
            sensitivity[kind] = max(float(kl.item()), 0.0)
        finally:
            replace_modules(model, originals)
        advance()
    return sensitivity


def sensitivity_recipe(
    model: nn.Module,
    tokens,
    *,
    bits: int,
    group_size: int,
    target_bpw: float,
    group_fallback: bool = False,
    high_bits: int = HIGH_BITS,
    advance=lambda: None,
) -> dict[str, Any]:
    """A recipe giving ``high_bits`` to the kinds of layers whose rounding costs the most KL per
    extra stored bit, while the storage averaged over the quantized weights stays within
    ``target_bpw`` (see :func:`mlxspec.quant.zp_format.bits_per_weight`).

    Returns a recipe dict (as :func:`load_recipe`) with the measurements under ``sensitivity``.
    """
    plan = plan_layers(model, bits, group_size, group_fallback=group_fallback)
    sensitivity = measure_sensitivity(model, tokens, plan, advance=advance)
    modules = quantizable_layers(model)
    weights = {kind: 0 for kind in sensitivity}
    extra_bits = dict.fromkeys(sensitivity, 0.0)
    total_weights, stored_bits = 0, 0.0
    for path, spec in plan.items():
        if spec is None:
            continue
        n = modules[path].weight.size
        kind = layer_kind(path)
        weights[kind] += n
        extra_bits[kind] += n * (zp_format.bits_per_weight(high_bits, spec.group_size)
                                 - zp_format.bits_per_weight(spec.bits, spec.group_size))
        total_weights += n
        stored_bits += n * zp_format.bits_per_weight(spec.bits, spec.group_size)
    budget = target_bpw * total_weights - stored_bits
    if budget < 0:
        raise QuantizationError(
            f"target {target_bpw} bits per weight is below the {stored_bits / total_weights:.2f} "
            f"that {bits}-bit weights at group size {group_size} already take: raise it"
        )
    promoted = []
    for kind in sorted(sensitivity, key=lambda k: sensitivity[k] / extra_bits[k], reverse=True):
        if extra_bits[kind] <= budget:
            promoted.append(kind)
            budget -= extra_bits[kind]
    return {
        "kind": "quantization-recipe",
        "name": f"sensitivity:{target_bpw:g}",
        "description": f"{', '.join(promoted) or 'no layer'} at {high_bits} bits, by measured "
                       f"sensitivity within {target_bpw:g} bits per weight",
        "rules": [
            {"match": "^" + re.escape(kind).replace(r"\*", r"\d+") + "$", "bits": high_bits}
            for kind in promoted
        ],
        "sensitivity": sensitivity,
    }
