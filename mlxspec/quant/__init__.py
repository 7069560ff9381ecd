"""Zero-point weight quantization: the format (``format``), the kernels and their fallback
(``kernels``), the quantizers (``rtn``, ``gptq``, ``awq``), mixed precision (``mixed``), the layers
(``layers``), whole-model quantization (``quantize``) and files (``storage``):

    from mlxspec.quant import quantize_model, save_quantized
    model, quantization = quantize_model(model, bits=4, group_size=64)
"""

_API = ("quantize_model", "save_quantized", "calibration_windows")


def __getattr__(name: str):
    # Imported on first use, so that `mlxspec.quant.format` stays light for the kernels.
    if name in _API:
        from mlxspec.quant import quantize, storage

        return getattr(storage if name == "save_quantized" else quantize, name)
    raise AttributeError(f"module 'mlxspec.quant' has no attribute {name!r}")
