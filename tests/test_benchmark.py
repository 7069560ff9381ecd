"""mlxspec.benchmark's measurement helpers, against independent counts (the files on disk)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import make_tiny_model

from mlxspec import benchmark


@pytest.mark.parametrize("tied", [True, False])
def test_model_bytes_is_what_one_token_reads(tmp_path, tied):
    from mlxspec.load import load

    model_dir = make_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    model, _ = load(str(model_dir))
    stored = {k: v for f in model_dir.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    total = sum(v.nbytes for v in stored.values())
    embedding = sum(v.nbytes for k, v in stored.items() if "embed_tokens" in k)
    # tied: the table is the output head and is read whole; untied: one row per token
    assert benchmark.model_bytes(model) == (total if tied else total - embedding)


def test_bandwidth_and_roofline_arithmetic():
    assert benchmark.achieved_bandwidth(2_000_000_000, 5.0) == pytest.approx(10.0)
    assert benchmark.roofline(10.0, 40.0) == pytest.approx(0.25)


def test_measured_bandwidths_are_plausible():
    copy, read = benchmark.memory_bandwidth(megabytes=32, repeats=2), benchmark.read_bandwidth(
        megabytes=32, repeats=2)
    assert 0.05 < copy < 2000 and 0.05 < read < 2000  # GB/s: any machine, loaded or not
