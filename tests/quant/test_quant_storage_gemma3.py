"""Gemma-3-270M quantized with AWQ in bfloat16 (4 bits, g64): MLX's affine layout, exact in
bfloat16, from which plain mlx-lm loads and dequantizes the weights bit for bit and computes the
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

from mlxspec.gguf.tensors import dense_conversion
from mlxspec.load import resolve_model_path
from mlxspec.quant import awq


@pytest.fixture(scope="module")
def saved(gemma3_gguf, gemma3, tmp_path_factory):
    # AWQ's exponent searched on 2 points (0 and 0.5) instead of 20: these checks are about the
    # stored format, and the coarse search still beats round-to-nearest by far (KL 0.60 against
    # 1.05 on the held-out window, where the check asks for 0.9x).
    # Quantization needs the float source, whatever the device imports GGUF blocks as.
    with pytest.MonkeyPatch.context() as patch, dense_conversion():
        patch.setattr(awq, "ALPHAS", awq.ALPHAS[::10])
        return quantize_and_save(resolve_model_path(str(gemma3_gguf)),
                                 tmp_path_factory.mktemp("q") / "gemma3-awq", "awq", "bfloat16",
                                 gemma3[1])


@pytest.mark.slow
def test_mlx_lm_dequantizes_every_weight_to_s_times_q_minus_z_bit_for_bit(saved):
    check_mlx_lm_dequantizes_every_weight_to_s_times_q_minus_z(saved)


@pytest.mark.slow
def test_mlx_lm_computes_mlxspec_logits_bit_for_bit_in_the_chosen_dtype(saved, monkeypatch):
    check_mlx_lm_computes_mlxspec_logits_bit_for_bit(saved, monkeypatch)


@pytest.mark.slow
def test_calibrated_quantization_beats_round_to_nearest(saved, gemma3):
    # 96 tokens (each of Gemma-3's passes computes 262,144 logits a position): KL 0.60 against
    # 1.05, top-1 57 % against 45 %, far from either limit.
    check_calibrated_beats_round_to_nearest(saved, gemma3, window_tokens=96)
