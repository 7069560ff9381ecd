"""Weight quantization: the format (``format``: w = s * (q - z), exact in MLX's affine layout),
the kernels and their fallback (``kernels``; on-device checks in ``kernel_check``), the quantizers
(``rtn``, ``gptq``, ``awq``) and their calibration (``calibrate``), mixed precision (``mixed``),
the layers (``layers``), the driver (``quantize``) and files (``storage``):

    from mlxspec.quant import quantize_model, save_quantized
    model, quantization = quantize_model(model, bits=4, group_size=64, dtype="float16")
    save_quantized(model, "out", config=config, quantization=quantization)  # plain mlx-lm loads it
"""

_API = ("quantize_model", "save_quantized", "calibration_windows")


def __getattr__(name: str):
    # Imported on first use, so that `mlxspec.quant.zp_format` stays light for the kernels.
    if name in _API:
        from mlxspec.quant import calibrate, quantize, storage

        home = {"save_quantized": storage, "calibration_windows": calibrate}.get(name, quantize)
        return getattr(home, name)
    raise AttributeError(f"module 'mlxspec.quant' has no attribute {name!r}")
