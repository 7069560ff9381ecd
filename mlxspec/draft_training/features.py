"""The target's side of training: its fused taps and top-K next-token choices on every sample.

Computed once per sample (one target forward over prompt + answer) and kept in ``features/``
shards of ``SHARD`` samples (written to a temporary name, then renamed: a kill loses at most
the shard being computed, and a rerun skips the shards that exist). The draft vocabulary is the
``draft_vocab`` tokens the target emits most often in its answers (SpecForge's frequency rule),
the end-of-turn token always included.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec.progress import progress_bar
from mlxspec.speculative.feature import tapped_forward

SHARD = 32  # samples per features file
TOP_K = 8  # target choices kept per position (the soft labels)
MAX_LENGTH = 512  # prompt + answer tokens used per sample


def draft_vocabulary(samples: list[dict[str, Any]], size: int, always: list[int]) -> list[int]:
    """The ``size`` most frequent answer tokens (plus ``always``), as ascending target ids."""
    counts = Counter(t for s in samples for t in s["response"])
    ids = set(always)
    for token, _ in counts.most_common():
        if len(ids) >= size:
            break
        ids.add(token)
    return sorted(ids)


def _shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard_{index // SHARD:05d}.npz"


def _count(path: Path) -> int:
    """Samples in a shard (0 if missing or unreadable: it is computed again)."""
    try:
        with np.load(path) as shard:
            return sum(1 for k in shard.files if k.startswith("tokens_"))
    except (OSError, ValueError):
        return 0


def compute_features(
    model: nn.Module, samples: list[dict[str, Any]], directory: Path, taps: list[int],
    show_progress: bool = True,
) -> list[Path]:
    """Write the shards of ``samples`` that are missing; return every shard's path in order.

    Each shard holds, per sample i: ``features_i`` (n, 3H) float16, ``top_ids_i`` (n, K) int32
    target ids and ``top_probs_i`` (n, K) float16 of the target's next-token distribution at
    each position, and ``tokens_i`` (n,) with ``prompt_i`` the prompt length.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [_shard_path(directory, i) for i in range(0, len(samples), SHARD)]
    todo = [i for i, p in enumerate(paths)
            if _count(p) != len(samples[i * SHARD : (i + 1) * SHARD])]
    with progress_bar("target features", len(todo), show_progress) as advance:
        for index in todo:
            arrays: dict[str, np.ndarray] = {}
            for i, sample in enumerate(samples[index * SHARD : (index + 1) * SHARD]):
                tokens = (sample["prompt"] + sample["response"])[:MAX_LENGTH]
                logits, features = tapped_forward(model, mx.array(tokens)[None], None, taps)
                probs = mx.softmax(logits[0].astype(mx.float32), axis=-1)
                top = mx.argpartition(-probs, TOP_K - 1, axis=-1)[:, :TOP_K]  # no full sort
                top_probs = mx.take_along_axis(probs, top, axis=-1)
                order = mx.argsort(-top_probs, axis=-1)  # most likely first
                top = mx.take_along_axis(top, order, axis=-1)
                top_probs = mx.take_along_axis(top_probs, order, axis=-1)
                mx.eval(features, top, top_probs)
                arrays[f"features_{i}"] = np.array(features[0].astype(mx.float16))
                arrays[f"top_ids_{i}"] = np.array(top.astype(mx.int32))
                arrays[f"top_probs_{i}"] = np.array(top_probs.astype(mx.float16))
                arrays[f"tokens_{i}"] = np.array(tokens, np.int32)
                arrays[f"prompt_{i}"] = np.array(len(sample["prompt"]), np.int32)
            temporary = paths[index].with_suffix(".partial.npz")
            np.savez(temporary, **arrays)
            os.replace(temporary, paths[index])
            mx.clear_cache()
            advance()
    return paths


def load_shards(paths: list[Path]) -> list[dict[str, np.ndarray]]:
    """Every sample of the shards: dicts of features, top_ids, top_probs, tokens, prompt."""
    out = []
    for path in paths:
        with np.load(path) as shard:
            count = sum(1 for k in shard.files if k.startswith("tokens_"))
            for i in range(count):
                out.append({key: shard[f"{key}_{i}"] for key in
                            ("features", "top_ids", "top_probs", "tokens", "prompt")})
    return out
