"""Decode benchmark: mlxspec's plain decoding side by side with mlx-lm's, plus the roofline.

Decode is memory-bound: every generated token reads the model's weights once, so
``achieved bandwidth = bytes read per token × tokens/s`` and its ratio to the machine's measured
copy bandwidth (the roofline fraction) says how much speed is left on the table.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

DEFAULT_PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def best_seconds(run: Callable[[], Any], repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed calls of ``run`` after one untimed warm-up, in seconds."""
    run()
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - tic)
    return best


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Measured copy bandwidth in GB/s: best of ``repeats`` copies of a ``megabytes`` buffer with
    numpy (a plain memcpy into preallocated memory, so page faults do not count), counting bytes
    read + bytes written over wall time. MLX's CPU elementwise copy is not a bandwidth probe.
    On Metal the weights are read by the GPU, so its copy bandwidth is the roofline there."""
    if mx.metal.is_available():
        from mlxspec.quant.kernel_timing import gpu_copy_bandwidth

        return gpu_copy_bandwidth(megabytes)
    src = np.ones(megabytes * (1 << 20), dtype=np.uint8)
    dst = np.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


def read_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Measured read bandwidth in GB/s: best of ``repeats`` sums of a ``megabytes`` float32
    buffer (bytes read over wall time) — what decoding does with the weights."""
    src = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    return src.nbytes / best_seconds(src.sum, repeats) / 1e9


def model_bytes(model: nn.Module) -> int:
    """Bytes one decoded token reads: every parameter, except that an input embedding table not
    shared with the output head is read one row at a time (not counted)."""
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", True)
    if not tied:
        for name, module in model.named_modules():
            if name.endswith("embed_tokens"):
                total -= sum(v.nbytes for _, v in tree_flatten(module.parameters()))
    return total


def achieved_bandwidth(nbytes: int, tokens_per_second: float) -> float:
    """GB/s a decoder reading ``nbytes`` per token achieves at ``tokens_per_second``."""
    return nbytes * tokens_per_second / 1e9


def roofline(achieved_gbs: float, bandwidth_gbs: float) -> float:
    """Fraction of the measured memory bandwidth a decoder achieves (1.0 = memory-bound limit)."""
    return achieved_gbs / bandwidth_gbs


def _run(engine: str, model, tokenizer, prompt_ids: list[int], max_tokens: int,
         draft: Any = None, num_draft_tokens: int | str = "auto") -> dict:
    """One decode of ``max_tokens`` with ``engine`` ("mlxspec", "mlx_lm", or "draft": mlxspec
    with the drafter ``draft`` drafting ``num_draft_tokens``): its speed stats."""
    kwargs = {}
    if engine == "mlx_lm":
        from mlx_lm import stream_generate
    else:
        from mlxspec.generate import stream_generate

        if engine == "draft":
            draft.reset()
            kwargs = {"draft": draft, "num_draft_tokens": num_draft_tokens}
    last = deque(stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens, **kwargs),
                 maxlen=1)[0]
    stats = {"prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps,
             "generation_tokens": last.generation_tokens, "peak_memory_gb": last.peak_memory}
    spec = getattr(last, "spec_stats", None)
    if engine == "draft" and spec is not None:
        stats["tokens_per_pass"] = spec.tokens_per_pass
        stats["acceptance_rate"] = spec.acceptance_rate
    return stats


def _median_runs(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def compare_decode(
    model_spec: str | None = None,
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 64,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    draft: str | None = None,
    shard: str | None = None,
    num_draft_tokens: int | str = "auto",
) -> dict[str, Any]:
    """Decode and prefill speed of mlxspec vs mlx-lm on the same model and prompt, in one process.

    ``draft``: also mlxspec with this feature draft (``"auto"``: the head shipped for the model,
    left out when there is none; or a head's directory), reported as the ``draft`` engine with
    its tokens per target pass and ``draft_ratio`` (÷ mlxspec's plain decoding), drafting
    ``num_draft_tokens``. ``shard`` ("tensor" or "pipeline", under ``mlx.launch``): the model is
    sharded over the group and every rank runs the same decodes (with "auto", rank 0's draft
    lengths: ``mlxspec.distributed.drafting``).

    Runs alternate between the two (after one warm-up each) so that drift in machine load hits
    both; medians of ``repeats`` runs are reported.

    Returns:
        dict with ``model``, ``model_bytes`` (bytes read per token), ``memory_bandwidth_gbs``,
        per engine ``prompt_tps``, ``generation_tps``, ``bandwidth_gbs``, ``roofline``, and
        ``decode_ratio`` / ``prefill_ratio`` (mlxspec ÷ mlx-lm).
    """
    from mlxspec.chat_template import chat_prompt
    from mlxspec.cpu import blas_report
    from mlxspec.distributed import group_report, load_sharded
    from mlxspec.quant import kernels

    say = progress or (lambda _msg: None)
    say("loading model")
    model, tokenizer = load_sharded(model_spec, shard)
    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        prompt_ids = chat_prompt(tokenizer, messages)
    else:
        prompt_ids = tokenizer.encode(prompt)
    nbytes = model_bytes(model)
    say("measuring memory bandwidth")
    bandwidth = memory_bandwidth()
    runs: dict[str, list[dict[str, float]]] = {"mlx_lm": [], "mlxspec": []}
    drafter = None
    if draft not in (None, "none"):
        from mlxspec.speculative import FeatureDraft, make_drafter

        drafter = make_drafter(tokenizer, model, draft_model=FeatureDraft(draft))
        if drafter is not None:
            runs["draft"] = []
    for engine in runs:  # warm-up
        _run(engine, model, tokenizer, prompt_ids, 8, drafter, num_draft_tokens)
    for i in range(repeats):
        for engine, engine_runs in runs.items():
            say(f"run {i + 1}/{repeats}: {engine}")
            engine_runs.append(_run(engine, model, tokenizer, prompt_ids, max_tokens, drafter,
                                    num_draft_tokens))
    result: dict[str, Any] = {
        "model": model_spec or "default (SmolLM2-135M-Instruct)",
        "prompt_tokens": len(prompt_ids),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "model_bytes": nbytes,
        "memory_bandwidth_gbs": bandwidth,
        "blas": blas_report(measure=False),
        "device": str(mx.default_device()),
        # MLXSPEC_KERNELS=emulate: the zero-point kernels ran in the CPU emulator
        "emulated": kernels.EMULATED if kernels.emulating() else None,
    }
    if shard is not None:
        result["group"] = {**group_report(), "layout": model.shard_layout}
    for name, rs in runs.items():
        med = _median_runs(rs)
        med["bandwidth_gbs"] = achieved_bandwidth(nbytes, med["generation_tps"])
        med["roofline"] = roofline(med["bandwidth_gbs"], bandwidth)
        result[name] = med
    result["decode_ratio"] = result["mlxspec"]["generation_tps"] / result["mlx_lm"]["generation_tps"]
    result["prefill_ratio"] = result["mlxspec"]["prompt_tps"] / result["mlx_lm"]["prompt_tps"]
    if "draft" in result:
        result["draft_ratio"] = (result["draft"]["generation_tps"]
                                 / result["mlxspec"]["generation_tps"])
    return result
