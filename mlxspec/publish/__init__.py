"""A quantized model made, described and shared.

    quantize_flow   ``quantize_to_dir``: quantize, evaluate, gate, write atomically
    card            the model card (README.md) from the quantization and evaluation records
    hub             the Hugging Face Hub upload (``mlxspec upload``)
"""
