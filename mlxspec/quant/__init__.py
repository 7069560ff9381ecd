"""Zero-point weight quantization: the format (``format``), the kernels and their fallback
(``kernels``), the quantizers and layers."""
