"""SmolLM2-135M quantized with GPTQ in float16 (4 bits, g64): MLX's affine layout, exact in
float16, from which plain mlx-lm loads and dequantizes the weights bit for bit and computes the
logits mlxspec computes, bit for bit (the checks: ``quant_storage_checks.py``).
"""

from __future__ import annotations

import pytest
from quant_storage_checks import (
    check_calibrated_beats_round_to_nearest,
    check_mlx_lm_computes_mlxspec_logits_bit_for_bit,
    check_mlx_lm_dequantizes_every_weight_to_s_times_q_minus_z,
    quantize_and_save,
)


@pytest.fixture(scope="module")
def saved(smollm2_dir, smollm2, tmp_path_factory):
    return quantize_and_save(smollm2_dir, tmp_path_factory.mktemp("q") / "smollm2-gptq", "gptq",
                             "float16", smollm2[1])


@pytest.mark.slow
def test_mlx_lm_dequantizes_every_weight_to_s_times_q_minus_z_bit_for_bit(saved):
    check_mlx_lm_dequantizes_every_weight_to_s_times_q_minus_z(saved)


@pytest.mark.slow
def test_mlx_lm_computes_mlxspec_logits_bit_for_bit_in_the_chosen_dtype(saved, monkeypatch):
    check_mlx_lm_computes_mlxspec_logits_bit_for_bit(saved, monkeypatch)


@pytest.mark.slow
def test_calibrated_quantization_beats_round_to_nearest(saved, smollm2):
    check_calibrated_beats_round_to_nearest(saved, smollm2)
